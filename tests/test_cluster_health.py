"""Cluster health inside the job (tasks/train/health.py), each with its fault injected on purpose:
a slowed rank (a straggler), a flipped bit in one rank's parameters (silent data corruption), a
node whose burn-in computes a wrong result. The jobs are the command a backend runs, under
torchrun with gloo: three CPU processes where a replica must be told from the majority."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tasks.train import telemetry as tm
from tasks.train.faults import parse_faults
from tasks.train.health import NODE_UNHEALTHY_EXIT, NodeUnhealthy, burn_in, flip_bit, param_checksum
from tests.test_resilience import final_weights, kinds, run_pretrain, tiny_cfg

# 12 steps, checkpoints every 4; step times compared every 2 steps (2 slow checks in a row name
# a straggler), replica checksums every 2 steps and before each checkpoint
HEALTH = dict(max_steps=12, batch_size=4, checkpoint_interval=4, eval_interval=12,
              log_interval=4, hot_spare=False, hang_timeout_s=120.0, straggler_check_every=2,
              straggler_steps=2, sdc_check_every=2)


def test_the_checksum_is_exact_and_burn_in_names_a_wrong_result():
    torch.manual_seed(0)
    params = [torch.randn(64, 32), torch.randn(32)]
    copy = [p.clone() for p in params]
    assert torch.equal(param_checksum(params), param_checksum(copy))
    flip_bit(copy, bit=0)  # the lowest mantissa bit: a change of one part in 2^23
    assert not torch.equal(param_checksum(params), param_checksum(copy))
    flip_bit(copy, bit=0)  # flipped back: the same bytes, the same checksum
    assert torch.equal(param_checksum(params), param_checksum(copy))
    flip_bit(copy, bit=30)  # an exponent bit
    assert not torch.equal(param_checksum(params), param_checksum(copy))

    report = burn_in(rank=0, world=1, device=torch.device("cpu"), min_gbps=0.0, hosts=["node-a"])
    assert report["ok"] and not report["failed"]
    with pytest.raises(NodeUnhealthy, match="rank 0 on node-a: its matmul has 1 wrong elements"):
        burn_in(rank=0, world=1, device=torch.device("cpu"), min_gbps=0.0, hosts=["node-a"],
                corrupt=True)
    assert [f.kind for f in parse_faults("slow_rank@3+0.2s:1,flip_bit@7:2,bad_burnin@1:1")] == [
        "slow_rank", "flip_bit", "bad_burnin"]


def _events(cfg) -> list[dict]:
    return tm.read_events(tm.run_dir(cfg.output_dir))


def test_a_slow_rank_is_named_and_a_flipped_bit_is_rolled_back_without_false_alarms(
        tiny_data_dir, tmp_path):
    """Run A: rank 1 sleeps 0.25 s in every step from step 2 on and one bit of rank 2's weights
    flips after step 7. Rank 1 is named a straggler (log, events, result); the check at step 8
    finds rank 2's replica different, the job goes back to the step 4 checkpoint (the newest at
    or before step 6, the last check that agreed) and finishes. Run B: the same job clean: no
    straggler, no mismatch, and A's final weights are B's, bit for bit."""
    clean_cfg = tiny_cfg(tiny_data_dir, tmp_path / "clean", **HEALTH)
    (tmp_path / "b").mkdir()
    proc, result_file = run_pretrain(clean_cfg, tmp_path / "b", nproc=3, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    clean = json.loads(result_file.read_text())
    assert clean["health"] == {"stragglers": [], "sdc_mismatches": []}
    assert clean["metrics"]["stragglers"] == 0 and clean["metrics"]["sdc_mismatches"] == 0
    events = _events(clean_cfg)
    assert not kinds(events, "rollback") and len(kinds(events, "burn_in")) == 3
    assert all(e["ok"] for e in kinds(events, "burn_in"))

    cfg = tiny_cfg(tiny_data_dir, tmp_path / "faulty", **HEALTH)
    (tmp_path / "a").mkdir()
    proc, result_file = run_pretrain(cfg, tmp_path / "a", nproc=3, timeout=600,
                                     faults="slow_rank@2+0.25s:1,flip_bit@7:2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    result = json.loads(result_file.read_text())
    assert result["metrics"]["step"] == 12

    stragglers = result["health"]["stragglers"]
    assert stragglers and {s["rank"] for s in stragglers} == {1}
    assert all(s["ratio"] >= 1.5 and s["step_s"] >= 0.25 for s in stragglers)
    assert "straggler: rank 1 on" in out
    assert result["metrics"]["stragglers"] == len(stragglers)
    import mlflow

    history = mlflow.MlflowClient().get_metric_history(result["mlflow_run_id"],
                                                       "health/straggler_rank1")
    assert sorted(m.step for m in history) == sorted(s["step"] for s in stragglers)

    [mismatch] = result["health"]["sdc_mismatches"]
    assert mismatch["step"] == 8 and mismatch["ranks"] == [2] and mismatch["repeat"] == []
    assert "silent data corruption: at step 8 the parameters of rank(s) [2]" in out
    events = _events(cfg)
    [rollback] = kinds(events, "rollback", anomaly="sdc", rank=0)
    assert rollback["from_step"] == 8 and rollback["to_step"] == 4
    assert rollback["path"].endswith("step_000004")

    a, b = final_weights(Path(cfg.output_dir), 12), final_weights(Path(clean_cfg.output_dir), 12)
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_the_same_rank_corrupt_twice_stops_the_job_for_its_node(tiny_data_dir, tmp_path):
    """A bit of rank 2 flips after step 5 (rolled back at the step 6 check) and again after
    step 7: the check at step 8 names rank 2 a second time and the job stops with the node's
    exit code and the reason, without a restart on the same hardware."""
    cfg = tiny_cfg(tiny_data_dir, tmp_path / "job", **HEALTH)
    proc, result_file = run_pretrain(cfg, tmp_path, nproc=3, timeout=600,
                                     faults="flip_bit@5:2,flip_bit@7:2")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not result_file.exists(), out[-8000:]
    assert "silent data corruption on rank(s) [2] again (step 8" in out
    assert f"exitcode  : {NODE_UNHEALTHY_EXIT}" in out  # torchrun's report of its workers
    events = _events(cfg)
    assert [e["step"] for e in kinds(events, "sdc_mismatch", rank=0)] == [6, 8]
    assert not kinds(events, "restart")  # the supervisors did not restart on the bad node
    assert kinds(events, "worker_exit", code=NODE_UNHEALTHY_EXIT)


def test_straggler_action_restart_stops_the_job_naming_the_slow_rank(tiny_data_dir, tmp_path):
    cfg = tiny_cfg(tiny_data_dir, tmp_path / "job", **{**HEALTH, "straggler_action": "restart"})
    proc, result_file = run_pretrain(cfg, tmp_path, nproc=2, timeout=600,
                                     faults="slow_rank@1+0.25s:1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not result_file.exists(), out[-8000:]
    assert "straggler: rank 1 on" in out and "(straggler_action restart)" in out
    assert f"exitcode  : {NODE_UNHEALTHY_EXIT}" in out
    events = _events(cfg)
    assert [(e["step"], e["straggler_rank"]) for e in kinds(events, "straggler", rank=0)] == [(4, 1)]
    assert not kinds(events, "restart")


def test_a_node_that_fails_burn_in_refuses_to_join(tiny_data_dir, tmp_path):
    cfg = tiny_cfg(tiny_data_dir, tmp_path / "job", **HEALTH)
    proc, result_file = run_pretrain(cfg, tmp_path, nproc=2, timeout=600, faults="bad_burnin@1:1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not result_file.exists(), out[-8000:]
    assert "burn-in failed: rank 1 on" in out and "its matmul has 1 wrong elements" in out
    assert f"exitcode  : {NODE_UNHEALTHY_EXIT}" in out
    events = _events(cfg)
    assert not kinds(events, "save") and not kinds(events, "restart")
    [failed] = [e for e in kinds(events, "burn_in") if e["rank"] == 0]
    assert failed["ok"] is False and failed["ranks"] == [1]
