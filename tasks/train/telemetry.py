"""What a training job records about itself, for the supervisor, goodput and the task log.

    <output_dir>/resilience/
        events.jsonl        one JSON object per line, from the supervisors and workers of every rank:
                            job_start, spawn, restart, hang, worker_exit, fault_injected, anomaly,
                            rollback, skip, peer_failure, resume, save, eval, ...
        steps.rank0.jsonl   one line per optimizer step that passed its checks (rank 0 only):
                            attempt, step, batch index and the times it started, had its batch,
                            and ended
        heartbeat.rank<r>   48 bytes, memory-mapped, read by the rank's supervisor's watchdog: the
                            training thread's record (step, time of its last progress, phase, pid)
                            and the checkpoint I/O record (time of the last bytes written, uploaded
                            or downloaded, and how many so far). Two records because a background
                            save runs while steps continue: a step's beat must not vouch for a stuck
                            writer, nor the writer's for a stuck step. The watchdog counts the I/O
                            record as progress only while the training thread waits on that I/O
                            (phases SAVE, RESTORE, UPLOAD).

and `Progress`, the "| 25.0% | elapsed 0:01:02 | eta 0:03:06" ending every progress line of a
long job (training steps, data prep phases, evaluated models).

Standard library only: the supervisor imports this without torch. Events are appended with one
write() on an O_APPEND descriptor, so lines from several processes never interleave; times are
wall-clock seconds (time.time) because they are compared across processes.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any, Iterator, NamedTuple

log = logging.getLogger(__name__)

RUN_DIR = "resilience"

# What a worker is doing, for the watchdog (a worker blocked in SYNC may be waiting on a peer;
# SAVE, RESTORE, UPLOAD (waiting for the last checkpoint to be durable) and COMPILE (the first
# step after torch.compile) have budgets of their own, tasks/train/supervisor.py).
(STARTING, READY, STEP, SYNC, EVAL, SAVE, RESTORE, RENDEZVOUS, FINISHING, COMPILE,
 UPLOAD) = range(11)
PHASES = ("starting", "ready", "step", "sync", "eval", "save", "restore", "rendezvous", "finishing",
          "compile", "upload")
IO_PHASES = (SAVE, RESTORE, UPLOAD)  # where checkpoint bytes moving count as progress

_TRAINING = struct.Struct("<qdqq")  # step, time, phase, pid: the training thread's record
_IO = struct.Struct("<dq")  # time of the last checkpoint bytes moved, bytes moved so far
_HEARTBEAT_SIZE = _TRAINING.size + _IO.size


class Beat(NamedTuple):
    step: int
    t: float  # the training thread's last progress; 0.0 until its first beat
    phase: int
    pid: int
    io_t: float  # the checkpoint writer's (or restore's) last bytes moved; 0.0 if none yet
    io_bytes: int

    def progress_t(self) -> float:
        """The last sign of life that counts in this phase: in an I/O phase the training thread
        waits on the writer, so bytes moving are progress."""
        return max(self.t, self.io_t) if self.phase in IO_PHASES else self.t


def run_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / RUN_DIR


class EventLog:
    """Append-only JSON lines shared by every process of the job."""

    def __init__(self, directory: str | Path, *, rank: int = 0, source: str = "worker",
                 echo: bool = True) -> None:
        self.path = Path(directory) / "events.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.source, self.echo = rank, source, echo

    def emit(self, kind: str, *, durable: bool = False, **fields: Any) -> dict[str, Any]:
        """Record one event. durable: fsync before returning, for an event that must survive
        what comes next (a fault about to kill this process)."""
        event = {"t": fields.pop("t", time.time()), "kind": kind, "rank": self.rank,
                 "source": self.source, "pid": os.getpid(), **fields}
        line = (json.dumps(event, default=str, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if self.echo:
            details = " ".join(f"{k}={v}" for k, v in fields.items())
            log.info("[%s rank %d] %s %s", self.source, self.rank, kind, details)
        return event


def read_events(directory: str | Path) -> list[dict[str, Any]]:
    """Every complete event line (a line torn by a crash mid-write is skipped), in file order."""
    return list(_read_jsonl(Path(directory) / "events.jsonl"))


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    try:
        with open(path, "rb") as fh:
            for raw in fh:
                try:
                    yield json.loads(raw)
                except ValueError:
                    continue
    except FileNotFoundError:
        return


class StepLog:
    """Per-step timestamps of rank 0: the raw material of goodput. One buffered line per step
    (flushed per line, so a killed worker loses at most the step it was in)."""

    def __init__(self, directory: str | Path, *, rank: int = 0, attempt: int = 1) -> None:
        self.path = Path(directory) / f"steps.rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.attempt = attempt
        self._fh = open(self.path, "a", buffering=1)

    def record(self, step: int, batch: int, t0: float, t_data: float, t1: float) -> None:
        self._fh.write(f'{{"a":{self.attempt},"s":{step},"b":{batch},"t0":{t0:.6f},'
                       f'"td":{t_data:.6f},"t1":{t1:.6f}}}\n')

    def close(self) -> None:
        self._fh.close()


def read_steps(directory: str | Path, rank: int = 0) -> list[dict[str, Any]]:
    return list(_read_jsonl(Path(directory) / f"steps.rank{rank}.jsonl"))


class Heartbeat:
    """A worker's progress in 48 shared bytes: writing it is a memory store, no system call, so
    it costs nothing per step; the supervisor reads the same file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists() or self.path.stat().st_size != _HEARTBEAT_SIZE:
            reset_heartbeat(self.path)
        self._fd = os.open(self.path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, _HEARTBEAT_SIZE)
        self.step, self.pid = -1, os.getpid()
        self.io_bytes = 0

    def beat(self, step: int | None = None, phase: int = STEP) -> None:
        if step is not None:
            self.step = step
        _TRAINING.pack_into(self._map, 0, self.step, time.time(), phase, self.pid)

    def phase(self, phase: int) -> None:
        """Mark a change of phase without counting it as progress: the time stays the last
        progress time, so a worker stuck in a collective still looks stale."""
        step, t, _, _ = _TRAINING.unpack_from(self._map, 0)
        _TRAINING.pack_into(self._map, 0, step, t, phase, self.pid)

    def io_progress(self, nbytes: int) -> None:
        """nbytes more of a checkpoint written, uploaded or downloaded (any thread): slow but
        moving I/O is progress, only a stalled one runs out its phase's budget."""
        self.io_bytes += nbytes
        _IO.pack_into(self._map, _TRAINING.size, time.time(), self.io_bytes)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)


def reset_heartbeat(path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(_TRAINING.pack(-1, 0.0, STARTING, 0) + _IO.pack(0.0, 0))
    os.replace(tmp, path)


def read_heartbeat(path: str | Path) -> Beat:
    """Both records of a worker's heartbeat; times 0.0 until its first beat."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        data = b""
    if len(data) != _HEARTBEAT_SIZE:
        return Beat(-1, 0.0, STARTING, 0, 0.0, 0)
    return Beat(*_TRAINING.unpack_from(data, 0), *_IO.unpack_from(data, _TRAINING.size))


def duration(seconds: float) -> str:
    """H:MM:SS (days as `2d 03:04:05`), the clock format of the progress lines."""
    seconds = max(0, int(round(seconds)))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    text = f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{days}d {hours:02d}:{rest // 60:02d}:{rest % 60:02d}" if days else text


class Progress:
    """Share done, time elapsed and time left of `total` units of work (steps, phases, models).

    The rate is measured from this process's first unit: a resumed job counts only the work it
    does itself, so its ETA is not flattered by the steps a checkpoint already held."""

    def __init__(self, total: int, done: int = 0, *, clock=time.monotonic) -> None:
        self.total, self.start_done = max(1, int(total)), int(done)
        self.clock = clock
        self.t0 = clock()

    def line(self, done: int) -> str:
        elapsed = self.clock() - self.t0
        share = min(1.0, done / self.total)
        rate = (done - self.start_done) / elapsed if elapsed > 0 else 0.0
        if done >= self.total:
            eta = "0:00:00"
        elif rate > 0:
            eta = duration((self.total - done) / rate)
        else:
            eta = "?"
        return f"{share:.1%} | elapsed {duration(elapsed)} | eta {eta}"
