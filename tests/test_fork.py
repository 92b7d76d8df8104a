"""Fork a pretraining from a step (issue 24, point 1), as a backend runs it: python -m
tasks.pretrain on the tiny data, on CPU. The parent keeps checkpoints 4, 8, 10 and 12
(keep_checkpoints 2, keep_every 4); a fork restores one of them exactly (weights, optimizer,
RNG, data cursor) and trains on with the knobs it may change; what it may not change, and a
step the parent did not keep, are refused by name before anything trains."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from tasks.configs import TrainConfig, from_dict, to_dict
from tasks.train import checkpoint as ckpt
from tasks.train import telemetry as tm
from tasks.train.fork import ForkError, parent_checkpoint
from tests.test_resilience import run_pretrain, tiny_cfg

STEPS = 12


def assert_same_state(a: object, b: object, where: str = "") -> None:
    """Every tensor bitwise equal (torch.equal), everything else equal, key by key."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a) ^ set(b))
        for key in a:
            assert_same_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def state(checkpoints: Path, step: int) -> dict:
    """A checkpoint's training state (not its config.json, which names its own places)."""
    found = ckpt.load_checkpoint(checkpoints / f"step_{step:06d}")
    return {k: found[k] for k in ("model", "optimizer", "trainer")}


@pytest.fixture(scope="module")
def parent(tiny_data_dir, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("parent")
    cfg = tiny_cfg(tiny_data_dir, work / "job", max_steps=STEPS, checkpoint_interval=2,
                   keep_checkpoints=2, keep_every=4, eval_interval=STEPS, log_interval=4,
                   hot_spare=False)
    proc, result = run_pretrain(cfg, work)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    checkpoints = work / "job" / "checkpoints"
    assert [s for s, _ in ckpt.step_dirs(checkpoints)] == [12, 10, 8, 4]
    return {"cfg": cfg, "checkpoints": checkpoints, "result": json.loads(result.read_text())}


def fork_cfg(parent: dict, out: Path, step: int, **changes) -> TrainConfig:
    optim = changes.pop("optim", {})
    base = to_dict(parent["cfg"])
    return from_dict(TrainConfig, {**base, "output_dir": str(out),
                                   "optim": {**base["optim"], **optim},
                                   "fork_from": str(parent["checkpoints"]), "fork_step": step,
                                   "fork_parent_run_id": parent["result"]["mlflow_run_id"],
                                   **changes})


def test_a_fork_with_nothing_changed_ends_bitwise_where_its_parent_ended(parent, tmp_path):
    cfg = fork_cfg(parent, tmp_path / "fork", 4)
    proc, result = run_pretrain(cfg, tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    out = json.loads(result.read_text())
    assert out["resumed_from"] == str(tmp_path / "fork" / "checkpoints" / "step_000004")
    assert out["fork"]["fork.step"] == 4
    # weights, optimizer moments, RNG, data cursor, guard: all of it, tensor by tensor
    assert_same_state(state(tmp_path / "fork" / "checkpoints", STEPS),
                      state(parent["checkpoints"], STEPS))


def test_a_fork_with_a_new_learning_rate_starts_from_the_parents_checkpoint(parent, tmp_path):
    from mlflow import MlflowClient

    from tasks.common.job_tracking import chart_name
    from tasks.train.schedule import lr_at

    lr = parent["cfg"].optim.lr * 3
    cfg = fork_cfg(parent, tmp_path / "fork", 8, optim={"lr": lr}, log_interval=1)
    proc, result = run_pretrain(cfg, tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    out = json.loads(result.read_text())
    mine = tmp_path / "fork" / "checkpoints"
    # its first step started from the parent's step 8, exactly: the copy it resumed from
    assert out["resumed_from"] == str(mine / "step_000008")
    assert_same_state(state(mine, 8), state(parent["checkpoints"], 8))
    resumes = [e for e in tm.read_events(tm.run_dir(cfg.output_dir)) if e["kind"] == "resume"]
    assert [(e["step"], e["path"]) for e in resumes] == [(8, str(mine / "step_000008"))]
    # ... with the new learning rate, on the parent's data cursor
    client = MlflowClient()
    first = [m for m in client.get_metric_history(out["mlflow_run_id"], chart_name("lr"))
             if m.step == 9]
    assert [m.value for m in first] == [pytest.approx(lr_at(8, cfg.optim, STEPS))]
    assert lr_at(8, cfg.optim, STEPS) != lr_at(8, parent["cfg"].optim, STEPS)
    ours, theirs = state(mine, 12), state(parent["checkpoints"], 12)
    assert ours["trainer"]["data_cursor"] == theirs["trainer"]["data_cursor"]
    assert any(not torch.equal(ours["model"][k], theirs["model"][k]) for k in theirs["model"])
    # lineage: the parent run and the step, on the fork's MLflow run
    tags = client.get_run(out["mlflow_run_id"]).data.tags
    assert tags["fork.parent_run_id"] == parent["result"]["mlflow_run_id"]
    assert tags["fork.step"] == "8"
    assert tags["fork.parent_checkpoint"] == str(parent["checkpoints"] / "step_000008")


def test_the_steps_the_retention_policy_kept_are_recorded_for_the_run_page(parent):
    """The job records what it kept (the run page lists them from MLflow, not from this disk)."""
    from mlflow import MlflowClient

    assert parent["result"]["kept_steps"] == [4, 8, 10, 12]
    tags = MlflowClient().get_run(parent["result"]["mlflow_run_id"]).data.tags
    assert (tags["checkpoints.kept"], tags["checkpoints.kept_count"]) == ("4,8,10,12", "4")


def test_a_step_the_parent_did_not_keep_is_refused_before_anything_trains(parent, tmp_path):
    cfg = fork_cfg(parent, tmp_path / "fork", 6)   # pruned: neither newest nor a multiple of 4
    proc, _ = run_pretrain(cfg, tmp_path)
    assert proc.returncode != 0
    assert ("fork_step: step 6 is not a kept checkpoint of " f"{parent['checkpoints']}; it keeps "
            "steps 4, 8, 10, 12.") in proc.stderr, proc.stderr[-3000:]
    assert ckpt.step_dirs(tmp_path / "fork" / "checkpoints") == []


def test_what_may_not_change_at_a_fork_is_refused_by_name(parent, tmp_path):
    model = dataclasses.asdict(parent["cfg"].model)
    cases = [
        ({"model": {**model, "n_layer": model["n_layer"] + 1}},
         f"model.n_layer ({model['n_layer']} in the parent, {model['n_layer'] + 1} here)"),
        ({"model": {**model, "block_size": model["block_size"] * 2}}, "model.block_size ("),
        ({"batch_size": parent["cfg"].batch_size + 1}, "batch_size ("),
        ({"seed": parent["cfg"].seed + 1},
         f"seed ({parent['cfg'].seed} in the parent, {parent['cfg'].seed + 1} here)"),
        ({"optim": {"weight_decay": 0.0}}, "optim.weight_decay ("),
        ({"max_steps": 8}, "max_steps (8) must be past fork_step (8)"),
    ]
    for changes, message in cases:
        with pytest.raises(ForkError, match=re.escape(message)):
            parent_checkpoint(fork_cfg(parent, tmp_path / "fork", 8, **changes))
    other = tmp_path / "other_data"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps({"content_hash": "f" * 64}))
    with pytest.raises(ForkError, match="data_dir: .* is not the data the parent trained on"):
        parent_checkpoint(fork_cfg(parent, tmp_path / "fork", 8, data_dir=str(other)))
    # the declared knobs may change: the schedule, the length, the guard
    allowed = fork_cfg(parent, tmp_path / "fork", 8, optim={"lr": 1e-3, "warmup_steps": 2},
                       max_steps=20, spike_sigma=0.0, max_rollbacks=1, log_interval=1)
    assert parent_checkpoint(allowed) == parent["checkpoints"] / "step_000008"
    assert parent_checkpoint(fork_cfg(parent, tmp_path / "fork", 0, max_steps=20)).name == \
        "step_000012", "no step: the newest"

