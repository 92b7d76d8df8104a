"""Evaluation pieces: suite files (multiple choice by log-likelihood, generation by exact match),
bits per byte across tokenizers, the report table, and lm-evaluation-harness's own Hugging Face
model type on the same local files, agreeing with our scorer."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from tasks.configs import ModelConfig
from tasks.eval import suites as suite_lib
from tasks.model.gpt import GPT
from tasks.train.prepared_data import DataDir, load_tokenizer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_data_dir):
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=300, block_size=32, n_layer=1, n_head=2, n_embd=32)).eval()
    data = DataDir(tiny_data_dir)
    return model, load_tokenizer(data.tokenizer_path), data.eos_id


def test_continuation_logprob_is_the_sum_of_the_models_token_logprobs(model_and_tokenizer):
    model, _, _ = model_and_tokenizer
    context, continuation = [5, 17, 42, 9], [33, 71]
    [(got, greedy)] = suite_lib.continuation_logprobs(model, [(context, continuation)], CPU)
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([context + continuation[:-1]]))[0][0], -1)
    expected = float(logp[3, 33] + logp[4, 71])
    assert got == pytest.approx(expected, abs=1e-5)
    assert greedy == (int(logp[3].argmax()) == 33 and int(logp[4].argmax()) == 71)
    # longer than the context window: the oldest context tokens go, the score stays defined
    [(long, _)] = suite_lib.continuation_logprobs(model, [(list(range(1, 60)), [33])], CPU)
    assert math.isfinite(long)


def test_multiple_choice_picks_the_most_likely_choice(model_and_tokenizer, tmp_path):
    model, tokenizer, eos_id = model_and_tokenizer
    items = []
    for query in ("Q: What number comes after 12?\nA:", "The module", "Return the"):
        ids = tokenizer.encode(query, add_special_tokens=False).ids
        with torch.no_grad():
            ranked = model(torch.tensor([ids]))[0][0, -1].argsort(descending=True).tolist()
        # choices that are one token each, so their log-likelihoods are the model's next-token
        # scores: the model's likeliest such token is gold, three unlikely ones are the others
        single = [t for t in ranked if t != eos_id and tokenizer.encode(
            tokenizer.decode([t]), add_special_tokens=False).ids == [t]]
        choices = [tokenizer.decode([t]) for t in (single[-1], single[-2], single[-3], single[0])]
        items.append({"query": query, "choices": choices, "gold": 3})
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    suite = suite_lib.load_suite(path)
    assert (suite.name, len(suite.choice_items), len(suite.generation_items)) == ("mine", 3, 0)
    scores = suite_lib.score_suite(model, tokenizer, eos_id, suite, CPU)
    assert scores["choice_accuracy"] == scores["accuracy"] == 1.0 and scores["items"] == 3


def test_generation_is_scored_by_exact_match_of_the_greedy_answer(tiny_data_dir, tmp_path):
    """A tiny model that memorized three answers gets exactly those right, not a fourth."""
    from tasks.configs import FinetuneConfig
    from tasks.posttrain.batches import SFTSteps
    from tasks.posttrain.objectives import next_token_loss
    from tasks.train.prepared_data import load_sft
    from tasks.train.loop import train
    from tasks.train.runtime import pick_device

    pick_device()
    data = DataDir(tiny_data_dir)
    tokenizer = load_tokenizer(data.tokenizer_path)
    known = [("Q: What number comes after 41?\nA:", " 42"), ("Name a colour.\nA:", " red"),
             ("Q: What number comes before 9?\nA:", " 8")]
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n"
                                  for p, c in known))
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=300, block_size=32, n_layer=1, n_head=2, n_embd=32))
    cfg = FinetuneConfig(base_model="-", data_dir="-", output_dir=str(tmp_path / "run"),
                         max_steps=150, batch_size=3, replay_fraction=0.0, eval_interval=150,
                         checkpoint_interval=150, log_interval=150)
    cfg.optim.lr = 1e-2
    examples = load_sft(train_file, tokenizer, data.eos_id)
    train(model=model, cfg=cfg, loss_fn=next_token_loss, evaluate=lambda m: {},
          get_batch=SFTSteps(examples, batch_size=3, seed=0, block_size=32, pad_id=data.eos_id),
          device=CPU, resolved_config={}, tracking=False)
    suite_file = tmp_path / "memory.jsonl"
    items = [{"prompt": p, "answer": c} for p, c in known] + [
        {"prompt": known[0][0], "answer": " 43"}]
    suite_file.write_text("".join(json.dumps(x) + "\n" for x in items))
    suite = suite_lib.load_suite(suite_file)
    scores, correct = suite_lib.score_suite_items(model, tokenizer, data.eos_id, suite, CPU)
    assert scores["exact_match"] == scores["accuracy"] == 0.75
    assert correct == [True, True, True, False]   # item by item, for the gate's paired comparison
    ids = suite_lib.suite_item_ids(suite)
    assert len(set(ids)) == 4 and ids == suite_lib.suite_item_ids(suite_lib.load_suite(suite_file))
    assert suite_lib.item_results(ids, correct)["correct"] == "1110"


def test_bad_suite_lines_are_refused_with_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"query": "q", "choices": ["a", "b"], "gold": 0}) + "\n"
                    + json.dumps({"query": "q", "choices": ["a"], "gold": 0}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a multiple-choice item needs"):
        suite_lib.load_suite(path)
    (tmp_path / "other.jsonl").write_text(json.dumps({"text": "no"}) + "\n")
    with pytest.raises(ValueError, match=r"other.jsonl:1: expected"):
        suite_lib.load_suite(tmp_path / "other.jsonl")


def test_demo_suites_come_from_held_out_material(tiny_data_dir, tmp_path):
    paths = suite_lib.write_demo_suites(tiny_data_dir, tmp_path, n_items=15)
    assert [p.name for p in paths] == ["sft_choice.jsonl", "prose_cloze.jsonl"]
    eval_prompts = {json.loads(line)["prompt"]
                    for line in (tiny_data_dir / "sft" / "eval.jsonl").read_text().splitlines()}
    choice = [json.loads(line) for line in paths[0].read_text().splitlines()]
    assert len(choice) == 15 and all(item["query"] in eval_prompts for item in choice)
    cloze = suite_lib.load_suite(paths[1])
    assert len(cloze.choice_items) == 15
    assert all(len(item["choices"]) == 4 and item["choices"][item["gold"]].startswith(" ")
               for item in cloze.choice_items)


def test_bits_per_byte_does_not_depend_on_the_tokenizer(tiny_data_dir, tmp_path):
    """A model scored through another tokenizer sees the same held-out text: its bits per byte is
    comparable, its per-token perplexity is not."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    from tasks.eval.language import (eos_id_of, held_out_batches, language_scores,
                                     token_byte_lengths)

    data = DataDir(tiny_data_dir)
    # a byte-level tokenizer with no merges: 256 byte tokens plus EOS, nothing learned
    vocab = {ch: i + 1 for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab["<|endoftext|>"] = 0
    bytes_only = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bytes_only.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bytes_only.decoder = decoders.ByteLevel()
    bytes_only.add_special_tokens(["<|endoftext|>"])
    path = tmp_path / "tokenizer.json"
    bytes_only.save(str(path))
    eos = eos_id_of(bytes_only, data, path)
    assert eos == 0
    batches = held_out_batches(data, bytes_only, eos, path, block_size=32, batch_size=8,
                               max_batches=2)
    assert batches[0].inputs.shape == (8, 32)
    sizes = token_byte_lengths(path, bytes_only)
    assert sizes[0] == 0 and set(sizes[1:].tolist()) == {1}  # one byte per token
    # a uniform model over 257 tokens: ln(257) nats per token, one byte per token
    uniform = GPT(ModelConfig(vocab_size=257, block_size=32, n_layer=1, n_head=1, n_embd=8))
    torch.nn.init.zeros_(uniform.lm_head.weight)
    scores = language_scores(uniform, batches, sizes, CPU)
    assert scores["perplexity"] == pytest.approx(257, rel=1e-4)
    eos_share = 1 - scores["scored_bytes"] / scores["scored_tokens"]
    assert scores["bits_per_byte"] == pytest.approx(math.log2(257) / (1 - eos_share), rel=1e-4)


def test_report_table_has_a_row_per_model_and_a_column_per_metric(tmp_path):
    from tasks.eval.eval_report import markdown, table

    models = {"teacher": {"metrics": {"params": 100, "perplexity": 50.123, "bits_per_byte": 1.5,
                                      "task_accuracy": 0.9, "suite.x.accuracy": 0.5}},
              "student": {"metrics": {"params": 20, "perplexity": 70.0, "bits_per_byte": 1.7,
                                      "task_accuracy": 0.8}}}
    header, rows = table(models)
    assert header == ["model", "params", "perplexity", "bits_per_byte", "task_accuracy",
                      "suite.x.accuracy"]
    assert rows[1] == ["student", 20, 70.0, 1.7, 0.8, None]
    text = markdown(header, rows).splitlines()
    assert text[2] == "| teacher | 100 | 50.12 | 1.5 | 0.9 | 0.5 |"


def test_lm_evaluation_harness_scores_our_local_suites_like_our_own_scorer(
        model_and_tokenizer, tiny_data_dir, tmp_path, monkeypatch):
    from tasks.eval.harness import fit_to_context, hf_tokenizer, run_harness, task_config
    from tasks.train.export import export_model

    # no network, and no cache outside the test's directory
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    model, tokenizer, eos_id = model_and_tokenizer
    model_dir = export_model(model, tmp_path, DataDir(tiny_data_dir).tokenizer_path, {},
                             eos_id=eos_id)
    paths = suite_lib.write_demo_suites(tiny_data_dir, tmp_path / "suites", n_items=12)
    gen = tmp_path / "suites" / "echo.jsonl"
    gen.write_text("".join(json.dumps({"prompt": p, "answer": " 4"}) + "\n"
                           for p in ("Q: What number comes after 3?\nA:", "Two plus two is")))
    assert task_config(paths[0])["output_type"] == "multiple_choice"
    assert task_config(gen)["output_type"] == "generate_until"
    # the harness scores the model transformers loads from model_dir: the GPT-2 our GPT is
    scores, per_item = run_harness(model, model_dir, eos_id, [*paths, gen], CPU)
    fast = hf_tokenizer(model_dir, eos_id)
    for path in paths:
        # items whose answer alone outgrows the 32-token context are left out, and counted
        fitting, left_out = fit_to_context(path, fast, 32, tmp_path, None)
        assert scores[f"harness.{path.stem}.left_out"] == left_out < 12
        suite = suite_lib.load_suite(fitting)
        ours = suite_lib.score_suite(model, tokenizer, eos_id, suite, CPU)
        assert scores[f"harness.{path.stem}.acc"] == pytest.approx(ours["choice_accuracy"])
        # per item, as the gate pairs them: the harness's right/wrong per item agrees with our
        # scorer's on the same items (same digest), and with its own aggregate
        harness = per_item[f"harness.{path.stem}.acc"]
        _, correct = suite_lib.score_suite_items(model, tokenizer, eos_id, suite, CPU)
        assert harness["items"] == suite_lib.item_results(suite_lib.suite_item_ids(suite), correct)["items"]
        assert harness["correct"] == "".join("1" if ok else "0" for ok in correct)
        assert harness["correct"].count("1") / harness["n"] == pytest.approx(scores[f"harness.{path.stem}.acc"])
        assert len(harness["positions"]) == harness["n"] == 12 - left_out
    ours = suite_lib.score_suite(model, tokenizer, eos_id, suite_lib.load_suite(gen), CPU)
    assert scores["harness.echo.exact_match"] == pytest.approx(ours["exact_match"])
    assert per_item["harness.echo.exact_match"]["n"] == 2
