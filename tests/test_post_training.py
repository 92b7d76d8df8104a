"""Fine-tuning, distillation and evaluation on the tiny prepared data: the completion-only mask,
the distillation losses, packing, replay, LoRA, model sources; each entrypoint as a backend would
run it, chained like the DAG; and the quality claims (fine-tuning teaches the held-out task
without forgetting prose; a student a fifth the size keeps most of the teacher's accuracy)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tasks.configs import (DistillConfig, EvalConfig, FinetuneConfig, ModelConfig, from_dict, tiny,
                           to_dict)
from tasks.model.gpt import GPT, IGNORE_INDEX
from tasks.train.prepared_data import DataDir, collate_sft, load_sft, load_tokenizer
from tasks.train.losses import kd_loss, topk_kd_loss
from tests.test_training import run_entrypoint, tiny_pretrain


def test_only_completion_tokens_carry_loss(tiny_data_dir):
    data = DataDir(tiny_data_dir)
    tokenizer = load_tokenizer(data.tokenizer_path)
    examples = load_sft(data.sft_path("train"), tokenizer, data.eos_id, limit=8)
    batch = collate_sft(examples, block_size=64, pad_id=data.eos_id)
    longest = max(len(e.prompt_ids) + len(e.completion_ids) for e in examples)
    assert batch.inputs.shape == batch.targets.shape == (8, longest - 1)
    for row, ex in enumerate(examples):
        p, c = len(ex.prompt_ids), len(ex.completion_ids)
        targets = batch.targets[row].tolist()
        assert targets[: p - 1] == [IGNORE_INDEX] * (p - 1)  # predicting prompt tokens: no loss
        assert targets[p - 1: p - 1 + c] == ex.completion_ids  # the completion, then EOS
        assert ex.completion_ids[-1] == data.eos_id
        assert tokenizer.decode(ex.completion_ids[:-1]) == ex.completion
        assert targets[p - 1 + c:] == [IGNORE_INDEX] * (len(targets) - p + 1 - c)  # padding
        assert batch.inputs[row, : p].tolist() == ex.prompt_ids
    assert batch.tokens == sum(len(e.prompt_ids) + len(e.completion_ids) - 1 for e in examples)


def test_chat_records_train_on_assistant_turns_only(tiny_data_dir, tmp_path):
    data = DataDir(tiny_data_dir)
    tokenizer = load_tokenizer(data.tokenizer_path)
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What comes after 41?"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "And after 42?"},
        {"role": "assistant", "content": "43"}]}) + "\n"
        + json.dumps({"prompt": "Q: What number comes after 7?\nA:", "completion": " 8"}) + "\n")
    chat, plain = load_sft(path, tokenizer, data.eos_id)
    assert chat.prompt == ("System: Be brief.\nUser: What comes after 41?\nAssistant: 42\n"
                           "User: And after 42?\nAssistant:")
    assert chat.completion == " 43" and plain.prompt_trainable is None
    batch = collate_sft([chat, plain], block_size=64, pad_id=data.eos_id)
    scored = [tokenizer.decode([t]) for t in batch.targets[0].tolist() if t != IGNORE_INDEX]
    # the earlier reply (and the newline that ends it), then the final reply; nothing else
    assert "".join(scored[:-1]) == " 42\n 43" and batch.targets[0].tolist().count(data.eos_id) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: the last message must be the assistant"):
        load_sft(bad, tokenizer, data.eos_id)


def test_kd_loss_matches_a_hand_computed_value():
    # position 0 is a prompt token (ignored) with wildly different logits; position 1 counts:
    # teacher prefers token 0 three to one, the student is undecided, the reference is token 0
    student = torch.tensor([[[5.0, -5.0], [0.0, 0.0]]])
    teacher = torch.tensor([[[-5.0, 5.0], [math.log(3.0), 0.0]]])
    targets = torch.tensor([[IGNORE_INDEX, 0]])
    T, alpha = 2.0, 0.5
    # softmax([ln 3, 0] / 2) = [sqrt3, 1] / (sqrt3 + 1); the student's is [1/2, 1/2]
    p0 = math.sqrt(3) / (math.sqrt(3) + 1)
    kl = p0 * math.log(p0 / 0.5) + (1 - p0) * math.log((1 - p0) / 0.5)  # 0.036341
    ce = math.log(2.0)
    expected = alpha * T * T * kl + (1 - alpha) * ce  # 0.419255
    assert kd_loss(student, teacher, targets, T, alpha).item() == pytest.approx(expected, rel=1e-5)
    assert expected == pytest.approx(0.419255, abs=1e-6)
    # alpha = 0 is plain cross-entropy on the completion; a student equal to the teacher has KL 0
    assert kd_loss(student, teacher, targets, T, 0.0).item() == pytest.approx(ce, rel=1e-6)
    assert kd_loss(teacher, teacher, targets, T, 1.0).item() == pytest.approx(0.0, abs=1e-7)
    # the cached form with every logit kept is the same loss
    values, indices = teacher.topk(2, dim=-1)
    assert topk_kd_loss(student, values, indices, targets, T, alpha).item() == pytest.approx(
        expected, rel=1e-5)


def test_topk_kd_renormalizes_the_teachers_kept_logits():
    # vocab 3; the teacher keeps its top 2 logits [ln 3, 0] (token 2's tiny share is dropped),
    # the student is uniform over all 3 tokens: KL = sum p log(p / (1/3)) over the kept two
    student = torch.zeros(1, 1, 3)
    values, indices = torch.tensor([[[math.log(3.0), 0.0]]]), torch.tensor([[[0, 1]]])
    targets = torch.tensor([[0]])
    p = [0.75, 0.25]
    kl = sum(q * math.log(q * 3) for q in p)
    got = topk_kd_loss(student, values, indices, targets, temperature=1.0, alpha=1.0)
    assert got.item() == pytest.approx(kl, rel=1e-6)


def test_packed_rows_give_every_example_exactly_its_own_logits(tiny_data_dir):
    from tasks.posttrain.batches import SFTSteps, collate_packed
    from tasks.posttrain.packing import packed_logits

    data = DataDir(tiny_data_dir)
    tokenizer = load_tokenizer(data.tokenizer_path)
    examples = load_sft(data.sft_path("train"), tokenizer, data.eos_id, limit=12)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=300, block_size=64, n_layer=2, n_head=2, n_embd=32)).eval()
    packed = collate_packed([examples[:5], examples[5:12]], block_size=64, pad_id=data.eos_id)
    alone = collate_sft(examples, block_size=64, pad_id=data.eos_id)
    with torch.no_grad():
        logits = packed_logits(model, packed.inputs, packed.positions, packed.segments)
        reference = model(alone.inputs)[0]
    keep = packed.targets != IGNORE_INDEX
    assert keep.sum() == (alone.targets != IGNORE_INDEX).sum()
    # loss positions in row-major order are the examples' loss positions in order
    assert torch.equal(packed.targets[keep], alone.targets[alone.targets != IGNORE_INDEX])
    assert torch.allclose(logits[keep], reference[alone.targets != IGNORE_INDEX], atol=1e-5)
    assert packed.tokens == alone.tokens
    # packing fills rows: 12 examples of ~22 tokens take 6 rows of 64 instead of 12
    steps = SFTSteps(examples, batch_size=2, seed=0, block_size=64, pad_id=data.eos_id,
                     packing=True)
    assert len(steps.units) <= len(examples) // 2
    assert sorted(i for unit in steps.units for i in unit) == list(range(12))
    assert steps(0).positions is not None and steps(0).inputs.shape[1] <= 64


def test_each_step_replays_pretraining_rows_deterministically(tiny_data_dir):
    from tasks.posttrain.batches import SFTSteps
    from tasks.posttrain.objectives import next_token_loss, with_replay

    data = DataDir(tiny_data_dir)
    tokenizer = load_tokenizer(data.tokenizer_path)
    examples = load_sft(data.sft_path("train"), tokenizer, data.eos_id)
    rows = data.split("train")
    steps = SFTSteps(examples, batch_size=8, seed=3, block_size=32, pad_id=data.eos_id,
                     replay_rows=rows, replay_fraction=0.25)
    batch = steps(5)
    assert batch.inputs.shape[0] == 6 and batch.replay.inputs.shape == (2, rows.row_len - 1)
    assert (batch.replay.targets != IGNORE_INDEX).all()  # every prose token is LM loss
    again = SFTSteps(examples, batch_size=8, seed=3, block_size=32, pad_id=data.eos_id,
                     replay_rows=rows, replay_fraction=0.25)(5)  # a resumed job's batch 5
    assert torch.equal(batch.inputs, again.inputs) and torch.equal(batch.replay.inputs,
                                                                   again.replay.inputs)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=300, block_size=32, n_layer=1, n_head=2, n_embd=16))
    combined = with_replay(next_token_loss, 0.25)(model, batch)
    parts = 0.75 * next_token_loss(model, batch) + 0.25 * next_token_loss(model, batch.replay)
    assert combined.item() == pytest.approx(parts.item(), rel=1e-6)


@pytest.mark.parametrize("teacher_kind", ["gpt", "llama"])
def test_cached_topk_lands_on_the_loss_positions_of_padded_and_packed_steps(tiny_data_dir,
                                                                             tmp_path, teacher_kind,
                                                                             request):
    """The cache stores the teacher per example; a student step (padded or packed) must read
    back, at each loss position, exactly the teacher's top-k logits for that position: for our
    GPT and for a transformers Llama as the teacher."""
    from tasks.posttrain.batches import SFTSteps
    from tasks.posttrain.objectives import logits_of
    from tasks.posttrain.teacher_cache import TeacherCache, build_cache, replayed_rows

    data = DataDir(tiny_data_dir)
    examples = load_sft(data.sft_path("train"), load_tokenizer(data.tokenizer_path), data.eos_id,
                        limit=20)
    torch.manual_seed(0)
    if teacher_kind == "gpt":
        teacher = GPT(ModelConfig(vocab_size=300, block_size=32, n_layer=1, n_head=2, n_embd=16))
    else:
        from tasks.train.export import load_model

        teacher = load_model(request.getfixturevalue("tiny_llama_dir"))[0]
    teacher.eval()
    rows = data.split("train")
    kwargs = dict(batch_size=6, seed=4, block_size=32, pad_id=data.eos_id, replay_rows=rows,
                  replay_fraction=0.34)
    replay = replayed_rows(SFTSteps(examples, **kwargs), max_steps=3)
    key = {"top_k": 8, "block_size": 32}  # what build_cache reads; the rest is for matching
    build_cache(teacher, tmp_path / "cache", key=key, examples=examples, replay=rows,
                replay_rows=replay, batch_size=8, device=torch.device("cpu"), teacher_metrics={})
    cache = TeacherCache(tmp_path / "cache", expected_key=key)
    for packing in (False, True):
        steps = SFTSteps(examples, packing=packing, teacher_cache=cache, **kwargs)
        for step in range(3):
            batch = steps(step)
            for part in (batch, batch.replay):
                with torch.no_grad():
                    values, indices = logits_of(teacher, part).topk(5, dim=-1)
                mask = part.targets != IGNORE_INDEX
                assert torch.equal(part.teacher_indices[mask][:, :5], indices[mask].long())
                assert torch.allclose(part.teacher_values[mask][:, :5].float(), values[mask],
                                      atol=2e-2)  # float16 in the cache


def test_lora_trains_only_adapters_and_merges_back_to_a_plain_gpt():
    pytest.importorskip("peft")
    from tasks.posttrain.lora import add_lora, merge_lora
    from tasks.posttrain.sources import merge_lora_state

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    x = torch.randint(0, 64, (2, 10))
    wrapped = add_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=["c_attn", "c_proj", "c_fc"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    with torch.no_grad():  # B starts at zero; give the adapters something to merge
        for n, p in model.named_parameters():
            if ".lora_B" in n:
                p.normal_(0, 0.05)
        adapted = model(x)[0]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merge_lora(wrapped)
    assert type(merged) is GPT and not any(".lora_" in k for k in merged.state_dict())
    assert torch.allclose(merged(x)[0], adapted, atol=1e-5)
    # a LoRA checkpoint's state dict merges to the same weights (sources.py, for checkpoints)
    by_hand = merge_lora_state(state, scaling=8.0 / 4)
    assert all(torch.allclose(by_hand[k], v, atol=1e-6) for k, v in merged.state_dict().items())


# --------------------------------------------------------------------------------------------
# The stages chained as the DAG chains them: pretrain -> finetune -> distill -> evaluate


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("post_training")


@pytest.fixture(scope="module")
def pretrained(tiny_data_dir, workdir) -> dict:
    return run_entrypoint("pretrain", tiny_pretrain(tiny_data_dir, workdir / "pretrain"), workdir)


@pytest.fixture(scope="module")
def finetuned(tiny_data_dir, workdir, pretrained) -> dict:
    cfg = tiny().finetune
    cfg.base_model = pretrained["outputs"]["model_dir"]
    cfg.data_dir, cfg.output_dir = str(tiny_data_dir), str(workdir / "finetune")
    return run_entrypoint("finetune", from_dict(FinetuneConfig, to_dict(cfg)), workdir)


def distill_config(tiny_data_dir, workdir, finetuned) -> DistillConfig:
    cfg = tiny().distill
    cfg.teacher_model = finetuned["outputs"]["model_dir"]
    cfg.data_dir, cfg.output_dir = str(tiny_data_dir), str(workdir / "distill")
    cfg.teacher_cache, cfg.cache_top_k, cfg.quantize_int8 = str(workdir / "teacher_cache"), 8, True
    # deliberately wrong vocab and block sizes: the student must take the teacher's
    cfg.student = from_dict(type(cfg.student), {**to_dict(cfg.student), "vocab_size": 64,
                                                "block_size": 8})
    return from_dict(DistillConfig, to_dict(cfg))


@pytest.fixture(scope="module")
def teacher_cache(tiny_data_dir, workdir, finetuned) -> dict:
    cfg = distill_config(tiny_data_dir, workdir, finetuned)
    return run_entrypoint("distill_cache", cfg, workdir)


@pytest.fixture(scope="module")
def distilled(tiny_data_dir, workdir, finetuned, teacher_cache) -> dict:
    """The student trained from the teacher cache (the teacher never loaded), quantized too."""
    return run_entrypoint("distill", distill_config(tiny_data_dir, workdir, finetuned), workdir)


def test_a_finetuning_checkpoint_names_the_examples_and_replayed_rows_it_trained_on(finetuned, tiny_data_dir,
                                                                                     workdir, tmp_path):
    """Issue 25.3 for SFT: the checkpoint records its SFT sampler, and tasks.train.seen gives the
    examples (and the replayed pretraining rows) of exactly the steps before it, as the batch
    reader drew them; other SFT files than the ones it read are refused."""
    from tasks.posttrain.batches import SFTSteps
    from tasks.posttrain.datasets import load_sft_data
    from tasks.train import checkpoint as ckpt
    from tasks.train import seen

    cfg = tiny().finetune   # the `finetuned` fixture's, but for its paths
    step, path = max(ckpt.step_dirs(workdir / "finetune" / "checkpoints"), key=lambda s: s[0])
    record = seen.record(path)
    assert record["kind"] == "sft" and record["batches"] == [[0, step]], record["batches"]
    data = DataDir(tiny_data_dir)
    sft = load_sft_data(tiny_data_dir, finetuned["outputs"]["model_dir"], 10_000, 1)
    reader = SFTSteps(sft.train, batch_size=cfg.batch_size, seed=cfg.seed, block_size=10_000,
                      pad_id=sft.eos_id, packing=False, replay_rows=data.split("train"),
                      replay_fraction=cfg.replay_fraction)
    drawn = sorted({i for s in range(step) for u in reader.sampler.indices(s) for i in reader.units[u]})
    train_file = data.sft_path("train")
    assert seen.consumed_examples(path, [train_file]) == [sft.train[i].id for i in drawn]
    assert len(drawn) < len(sft.train), "some examples unseen, or the test proves nothing"
    replayed = {int(r) for s in range(step) for r in reader.replay_indices(s)}
    assert set(seen.consumed_rows(path, tiny_data_dir).tolist()) == replayed and replayed
    assert record["replay"]["data_hash"] == data.content_hash   # which data the replayed rows are of
    other = tmp_path / "other.jsonl"
    other.write_text(Path(train_file).read_text().split("\n", 1)[1])   # one example fewer
    with pytest.raises(ValueError, match="not the .* the checkpoint trained on"):
        seen.consumed_examples(path, [other])
    _, pretraining = max(ckpt.step_dirs(workdir / "pretrain" / "checkpoints"), key=lambda s: s[0])
    with pytest.raises(ValueError, match="pretraining checkpoint"):
        seen.consumed_examples(pretraining, [train_file])


def test_finetuning_lowers_held_out_completion_loss(finetuned, pretrained):
    metrics = finetuned["metrics"]
    assert metrics["val_loss"] < metrics["val_loss_before"] - 0.1
    assert 0.0 <= metrics["task_accuracy_before"] <= 1.0
    assert 0.0 <= metrics["task_accuracy_after"] <= 1.0
    # replay keeps prose: ten steps must not make held-out perplexity worse by much
    assert metrics["prose_perplexity_after"] < 1.5 * metrics["prose_perplexity_before"]
    assert metrics["params"] == pretrained["metrics"]["params"]
    assert finetuned["model_uri"].startswith("models:/")
    meta = json.loads((Path(finetuned["outputs"]["model_dir"]) / "meta.json").read_text())
    assert meta["stage"] == "finetune"
    assert meta["parent_model_dir"] == pretrained["outputs"]["model_dir"]
    assert meta["parent_run_id"] == pretrained["mlflow_run_id"]
    assert meta["parent_model_uri"] == pretrained["model_uri"]
    assert len(meta["sft_sha256"]) == 64
    assert "after fine-tuning: completion loss" in finetuned["stdout"]

    import mlflow

    logged = mlflow.MlflowClient().get_run(finetuned["mlflow_run_id"]).data.metrics
    assert {"loss/val_before", "task/accuracy_before", "task/accuracy_after", "loss/train",
            "loss/val", "loss/val_prose", "prose/perplexity_after"} <= set(logged)


def test_distilled_student_from_the_cache_is_smaller_and_shares_the_teachers_tokens(
        distilled, finetuned, teacher_cache):
    from tasks.train.export import load_model

    metrics = distilled["metrics"]
    assert metrics["teacher_params"] == finetuned["metrics"]["params"]
    assert metrics["params"] < metrics["teacher_params"]
    assert {"val_loss", "task_accuracy", "teacher_task_accuracy", "prose_perplexity"} <= set(metrics)
    assert "from cache" in distilled["stdout"] and "teacher online" not in distilled["stdout"]
    manifest = json.loads((Path(teacher_cache["outputs"]["teacher_cache"]) / "manifest.json")
                          .read_text())
    assert manifest["key"]["top_k"] == 8 and manifest["replay_rows"] > 0
    assert metrics["teacher_task_accuracy"] == manifest["teacher_metrics"]["task_accuracy"]
    student, meta = load_model(distilled["outputs"]["model_dir"])
    teacher, _ = load_model(finetuned["outputs"]["model_dir"])
    assert student.config.vocab_size == teacher.config.vocab_size
    assert student.config.block_size == teacher.config.block_size
    assert student.config.n_embd == tiny().distill.student.n_embd
    assert meta["parent_run_id"] == finetuned["mlflow_run_id"]
    assert meta["teacher_cache"] == teacher_cache["outputs"]["teacher_cache"]
    tokenizers = [Path(r["outputs"]["model_dir"]) / "tokenizer.json" for r in (distilled, finetuned)]
    assert tokenizers[0].read_bytes() == tokenizers[1].read_bytes()


def test_a_cache_built_for_other_inputs_is_refused(tiny_data_dir, workdir, finetuned, teacher_cache):
    from tasks.posttrain.teacher_cache import TeacherCache

    cache = TeacherCache(teacher_cache["outputs"]["teacher_cache"])
    key = {**cache.manifest["key"], "top_k": 16}
    with pytest.raises(ValueError, match=r"differs in \['top_k'\].*rebuild it"):
        TeacherCache(teacher_cache["outputs"]["teacher_cache"], expected_key=key)


def test_int8_student_reports_size_speed_and_quality_against_float(distilled):
    from tasks.posttrain.quantize import load_int8
    from tasks.train.export import load_model

    m = distilled["metrics"]
    for key in ("size_bytes", "tokens_per_s", "perplexity", "task_accuracy"):
        assert m[f"int8.{key}_float"] > 0 or key == "task_accuracy"
        assert f"int8.{key}_int8" in m
    assert m["int8.size_bytes_int8"] < m["int8.size_bytes_float"]
    # int8 weights barely move a small model's perplexity
    assert m["int8.perplexity_int8"] == pytest.approx(m["int8.perplexity_float"], rel=0.05)
    quantized, meta = load_int8(distilled["outputs"]["int8_model_dir"])
    student, _ = load_model(distilled["outputs"]["model_dir"])
    x = torch.randint(0, student.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.allclose(quantized(x)[0], student(x)[0], atol=0.5)
    assert meta["comparison"]["size_ratio"] == m["int8.size_ratio"]


def lora_steps(make_model, data_dir: Path, output_dir: Path, steps: int, targets=None):
    """Seeded LoRA fine-tuning of make_model() for `steps` packed steps with replay, through the
    shared loop (checkpoint every 3 steps): a rerun into the same output_dir resumes."""
    from tasks.posttrain.batches import SFTSteps
    from tasks.posttrain.lora import add_lora
    from tasks.posttrain.objectives import next_token_loss, with_replay
    from tasks.train.loop import train
    from tasks.train.runtime import pick_device

    pick_device()
    data = DataDir(data_dir)
    examples = load_sft(data.sft_path("train"), load_tokenizer(data.tokenizer_path), data.eos_id)
    torch.manual_seed(0)
    model = make_model()
    adapters = add_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=targets)
    cfg = FinetuneConfig(base_model="-", data_dir="-", output_dir=str(output_dir),
                         max_steps=steps, batch_size=8, checkpoint_interval=3,
                         eval_interval=100, log_interval=100, packing=True)
    cfg.optim.lr = 1e-2
    train(model=model, cfg=cfg, loss_fn=with_replay(next_token_loss, 0.25),
          get_batch=SFTSteps(examples, batch_size=8, seed=1, block_size=32,
                             pad_id=data.eos_id, packing=True,
                             replay_rows=data.split("train"), replay_fraction=0.25),
          evaluate=lambda m: {}, device=torch.device("cpu"), resolved_config=to_dict(cfg),
          tracking=False)
    return model, adapters


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_lora_fine_tuning_resumes_exactly_from_its_checkpoint(tiny_data_dir, tmp_path, arch,
                                                              request):
    """A retried LoRA job continues from the adapters it saved, as a pretraining job does: for
    our GPT (two named layers) and a transformers Llama (every linear layer, the default)."""
    pytest.importorskip("peft")
    if arch == "gpt":
        targets = ["c_attn", "c_fc"]
        make = lambda: GPT(ModelConfig(vocab_size=300, block_size=32, n_layer=1, n_head=2,  # noqa: E731
                                       n_embd=32))
    else:
        from tasks.train.export import load_model

        llama, targets = request.getfixturevalue("tiny_llama_dir"), None
        make = lambda: load_model(llama)[0]  # noqa: E731
    whole, _ = lora_steps(make, tiny_data_dir, tmp_path / "whole", 8, targets)
    lora_steps(make, tiny_data_dir, tmp_path / "split", 6, targets)  # stopped after step 6
    resumed, _ = lora_steps(make, tiny_data_dir, tmp_path / "split", 8, targets)
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.fixture(scope="module")
def registered_base(pretrained) -> str:
    """The pretrained model as version 1 of 'post-training-base', alias 'base'."""
    import mlflow

    mlflow.register_model(pretrained["model_uri"], "post-training-base")
    mlflow.MlflowClient().set_registered_model_alias("post-training-base", "base", "1")
    return "models:/post-training-base@base"


@pytest.fixture(scope="module")
def lora_from_registry(tiny_data_dir, workdir, registered_base) -> dict:
    """LoRA + packing on chat and prompt/completion JSONL, starting from a registered version."""
    chat = workdir / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What number comes after {n}?"},
        {"role": "assistant", "content": str(n + 1)}]}) + "\n" for n in range(100, 160)))
    cfg = tiny().finetune
    cfg.base_model = registered_base
    cfg.data_dir, cfg.output_dir = str(tiny_data_dir), str(workdir / "lora")
    cfg.train_files = [str(chat), str(tiny_data_dir / "sft" / "train.jsonl")]
    cfg.lora_rank, cfg.packing = 4, True
    return run_entrypoint("finetune", from_dict(FinetuneConfig, to_dict(cfg)), workdir)


def test_lora_finetune_from_a_registered_version_merges_into_a_plain_model(lora_from_registry,
                                                                         pretrained):
    import mlflow

    from tasks.posttrain.sources import resolve_model_dir
    from tasks.train.export import load_model

    result = lora_from_registry
    assert "post-training-base@base -> logged model" in result["stdout"]
    meta = json.loads((Path(result["outputs"]["model_dir"]) / "meta.json").read_text())
    assert meta["parent_registered_version"] == "post-training-base/1"
    assert meta["parent_run_id"] == pretrained["mlflow_run_id"]
    assert meta["lora_rank"] == 4
    logged = mlflow.MlflowClient().get_run(result["mlflow_run_id"]).data.metrics
    assert 0 < logged["trainable_params"] < logged["params"] / 5
    model, _ = load_model(result["outputs"]["model_dir"])  # merged: a plain GPT again
    assert not any(".lora_" in k for k in model.state_dict())
    # the adapters alone, in peft's format, apply to the base model transformers loads (the GPT-2
    # our GPT is): merged, they give the fine-tuned model's logits
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_dir = Path(result["outputs"]["adapter_dir"])
    base = json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
                                       adapter_dir).merge_and_unload()
    ids = torch.randint(0, model.config.vocab_size, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(served(ids).logits, model.eval()(ids)[0], atol=1e-5, rtol=1e-4)
    # the final checkpoint (adapters unmerged) resolves to the same weights as the model dir
    from_ckpt, _ = load_model(resolve_model_dir(result["outputs"]["checkpoint"],
                                                Path(result["outputs"]["model_dir"]).parent / "x"))
    for key, value in model.state_dict().items():
        assert torch.allclose(from_ckpt.state_dict()[key], value, atol=1e-5), key


def test_evaluate_reports_every_model(tiny_data_dir, workdir, pretrained, finetuned, distilled,
                                     registered_base):
    import mlflow

    models = {"base": pretrained, "teacher": finetuned, "student": distilled}
    cfg = tiny().evaluate
    cfg.models = {name: r["outputs"]["model_dir"] for name, r in models.items()}
    cfg.models["registered"] = "models:/post-training-base/1"  # a registry URI, resolved by the job
    cfg.models["student_int8"] = distilled["outputs"]["int8_model_dir"]
    cfg.data_dir, cfg.output_dir = str(tiny_data_dir), str(workdir / "evaluate")
    result = run_entrypoint("evaluate", from_dict(EvalConfig, to_dict(cfg)), workdir)
    eval_lines = (tiny_data_dir / "sft" / "eval.jsonl").read_text().splitlines()
    scored = [json.loads(line) for line in eval_lines[: cfg.max_task_examples]]

    report = json.loads(Path(result["outputs"]["report"]).read_text())
    for name, trained in models.items():
        assert result["models"][name]["model_uri"] == trained["model_uri"]
        assert result["models"][name]["params"] == trained["metrics"]["params"]
        assert result["models"][name]["mlflow_run_id"] == trained["mlflow_run_id"]
        ppl = result["metrics"][f"{name}.perplexity"]
        assert 1.0 < ppl and math.isfinite(ppl)
        assert 0.0 < result["metrics"][f"{name}.bits_per_byte"] < 8.0
        assert 0.0 <= result["metrics"][f"{name}.task_accuracy"] <= 1.0
        for suite in ("sft_choice", "prose_cloze"):
            assert result["metrics"][f"{name}.suite.{suite}.items"] == cfg.suite_examples
            assert 0.0 <= result["metrics"][f"{name}.suite.{suite}.accuracy"] <= 1.0
        assert report["models"][name]["task_examples"] == len(scored)
        assert set(report["models"][name]["per_skill"]) == {r["skill"] for r in scored}
        # the harness's per-item results, for the gate to pair (the items that fit the context)
        per_item = result["models"][name]["per_item"]
        for suite in ("sft_choice", "prose_cloze"):
            harness, ours = per_item[f"harness.{suite}.acc"], per_item[f"suite.{suite}.accuracy"]
            assert 0 < harness["n"] <= ours["n"] and "positions" not in harness
            assert harness["correct"].count("1") / harness["n"] == pytest.approx(
                result["metrics"][f"{name}.harness.{suite}.acc"])
            assert ("seen" in harness) == ("seen" in ours)
    # the base model saw the same prose the val shards hold; evaluation must agree with pretraining
    assert result["metrics"]["base.val_loss"] == pytest.approx(
        math.log(result["metrics"]["base.perplexity"]))
    # the registered version is the pretrained model: the same numbers, found through MLflow
    assert result["metrics"]["registered.perplexity"] == pytest.approx(
        result["metrics"]["base.perplexity"])
    assert result["models"]["registered"]["lineage"]["registered_version"] == "1"
    # the int8 student is scored too, and int8 weights barely move it
    assert result["metrics"]["student_int8.perplexity"] == pytest.approx(
        result["metrics"]["student.perplexity"], rel=0.05)

    run = mlflow.MlflowClient().get_run(result["mlflow_run_id"])
    assert {"base/perplexity", "teacher/task_accuracy", "student/params",
            "student/bits_per_byte"} <= set(run.data.metrics)
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(result["mlflow_run_id"])}
    assert {"report.json", "report.md", "eval_table.json", "eval_report.png",
            "eval_suites.png", "suites"} <= artifacts
    table = Path(result["outputs"]["report_md"]).read_text().splitlines()
    assert table[0].startswith("| model | params | perplexity | bits_per_byte | task_accuracy |")
    assert [line.split("|")[1].strip() for line in table[2:]] == list(cfg.models)


# --------------------------------------------------------------------------------------------
# Quality: what the stages are for, measured on held-out data (in-process, no MLflow)


@pytest.fixture(scope="module")
def number_task(tiny_data_dir, tmp_path_factory):
    """2000 generated number questions (train/eval disjoint by number) in the tiny tokenizer,
    and a 2-layer, 64-wide model pretrained for 150 steps on the tiny corpus."""
    from tasks.configs import TrainConfig
    from tasks.data.instructions import generate_examples, write_examples
    from tasks.train.prepared_data import PretrainBatches
    from tasks.train.losses import cross_entropy
    from tasks.train.loop import train
    from tasks.train.runtime import pick_device, seed_everything

    pick_device()  # on CPU: the jobs' thread count (two threads on two busy cores are ~10x slower)
    out = tmp_path_factory.mktemp("number_task")
    data = DataDir(tiny_data_dir)
    tokenizer = load_tokenizer(data.tokenizer_path)
    train_rows, eval_rows = generate_examples(2000, seed=7)
    write_examples(out / "train.jsonl", train_rows)
    write_examples(out / "eval.jsonl", eval_rows)
    seed_everything(0)
    model = GPT(ModelConfig(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=64))
    cfg = TrainConfig(data_dir=str(tiny_data_dir), output_dir=str(out / "pretrain"), max_steps=150,
                      batch_size=16, eval_interval=150, checkpoint_interval=150, log_interval=150)
    cfg.optim.lr, cfg.optim.warmup_steps = 3e-3, 10
    train(model=model, cfg=cfg, get_batch=PretrainBatches(data.split("train"), 16, 0),
          loss_fn=cross_entropy, evaluate=lambda m: {}, device=torch.device("cpu"),
          resolved_config={}, tracking=False)
    return {"out": out, "data": data, "tokenizer": tokenizer, "pretrained": model,
            "train": load_sft(out / "train.jsonl", tokenizer, data.eos_id),
            "eval": load_sft(out / "eval.jsonl", tokenizer, data.eos_id)[:100]}


def _sft(task, model, loss_fn, out: str, steps: int, lr: float, replay: float, seed: int):
    from tasks.posttrain.batches import SFTSteps
    from tasks.posttrain.objectives import with_replay
    from tasks.train.loop import train

    cfg = FinetuneConfig(base_model="-", data_dir="-", output_dir=str(task["out"] / out),
                         max_steps=steps, batch_size=16, replay_fraction=replay,
                         eval_interval=steps, checkpoint_interval=steps, log_interval=steps)
    cfg.optim.lr = lr
    steps_fn = SFTSteps(task["train"], batch_size=16, seed=seed, block_size=32,
                        pad_id=task["data"].eos_id, replay_rows=task["data"].split("train"),
                        replay_fraction=replay)
    train(model=model, cfg=cfg, get_batch=steps_fn, loss_fn=with_replay(loss_fn, replay),
          evaluate=lambda m: {}, device=torch.device("cpu"), resolved_config={}, tracking=False)
    return model


def _scores(task, model) -> dict[str, float]:
    from tasks.train.scoring import answer_budget, exact_match, shard_loss

    cpu = torch.device("cpu")
    return {"accuracy": exact_match(model, task["tokenizer"], task["eval"], task["data"].eos_id,
                                    answer_budget(task["eval"]), cpu)["accuracy"],
            "perplexity": math.exp(shard_loss(model, task["data"].split("val"), 16, 4, cpu))}


@pytest.fixture(scope="module")
def teacher_and_student(number_task):
    import copy

    from tasks.posttrain.objectives import next_token_loss, online_kd
    from tasks.train.runtime import seed_everything

    before = _scores(number_task, number_task["pretrained"])
    teacher = _sft(number_task, copy.deepcopy(number_task["pretrained"]), next_token_loss,
                   "finetune", steps=1000, lr=3e-3, replay=0.25, seed=1)
    seed_everything(1)
    student = GPT(ModelConfig(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=24))
    teacher.eval().requires_grad_(False)
    _sft(number_task, student, online_kd(teacher, 2.0, 0.7), "distill", steps=1500, lr=5e-3,
         replay=0.25, seed=2)
    figures = {"pretrained": before, "teacher": _scores(number_task, teacher),
               "student": _scores(number_task, student),
               "params": {"teacher": teacher.num_params(), "student": student.num_params()}}
    print("number task figures:", json.dumps(figures))
    return figures


def test_fine_tuning_improves_the_held_out_task_without_forgetting_prose(teacher_and_student):
    before, after = teacher_and_student["pretrained"], teacher_and_student["teacher"]
    # measured: 0.00 -> 0.90 exact match on 100 held-out numbers; perplexity 45 -> 25
    assert before["accuracy"] <= 0.05
    assert after["accuracy"] >= 0.6
    assert after["perplexity"] < 1.5 * before["perplexity"]


def test_student_keeps_most_of_the_teachers_accuracy_with_a_fifth_of_its_parameters(
        teacher_and_student):
    params = teacher_and_student["params"]
    teacher, student = teacher_and_student["teacher"], teacher_and_student["student"]
    # measured: 22,464 vs 121,344 parameters (0.19); accuracy 0.81 vs 0.90
    assert params["student"] <= params["teacher"] / 4
    assert student["accuracy"] >= 0.75 * teacher["accuracy"]
    assert student["perplexity"] < 2 * teacher["perplexity"]  # it learned prose from the teacher


def test_without_replay_fine_tuning_forgets_prose(number_task, teacher_and_student):
    """The regression the replay share fixes: the same fine-tuning on the task alone."""
    import copy

    from tasks.posttrain.objectives import next_token_loss

    narrow = _sft(number_task, copy.deepcopy(number_task["pretrained"]), next_token_loss,
                  "finetune_no_replay", steps=300, lr=3e-3, replay=0.0, seed=1)
    forgot = _scores(number_task, narrow)["perplexity"]
    before = teacher_and_student["pretrained"]["perplexity"]
    kept = teacher_and_student["teacher"]["perplexity"]
    print(f"prose perplexity: {before:.1f} pretrained; after fine-tuning {forgot:.1f} without "
          f"replay (300 steps), {kept:.1f} with (1000 steps)")
    assert forgot > 5 * before and kept < 1.5 * before
