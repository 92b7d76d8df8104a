"""The checkpoint writer process (tasks/train/checkpoint_io.py, WriterProcess): a large state's
files are written by a process of its own, from shared memory, so that a save holds none of the
training process's GIL. Real processes, real files; nothing simulated."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tasks.train import checkpoint as ckpt
from tasks.train import checkpoint_io
from tests.test_jobs import pid_alive

ROOT = Path(__file__).resolve().parents[1]


def _state(value: float, hidden: int = 64) -> dict:
    """A state shaped like a model's and an optimizer's: nested dicts, lists, tuples, a 0-dim
    step, an empty tensor, bf16, and values that are not tensors."""
    return {"model": {"w": torch.full((hidden, 32), value), "b": torch.full((32,), value,
                                                                            dtype=torch.bfloat16)},
            "optimizer": {"state": {0: {"step": torch.tensor(value), "exp_avg": torch.full(
                (hidden, 32), value / 2)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
            "trainer": {"step": int(value), "rng": (torch.zeros(4, dtype=torch.uint8), [1, 2]),
                        "empty": torch.zeros(0, 3)}}


def _wait_ready(saver: ckpt.Checkpointer, timeout: float = 60) -> int:
    """Wait until the writer process a save started takes jobs (the saves before that are
    written on the thread); its pid."""
    deadline = time.monotonic() + timeout
    while not (saver._process is not None and saver._process.ready):
        assert time.monotonic() < deadline, "the writer process never became ready"
        time.sleep(0.2)
    return saver._process._proc.pid


def _written_by(pid: int) -> int:
    """Bytes process `pid` has written through write() (/proc/<pid>/io: wchar)."""
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["wchar"])


def test_a_large_state_is_written_by_the_writer_process_exactly_as_it_was_at_save(tmp_path):
    root = tmp_path / "checkpoints"
    beats: list[int] = []
    saver = ckpt.Checkpointer(root, keep=5, config={"run": 1}, process_min_bytes=0,
                              on_progress=beats.append)
    state = _state(1.0)
    saver.save(1, state)  # written on the thread while the process starts
    saver.wait()
    pid = _wait_ready(saver)
    before = _written_by(pid)
    for step in (2, 3):
        state = _state(float(step))
        saver.save(step, state)
        for t in (state["model"]["w"], state["optimizer"]["state"][0]["exp_avg"]):
            t.add_(100.0)  # training moves on while the save is written
    last = saver.wait()
    assert last == root / "step_000003"
    for step in (1, 2, 3):
        path = root / f"step_{step:06d}"
        assert ckpt.verify_checkpoint(path) is None
        loaded = ckpt.load_checkpoint(path)
        expected = _state(float(step))
        assert torch.equal(loaded["model"]["w"], expected["model"]["w"])
        assert loaded["model"]["b"].dtype == torch.bfloat16
        assert torch.equal(loaded["model"]["b"], expected["model"]["b"])
        assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"],
                           expected["optimizer"]["state"][0]["exp_avg"])
        assert loaded["optimizer"]["state"][0]["step"].item() == step
        assert loaded["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
        trainer = ckpt.read_part(path, "trainer")
        assert trainer["step"] == step and trainer["rng"][1] == [1, 2]
        assert trainer["empty"].shape == (0, 3)
    pt_bytes = sum(f.stat().st_size for s in (2, 3) for f in (root / f"step_{s:06d}").glob("*.pt"))
    # the two later saves' files were written by the writer process, not by this one
    assert _written_by(pid) - before >= pt_bytes
    # and every byte of every .pt file was a progress beat for the watchdog
    all_pt = sum(f.stat().st_size for s in (1, 2, 3) for f in (root / f"step_{s:06d}").glob("*.pt"))
    assert sum(beats) == all_pt


def test_a_state_that_changes_shape_is_laid_out_again(tmp_path):
    saver = ckpt.Checkpointer(tmp_path / "c", keep=5, config={}, process_min_bytes=0)
    saver.save(1, _state(1.0, hidden=64))
    saver.wait()
    _wait_ready(saver)
    saver.save(2, _state(2.0, hidden=64))
    saver.save(3, _state(3.0, hidden=96))  # e.g. the optimizer's state appeared, or grew
    saver.wait()
    assert saver._buffers.generation == 2
    loaded = ckpt.load_checkpoint(tmp_path / "c" / "step_000003")
    assert torch.equal(loaded["model"]["w"], torch.full((96, 32), 3.0))


def test_a_writer_process_killed_mid_write_costs_no_save_and_the_next_save_starts_a_new_one(
        tmp_path):
    killed: list[int] = []

    def kill_at_first_beat(n: int) -> None:  # the writer has written 64 MiB of 136 MB
        if not killed and saver._process.ready:
            killed.append(saver._process._proc.pid)
            os.kill(killed[0], signal.SIGKILL)

    saver = ckpt.Checkpointer(tmp_path / "c", keep=5, config={}, process_min_bytes=0,
                              on_progress=kill_at_first_beat)
    big = {"model": {"w": torch.zeros(34_000_000)}}  # 136 MB: beats at 64 and 128 MiB
    saver.save(1, big)  # written on the thread while the process starts
    saver.wait()
    _wait_ready(saver)
    big["model"]["w"].fill_(2.0)
    saver.save(2, big)
    big["model"]["w"].fill_(-1.0)  # training moves on while step 2 is rewritten
    # the process died half-way through step 2's files: the thread wrote them from the snapshot
    assert saver.wait() == tmp_path / "c" / "step_000002"
    assert killed and ckpt.verify_checkpoint(saver.last) is None
    assert torch.equal(ckpt.load_checkpoint(saver.last)["model"]["w"],
                       torch.full((34_000_000,), 2.0))
    assert not list((tmp_path / "c").glob(".tmp-*")), "the half-written copy was cleared"
    saver.save(3, _state(3.0))  # a new process starts; this save is written on the thread
    saver.wait()
    assert _wait_ready(saver) != killed[0]
    saver.save(4, _state(4.0))
    assert saver.wait() == tmp_path / "c" / "step_000004"
    assert torch.equal(ckpt.load_checkpoint(saver.last)["model"]["w"], torch.full((64, 32), 4.0))


def test_a_writer_process_that_died_between_saves_costs_no_save(tmp_path):
    saver = ckpt.Checkpointer(tmp_path / "c", keep=5, config={}, process_min_bytes=0)
    saver.save(1, _state(1.0))
    saver.wait()
    pid = _wait_ready(saver)
    os.kill(pid, signal.SIGKILL)
    while pid_alive(pid):
        time.sleep(0.05)
    saver.save(2, _state(2.0))  # written here, whether seen dead before or after the hand-over
    assert saver.wait() == tmp_path / "c" / "step_000002"
    assert torch.equal(ckpt.load_checkpoint(saver.last)["model"]["w"], torch.full((64, 32), 2.0))
    saver.save(3, _state(3.0))  # a new process has started by this save at the latest
    saver.wait()
    assert _wait_ready(saver) != pid


def test_the_writer_process_dies_with_a_killed_training_process(tmp_path):
    code = textwrap.dedent(f"""
        import sys, time, torch
        from tasks.train import checkpoint as ckpt
        saver = ckpt.Checkpointer({str(tmp_path / 'c')!r}, keep=2, config={{}}, process_min_bytes=0)
        saver.save(1, {{"model": {{"w": torch.zeros(1000)}}}})
        saver.wait()
        while not saver._process.ready:
            time.sleep(0.1)
        print(saver._process._proc.pid, flush=True)
        time.sleep(600)
    """)  # no __main__ guard: the writer is not multiprocessing's spawn, which would re-run it
    job = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                           text=True)
    try:
        writer = int(job.stdout.readline())
        assert pid_alive(writer)
    finally:
        job.kill()
        job.wait()
    deadline = time.monotonic() + 10
    while pid_alive(writer):
        assert time.monotonic() < deadline, "the writer process outlived its training process"
        time.sleep(0.05)


def test_a_small_state_is_written_on_the_thread_without_a_process(tmp_path):
    saver = ckpt.Checkpointer(tmp_path / "c", keep=2, config={})  # the default threshold
    saver.save(1, _state(1.0))
    saver.save(2, _state(2.0))
    saver.wait()
    assert saver._process is None and not saver._buffers.shared
    assert checkpoint_io.state_bytes(_state(1.0)) < checkpoint_io.PROCESS_WRITER_MIN_BYTES
    assert torch.equal(ckpt.load_checkpoint(saver.last)["model"]["w"], torch.full((64, 32), 2.0))


@pytest.mark.parametrize("shared", [False, True])
def test_the_snapshot_copy_spread_over_the_cores_is_exact(monkeypatch, shared):
    """Training waits for the copy of its state, so it runs on every core, in slices: uneven
    sizes, dtypes and a tensor split across threads all come out exact."""
    # 1000 bytes: many slices of tiny data
    monkeypatch.setattr(checkpoint_io.SnapshotBuffers, "SLICE", 1000)
    generator = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(3001, generator=generator),
             "b": torch.randn(7, 111, generator=generator),
             "c": torch.randn(777, generator=generator).to(torch.bfloat16),
             "d": [torch.arange(5000, dtype=torch.int64), torch.tensor(3.5)], "e": torch.zeros(0)}
    buffers = checkpoint_io.SnapshotBuffers(pinned=False, shared=shared)
    buffers.fit(state)
    for round_ in range(2):  # the second copy reuses the buffers
        copied = checkpoint_io.snapshot(state, buffers)
        for key in ("a", "b", "c", "e"):
            assert torch.equal(copied[key], state[key]) and copied[key].dtype == state[key].dtype
            assert copied[key].data_ptr() != state[key].data_ptr() or not state[key].numel()
        assert torch.equal(copied["d"][0], state["d"][0]) and copied["d"][1].item() == 3.5
        state["a"].add_(1.0)
        assert not torch.equal(copied["a"], state["a"])  # a copy, not a view
    if len(os.sched_getaffinity(0)) > 1:
        assert buffers._pool is not None, "the copy never ran on more than one thread"


@pytest.mark.parametrize("process_min_bytes", [0, 1 << 40], ids=["writer-process", "writer-thread"])
def test_a_copy_made_beside_training_holds_the_state_as_it_was_at_save(tmp_path, process_min_bytes):
    """save(copy_in_background=True) returns before the state is copied: the copy is made while
    the next step's forward and backward read the weights, and wait_for_snapshot() holds the
    optimizer step back until it is done. The checkpoint holds the weights of the step it names,
    not the ones the step after it wrote."""
    saver = ckpt.Checkpointer(tmp_path / "c", keep=5, config={}, process_min_bytes=process_min_bytes)
    weights = {"model": {"w": torch.full((8_000_000,), 1.0)}, "trainer": {"step": 1}}  # 32 MB
    saver.save(1, weights, copy_in_background=True)
    saver.wait()
    for step in (2, 3, 4):
        weights["model"]["w"].fill_(float(step))
        weights["trainer"]["step"] = step
        saver.save(step, weights, copy_in_background=True)
        read_meanwhile = float(weights["model"]["w"].sum())  # the forward pass reads the weights
        saver.wait_for_snapshot()
        weights["model"]["w"].add_(100.0)  # the optimizer step, in place
        weights["trainer"]["step"] = -1  # nor does a later change to the state's other values count
        assert read_meanwhile == step * 8_000_000
        assert saver.wait() == tmp_path / "c" / f"step_{step:06d}"
        saved = ckpt.load_checkpoint(saver.last)
        assert torch.equal(saved["model"]["w"], torch.full((8_000_000,), float(step)))
        assert saved["trainer"]["step"] == step
    assert saver.wait_for_snapshot() == 0.0  # nothing in flight: no wait


def test_a_failed_background_copy_does_not_hang_the_optimizer_step_and_is_raised(tmp_path, monkeypatch):
    saver = ckpt.Checkpointer(tmp_path / "c", keep=5, config={}, process_min_bytes=1 << 40)
    saver.save(1, _state(1.0), copy_in_background=True)
    saver.wait()

    def broken(pairs, threads=None):
        raise OSError("no memory for the copy")

    monkeypatch.setattr(saver._buffers, "copy", broken)
    saver.save(2, _state(2.0), copy_in_background=True)
    saver.wait_for_snapshot()  # returns: the copy's failure is the save's, not a hang
    with pytest.raises(RuntimeError, match="no memory for the copy"):
        saver.wait()
    assert saver.last == tmp_path / "c" / "step_000001"
