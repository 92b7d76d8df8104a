"""Pretraining on the tiny prepared data: batches, schedule, checkpoints, exact resume, and the
pretrain and sweep entrypoints as a backend would run them."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.configs import OptimConfig, TrainConfig, from_dict, tiny, to_dict
from tasks.model.gpt import GPT
from tasks.train import checkpoint as ckpt
from tasks.train.prepared_data import DataDir, PretrainBatches
from tasks.train.losses import cross_entropy
from tasks.train.loop import train
from tasks.train.runtime import seed_everything
from tasks.train.schedule import lr_at
from tasks.train.scoring import shard_loss

REPO = Path(__file__).resolve().parents[1]


def run_entrypoint(stage: str, config, workdir: Path) -> dict:
    """`python -m tasks.<stage> --config ... --result ...`, as every backend runs it."""
    config_path, result_path = workdir / f"{stage}.config.json", workdir / f"{stage}.result.json"
    config_path.write_text(json.dumps(to_dict(config)))
    proc = subprocess.run([sys.executable, "-m", f"tasks.{stage}", "--config", str(config_path),
                           "--result", str(result_path)],
                          cwd=REPO, env=os.environ, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return {**json.loads(result_path.read_text()), "stdout": proc.stdout}


def tiny_pretrain(data_dir: Path, output_dir: Path, **overrides) -> TrainConfig:
    cfg = tiny().pretrain
    cfg.data_dir, cfg.output_dir = str(data_dir), str(output_dir)
    return from_dict(TrainConfig, {**to_dict(cfg), **overrides})


# --------------------------------------------------------------------------------------------
# Pieces


def test_schedule_warms_up_then_decays_to_the_floor():
    optim = OptimConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, optim, max_steps=100) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4)
    assert lrs[9] == pytest.approx(1e-3)  # peak at the end of warmup
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # then never rises
    assert lr_at(100, optim, 100) == pytest.approx(1e-4)  # min_lr_ratio * lr
    assert lr_at(1000, optim, 100) == pytest.approx(1e-4)


def test_batches_are_a_function_of_seed_and_step(tiny_data_dir):
    rows = DataDir(tiny_data_dir).split("train")
    a, b = PretrainBatches(rows, 4, seed=7), PretrainBatches(rows, 4, seed=7)
    assert torch.equal(a(5).inputs, b(5).inputs)  # a resumed job reads the same batch 5
    assert not torch.equal(a(5).inputs, PretrainBatches(rows, 4, seed=8)(5).inputs)
    batch = a(0)
    assert batch.inputs.shape == (4, rows.row_len - 1)
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])  # targets are shifted inputs
    assert batch.inputs.dtype == torch.long
    # one epoch visits every row exactly once
    first_epoch = a.sampler.at(np.arange(rows.rows // 4 * 4))
    assert len(set(first_epoch.tolist())) == len(first_epoch)


def save_some(root: Path, steps: list[int], keep: int = 10) -> None:
    for step in steps:
        ckpt.save_checkpoint(root, step, {"model": {"w": torch.full((3,), float(step))}},
                             {"step": step}, keep=keep)


def test_corrupt_or_partial_newest_checkpoint_is_skipped(tmp_path):
    root = tmp_path / "checkpoints"
    save_some(root, [10, 20, 30])
    assert ckpt.latest_valid_checkpoint(root) == root / "step_000030"

    # a flipped byte in the newest: its checksum fails, the one before is used
    weights = root / "step_000030" / "model.pt"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert ckpt.verify_checkpoint(root / "step_000030") == "model.pt fails its sha256"
    assert ckpt.latest_valid_checkpoint(root) == root / "step_000020"

    # a directory without its manifest (a copy that stopped half way) is not a checkpoint
    (root / "step_000020" / "manifest.json").unlink()
    assert ckpt.latest_valid_checkpoint(root) == root / "step_000010"
    # and a save that died before its rename leaves only a hidden directory nobody reads
    (root / ".tmp-step_000040-123").mkdir()
    assert ckpt.latest_valid_checkpoint(root) == root / "step_000010"

    loaded = ckpt.load_checkpoint(root / "step_000010")
    assert loaded["step"] == 10 and torch.equal(loaded["model"]["w"], torch.full((3,), 10.0))


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    root = tmp_path / "checkpoints"
    save_some(root, [1, 2, 3, 4], keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_000003", "step_000004"]


# --------------------------------------------------------------------------------------------
# Exact resume: what an Airflow retry relies on


def run_loop(cfg: TrainConfig, data_dir: Path):
    """What the pretrain stage does, minus MLflow: seed, build, train (resuming if it can)."""
    data = DataDir(data_dir)
    seed_everything(cfg.seed)
    model = GPT(cfg.model)
    val = data.split("val")
    result = train(model=model, cfg=cfg, device=torch.device("cpu"), resolved_config=to_dict(cfg),
                   get_batch=PretrainBatches(data.split("train"), cfg.batch_size, cfg.seed),
                   loss_fn=cross_entropy, tracking=False,
                   evaluate=lambda m: {"val_loss": shard_loss(m, val, 4, 1, torch.device("cpu"))})
    return model, result


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, f"weights differ in {different}"


def test_stopped_then_extended_run_matches_uninterrupted_run(tiny_data_dir, tmp_path):
    # dropout on, so the restored torch RNG state matters; a warmup-then-constant lr, because
    # a cosine over max_steps=N would differ from one over M by design
    common = dict(max_steps=12, eval_interval=5, checkpoint_interval=100, log_interval=4,
                  optim={**to_dict(OptimConfig()), "warmup_steps": 4, "min_lr_ratio": 1.0},
                  model={**to_dict(tiny().pretrain.model), "dropout": 0.1})
    whole, _ = run_loop(tiny_pretrain(tiny_data_dir, tmp_path / "whole", **common), tiny_data_dir)

    first, r1 = run_loop(tiny_pretrain(tiny_data_dir, tmp_path / "split", **{**common, "max_steps": 7}),
                         tiny_data_dir)
    assert r1.step == 7 and r1.resumed_from is None
    resumed, r2 = run_loop(tiny_pretrain(tiny_data_dir, tmp_path / "split", **common), tiny_data_dir)
    assert r2.resumed_from == str(tmp_path / "split" / "checkpoints" / "step_000007")
    assert r2.step == 12
    assert_same_weights(resumed, whole)


def test_retry_after_a_crash_resumes_bitwise(tiny_data_dir, tmp_path):
    """Same config, cosine schedule: the job 'crashed' after step 10 (later checkpoints lost,
    the newest one damaged), and the retry from step 10 ends where the uninterrupted job did."""
    cfg = tiny_pretrain(tiny_data_dir, tmp_path / "run", max_steps=15, checkpoint_interval=5,
                        keep_checkpoints=5, model={**to_dict(tiny().pretrain.model), "dropout": 0.1})
    whole, _ = run_loop(cfg, tiny_data_dir)
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for _, p in ckpt.step_dirs(root)] == ["step_000015", "step_000010", "step_000005"]
    (root / "step_000015" / "optimizer.pt").write_bytes(b"truncated")
    retried, result = run_loop(cfg, tiny_data_dir)
    assert result.resumed_from == str(root / "step_000010")
    assert_same_weights(retried, whole)


# --------------------------------------------------------------------------------------------
# Entrypoints


def test_pretrain_entrypoint(tiny_data_dir, tmp_path):
    import mlflow

    cfg = tiny_pretrain(tiny_data_dir, tmp_path / "pretrain")
    result = run_entrypoint("pretrain", cfg, tmp_path)
    assert set(result["outputs"]) == {"model_dir", "checkpoint"}
    assert {"val_loss", "train_loss", "tokens_per_s", "params"} <= set(result["metrics"])
    assert result["metrics"]["val_loss"] < 5.5  # ln(300) = 5.7: it learned something
    assert result["outputs"]["checkpoint"].endswith("step_000020")
    assert "step 20/20 | loss" in result["stdout"]  # progress lines reach the task log

    model_dir = Path(result["outputs"]["model_dir"])
    # a Hugging Face directory, with the very tokenizer file the data was prepared with
    assert sorted(p.name for p in model_dir.iterdir()) == [
        "README.md", "config.json", "generation_config.json", "meta.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]
    assert (model_dir / "tokenizer.json").read_bytes() == DataDir(tiny_data_dir).tokenizer_path.read_bytes()
    meta = json.loads((model_dir / "meta.json").read_text())
    assert meta["data_content_hash"] == DataDir(tiny_data_dir).content_hash
    assert meta["source_checkpoint"] == result["outputs"]["checkpoint"]
    assert meta["model_uri"] == result["model_uri"]

    # transformers loads it as the GPT-2 our GPT is, and the MLflow model (transformers flavor)
    # computes what the model directory computes
    from transformers import AutoModelForCausalLM

    from tasks.train.export import load_model

    model, _ = load_model(model_dir)
    assert isinstance(model, GPT)
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    logged = mlflow.transformers.load_model(result["model_uri"], return_type="components")
    assert type(hf).__name__ == type(logged["model"]).__name__ == "GPT2LMHeadModel"
    idx = torch.randint(0, model.config.vocab_size, (3, 11))
    torch.testing.assert_close(hf(idx).logits, model.eval()(idx)[0])
    torch.testing.assert_close(logged["model"](idx).logits, model(idx)[0])

    client = mlflow.MlflowClient()
    run = client.get_run(result["mlflow_run_id"])
    # MLflow names group the charts: the loss curves first (tasks.common.job_tracking.CHART_NAMES)
    for key in ("loss/train", "optim/lr", "optim/grad_norm", "perf/tokens_per_s", "loss/val"):
        assert key in run.data.metrics, key
    assert not {"loss", "val_loss", "mfu", "perf/mfu"} & set(run.data.metrics)  # no MFU on a CPU
    loss_steps = [m.step for m in client.get_metric_history(result["mlflow_run_id"], "loss/train")]
    assert loss_steps == [1, 5, 10, 15, 20]
    assert run.data.tags["lineage.data_content_hash"] == meta["data_content_hash"]
    assert "loss_curve.png" in {a.path for a in client.list_artifacts(result["mlflow_run_id"])}

    # a retry of the finished job resumes from its last checkpoint instead of training again
    again = run_entrypoint("pretrain", cfg, tmp_path)
    assert again["resumed_from"] == result["outputs"]["checkpoint"]
    assert again["metrics"]["val_loss"] == pytest.approx(result["metrics"]["val_loss"])


def test_sweep_trial_entrypoint(tiny_data_dir, tmp_path):
    sweep = tiny().sweep
    lr = sweep.learning_rates()[-1]
    cfg = tiny_pretrain(tiny_data_dir, tmp_path / "trial", max_steps=sweep.steps,
                        optim={**to_dict(OptimConfig()), "lr": lr})
    result = run_entrypoint("sweep", cfg, tmp_path)
    assert result["stage"] == "sweep"
    assert result["metrics"]["lr"] == lr
    # it learned: below the loss of a uniform guess over the vocabulary (ln V), where it starts
    assert 0 < result["metrics"]["val_loss"] < math.log(cfg.model.vocab_size) - 0.5
    assert "model_uri" not in result and "model_dir" not in result["outputs"]
