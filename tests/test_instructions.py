"""The demo instruction task: correct answers, held-out numbers, and the files prep writes."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from tasks.configs import DataPrepConfig
from tasks.data.instructions import generate_examples, load_examples, write_demo_sft
from tasks.data.prep import prepare

QUESTION = re.compile(r"Q: What number comes (after|before) (\d+)\?\nA:")


def asked_about(example: dict) -> int:
    """The number a question asks about, parsed back out of the prompt text."""
    return int(QUESTION.fullmatch(example["prompt"]).group(2))


def expected_answer(example: dict) -> int:
    direction, number = QUESTION.fullmatch(example["prompt"]).groups()
    return int(number) + (1 if direction == "after" else -1)


def test_answers_are_correct_and_formatted():
    train, evaluation = generate_examples(600, seed=3)
    for example in train + evaluation:
        assert example["completion"] == f" {expected_answer(example)}"
        assert set(example) == {"id", "prompt", "completion", "skill"}


def test_train_and_eval_are_disjoint_by_the_numbers_asked_about():
    train, evaluation = generate_examples(4000, seed=1234)
    assert len(evaluation) == 800 and len(train) == 3200
    held_out = {asked_about(ex) for ex in evaluation}
    assert not held_out & {asked_about(ex) for ex in train}
    # Every skill is in both splits in equal shares.
    for split in (train, evaluation):
        shares = Counter(ex["skill"] for ex in split)
        assert set(shares) == {"successor", "predecessor"}
        assert max(shares.values()) - min(shares.values()) <= 1


def test_generation_is_deterministic_per_seed():
    assert generate_examples(300, seed=5) == generate_examples(300, seed=5)
    assert generate_examples(300, seed=5) != generate_examples(300, seed=6)


def test_write_demo_sft_writes_jsonl(tmp_path):
    train_path, eval_path = write_demo_sft(tmp_path, 100, seed=0)
    train = [json.loads(line) for line in train_path.read_text().splitlines()]
    evaluation = [json.loads(line) for line in eval_path.read_text().splitlines()]
    assert (len(train), len(evaluation)) == (80, 20)
    assert len({ex["id"] for ex in train + evaluation}) == 100


def test_tiny_data_dir_has_the_demo_task(tiny_data_dir):
    train = load_examples(tiny_data_dir / "sft/train.jsonl")
    evaluation = load_examples(tiny_data_dir / "sft/eval.jsonl")
    assert (len(train), len(evaluation)) == (240, 60)
    assert not {asked_about(ex) for ex in evaluation} & {asked_about(ex) for ex in train}


def _prose_input(tmp_path):
    # Repetitive on purpose, so the web-text filters and near dedup are off where it is used.
    text = "Plain prose for pretraining, long enough to fill a few rows of tokens. " * 4
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": f"{i} {text}"}) + "\n" for i in range(20)))
    return str(path)


def _config(tmp_path, sft_inputs) -> DataPrepConfig:
    return DataPrepConfig(inputs=[_prose_input(tmp_path)], sft_inputs=sft_inputs, filters=[], near_dedup=False,
                          output_dir=str(tmp_path / "out"), vocab_size=270, seq_len=16, engine="local")


def test_given_sft_files_are_copied(tmp_path):
    train = tmp_path / "my_train.jsonl"
    evaluation = tmp_path / "my_eval.jsonl"
    train.write_text(json.dumps({"prompt": "Say hi:", "completion": " hi"}) + "\n")
    evaluation.write_text(json.dumps({"id": "e1", "prompt": "Say bye:", "completion": " bye",
                                      "skill": "greeting"}) + "\n")
    config = _config(tmp_path, [str(train), str(evaluation)])
    manifest = prepare(config).manifest
    assert (manifest["sft"]["train_examples"], manifest["sft"]["eval_examples"]) == (1, 1)
    assert load_examples(tmp_path / "out/sft/eval.jsonl") == [
        {"id": "e1", "prompt": "Say bye:", "completion": " bye", "skill": "greeting"}]


def test_given_sft_files_are_refused_when_bad_or_leaking(tmp_path):
    train = tmp_path / "train.jsonl"
    evaluation = tmp_path / "eval.jsonl"
    evaluation.write_text(json.dumps({"prompt": "Say hi:", "completion": " hi"}) + "\n")

    train.write_text(json.dumps({"prompt": "Say hi:", "completion": ""}) + "\n")
    with pytest.raises(ValueError, match=r"train.jsonl:1: 'completion' must be a non-empty string"):
        load_examples(train)

    train.write_text(json.dumps({"prompt": "Say hi:", "completion": " hi"}) + "\n")
    config = _config(tmp_path, [str(train), str(evaluation)])
    with pytest.raises(ValueError, match="1 eval prompt\\(s\\) also appear in train"):
        prepare(config)
