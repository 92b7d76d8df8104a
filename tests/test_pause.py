"""Pause a running pretraining and resume it (issue 24, point 2), at the job level: python -m
tasks.pretrain on the tiny data, on CPU, as a backend runs it. A marker next to the checkpoints
(output_dir/checkpoints/PAUSE, {"at_step": N}) stops the job after step N with that step's
checkpoint committed, "paused at step N" in its log, PAUSED_EXIT and a result that says so; a
fork of its checkpoints at N with nothing changed ends bitwise where a run never paused ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.configs import TrainConfig, from_dict, to_dict
from tasks.train import checkpoint as ckpt
from tasks.train import telemetry as tm
from tasks.train.pause import MARKER, PauseWatch, marker_path, parse_request
from tasks.train.supervisor import PAUSED_EXIT
from tests.test_fork import assert_same_state, state
from tests.test_resilience import run_pretrain, tiny_cfg

STEPS, PAUSE_AT = 12, 6   # 6: not a checkpoint step (every 4), so the pause itself saves it


def cfg_for(data_dir: Path, out: Path) -> TrainConfig:
    return tiny_cfg(data_dir, out, max_steps=STEPS, checkpoint_interval=4, keep_checkpoints=2,
                    eval_interval=STEPS, log_interval=2, hot_spare=False)


def request_pause(output_dir: Path, at_step: int) -> Path:
    marker = marker_path(output_dir)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"at_step": at_step, "by": "test"}))
    return marker


def test_a_paused_job_resumed_as_a_fork_ends_bitwise_where_an_unpaused_one_ends(
        tiny_data_dir, tmp_path):
    (tmp_path / "a").mkdir()
    unpaused = cfg_for(tiny_data_dir, tmp_path / "a" / "job")
    proc, _ = run_pretrain(unpaused, tmp_path / "a")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]

    (tmp_path / "b").mkdir()
    paused = cfg_for(tiny_data_dir, tmp_path / "b" / "job")
    marker = request_pause(tmp_path / "b" / "job", PAUSE_AT)
    proc, result = run_pretrain(paused, tmp_path / "b")
    assert proc.returncode == PAUSED_EXIT, (proc.stdout + proc.stderr)[-6000:]
    assert f"paused at step {PAUSE_AT} of {STEPS}" in proc.stdout
    checkpoints = tmp_path / "b" / "job" / "checkpoints"
    out = json.loads(result.read_text())
    assert (out["paused"], out["paused_at_step"]) == (True, PAUSE_AT)
    assert out["metrics"]["paused_at_step"] == out["outputs"]["paused_at_step"] == PAUSE_AT
    assert out["outputs"]["checkpoint"] == str(checkpoints / f"step_{PAUSE_AT:06d}")
    assert "model_dir" not in out["outputs"], "a paused job publishes no model"
    assert out["pause_request"] == {"at_step": PAUSE_AT, "by": "test"}
    assert out["resume"] == {"fork_from": str(checkpoints), "fork_step": PAUSE_AT}
    # it stopped after step 6 exactly, that step committed, and the marker was consumed
    assert [s for s, _ in ckpt.step_dirs(checkpoints)] == [PAUSE_AT, 4]
    assert ckpt.verify_checkpoint(checkpoints / f"step_{PAUSE_AT:06d}") is None
    assert state(checkpoints, PAUSE_AT)["trainer"]["step"] == PAUSE_AT
    assert not marker.exists()
    events = tm.read_events(tm.run_dir(paused.output_dir))
    assert [(e["source"], e["step"]) for e in events if e["kind"] == "paused"] == \
        [("worker", PAUSE_AT), ("supervisor", PAUSE_AT)]
    assert not [e for e in events if e["kind"] == "restart"], "a pause is not restarted"

    # resume: a fork of its own checkpoints at that step, nothing changed
    (tmp_path / "c").mkdir()
    resumed = from_dict(TrainConfig, {**to_dict(paused), "output_dir": str(tmp_path / "c" / "job"),
                                      "fork_from": str(checkpoints), "fork_step": PAUSE_AT})
    proc, result = run_pretrain(resumed, tmp_path / "c")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    out = json.loads(result.read_text())
    assert "paused" not in out
    assert out["resumed_from"] == str(tmp_path / "c" / "job" / "checkpoints" / "step_000006")
    # weights, optimizer moments, RNG, data cursor, guard: all of it, tensor by tensor
    assert_same_state(state(tmp_path / "c" / "job" / "checkpoints", STEPS),
                      state(tmp_path / "a" / "job" / "checkpoints", STEPS))


def test_two_ranks_stop_after_the_same_step(tiny_data_dir, tmp_path):
    """DDP on gloo: rank 0 alone reads the marker; both ranks pause after step 6."""
    cfg = cfg_for(tiny_data_dir, tmp_path / "job")
    request_pause(tmp_path / "job", PAUSE_AT)
    proc, result = run_pretrain(cfg, tmp_path, nproc=2)
    # rank 0 exits PAUSED_EXIT; torchrun reports any non-zero exit as its own failure
    assert proc.returncode != 0, (proc.stdout + proc.stderr)[-6000:]
    out = json.loads(result.read_text())
    assert (out["paused"], out["paused_at_step"]) == (True, PAUSE_AT), proc.stdout[-4000:]
    events = tm.read_events(tm.run_dir(cfg.output_dir))
    assert sorted((e["rank"], e["step"]) for e in events
                  if e["kind"] == "paused" and e["source"] == "worker") == \
        [(0, PAUSE_AT), (1, PAUSE_AT)]
    checkpoints = tmp_path / "job" / "checkpoints"
    assert [s for s, _ in ckpt.step_dirs(checkpoints)] == [PAUSE_AT, 4]
    assert state(checkpoints, PAUSE_AT)["trainer"]["world_size"] == 2


def test_the_marker_a_researcher_writes(tmp_path):
    assert parse_request(b'{"at_step": 40, "by": "ana"}') == {"at_step": 40, "by": "ana"}
    assert parse_request(b"") == {"at_step": None}
    assert parse_request(b"please") == {"at_step": None}, "any content: pause at the next step"
    watch = PauseWatch(tmp_path / MARKER, poll_s=0.05)
    watch.start()
    try:
        assert not watch.wanted(1)
        (tmp_path / MARKER).write_text('{"at_step": 3}')
        watch.poll()
        assert [watch.wanted(s) for s in (2, 3, 4)] == [False, True, True]
    finally:
        watch.stop()
    assert watch.consume() == {"at_step": 3}
    assert not (tmp_path / MARKER).exists()


def test_the_marker_on_s3(moto_s3, tmp_path):
    """With checkpoint_uri, the marker is <checkpoint_uri>/PAUSE: read, then deleted."""
    from tasks.train.checkpoint_s3 import S3Mirror

    moto_s3.create_bucket(Bucket="ckpt")
    mirror = S3Mirror("s3://ckpt/runs/r1")
    watch = PauseWatch(tmp_path / MARKER, mirror)
    assert watch.poll() is None
    moto_s3.put_object(Bucket="ckpt", Key="runs/r1/PAUSE", Body=b'{"at_step": 8}')
    assert watch.poll() == {"at_step": 8}
    assert watch.places[-1] == "s3://ckpt/runs/r1/PAUSE"
    assert watch.consume() == {"at_step": 8}
    assert mirror.read_object(MARKER) is None
