"""Fine-tuning, distillation and evaluation on the tiny prepared data: the completion-only mask,
the distillation loss, and each entrypoint as a backend would run it, chained like the DAG."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tasks.configs import DistillConfig, EvalConfig, FinetuneConfig, from_dict, tiny, to_dict
from tasks.model import IGNORE_INDEX
from tasks.train.data import DataDir, collate_sft, load_sft, load_tokenizer
from tasks.train.losses import kd_loss
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


@pytest.fixture(scope="module")
def distilled(tiny_data_dir, workdir, finetuned) -> dict:
    cfg = tiny().distill
    cfg.teacher_model = finetuned["outputs"]["model_dir"]
    cfg.data_dir, cfg.output_dir = str(tiny_data_dir), str(workdir / "distill")
    # deliberately wrong vocab and block sizes: the student must take the teacher's
    cfg.student = from_dict(type(cfg.student), {**to_dict(cfg.student), "vocab_size": 64,
                                                "block_size": 8})
    return run_entrypoint("distill", from_dict(DistillConfig, to_dict(cfg)), workdir)


def test_finetuning_lowers_held_out_completion_loss(finetuned, pretrained):
    metrics = finetuned["metrics"]
    assert metrics["val_loss"] < metrics["val_loss_before"] - 0.1
    assert 0.0 <= metrics["task_accuracy_before"] <= 1.0
    assert 0.0 <= metrics["task_accuracy_after"] <= 1.0
    assert metrics["params"] == pretrained["metrics"]["params"]
    assert finetuned["model_uri"].startswith("models:/")
    meta = json.loads((Path(finetuned["outputs"]["model_dir"]) / "meta.json").read_text())
    assert meta["stage"] == "finetune"
    assert meta["parent_model_dir"] == pretrained["outputs"]["model_dir"]
    assert meta["parent_run_id"] == pretrained["mlflow_run_id"]
    assert meta["parent_model_uri"] == pretrained["model_uri"]
    assert "after fine-tuning: completion loss" in finetuned["stdout"]

    import mlflow

    logged = mlflow.MlflowClient().get_run(finetuned["mlflow_run_id"]).data.metrics
    assert {"val_loss_before", "task_accuracy_before", "task_accuracy_after", "loss",
            "val_loss"} <= set(logged)


def test_distilled_student_is_smaller_and_shares_the_teachers_tokens(distilled, finetuned):
    from tasks.train.export import load_model

    metrics = distilled["metrics"]
    assert metrics["teacher_params"] == finetuned["metrics"]["params"]
    assert metrics["params"] < metrics["teacher_params"]
    assert {"val_loss", "task_accuracy", "teacher_task_accuracy"} <= set(metrics)
    student, meta = load_model(distilled["outputs"]["model_dir"])
    teacher, _ = load_model(finetuned["outputs"]["model_dir"])
    assert student.config.vocab_size == teacher.config.vocab_size
    assert student.config.block_size == teacher.config.block_size
    assert student.config.n_embd == tiny().distill.student.n_embd
    assert meta["parent_run_id"] == finetuned["mlflow_run_id"]
    tokenizers = [Path(r["outputs"]["model_dir"]) / "tokenizer.json" for r in (distilled, finetuned)]
    assert tokenizers[0].read_bytes() == tokenizers[1].read_bytes()


def test_evaluate_reports_every_model(tiny_data_dir, workdir, pretrained, finetuned, distilled):
    import mlflow

    models = {"base": pretrained, "teacher": finetuned, "student": distilled}
    cfg = tiny().evaluate
    cfg.models = {name: r["outputs"]["model_dir"] for name, r in models.items()}
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
        assert 0.0 <= result["metrics"][f"{name}.task_accuracy"] <= 1.0
        assert report["models"][name]["task_examples"] == len(scored)
        assert set(report["models"][name]["per_skill"]) == {r["skill"] for r in scored}
    # the base model saw the same prose the val shards hold; evaluation must agree with pretraining
    assert result["metrics"]["base.val_loss"] == pytest.approx(
        math.log(result["metrics"]["base.perplexity"]))

    run = mlflow.MlflowClient().get_run(result["mlflow_run_id"])
    assert {"base.perplexity", "teacher.task_accuracy", "student.params"} <= set(run.data.metrics)
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(result["mlflow_run_id"])}
    assert {"report.json", "eval_report.png"} <= artifacts
