"""Fault injection, a first-class testing feature: make a training job fail on purpose, the same
way every time, to prove it recovers.

    python -m tasks.pretrain --config C --result R --faults kill@120,hang@300,spike@450,nan@600,corrupt_ckpt@200
    LLMOPS_FAULTS=kill@120:1 torchrun ... -m tasks.pretrain ...          (":1" = on rank 1 only)

Each fault `kind@N[:rank]` fires once per job, on the given rank (default 0), the first time
optimizer step N runs there (steps count from 1, as in the logs and checkpoint names):

    kill          the worker SIGKILLs itself in the middle of step N (a crash: no cleanup at all)
    hang          the worker stops making progress in step N (sleeps forever, as a stuck
                  collective or a deadlocked data loader would)
    spike         step N's loss is multiplied by 100, as a garbage batch would do to it;
                  `spike@N*F` multiplies it by F instead (spike@450*5: a spike of x5)
    nan           step N's loss becomes NaN
    corrupt_ckpt  the first checkpoint saved at step >= N is damaged on disk after it commits
                  (one byte of its weights flipped), so a later resume must skip it
    slow_save     the first checkpoint saved at step >= N stalls for D seconds before its first
                  byte is written (`slow_save@N+Ds`, default 30 s), as a stuck disk or a
                  throttled S3 would: the save must not trip the watchdog within its budget
    slow_restore  the first restore of a checkpoint of step >= N stalls for D seconds before
                  loading it (`slow_restore@N+Ds`, default 30 s)
    slow_rank     from step N on, every step of the rank sleeps D seconds before its forward
                  pass (`slow_rank@N+0.2s:1`), as a degraded node would: a straggler
    flip_bit      after step N's update, one bit of one of the rank's parameters flips, as a
                  device with silent data corruption would (tasks/train/health.py)
    bad_burnin    the rank's burn-in matmul returns a wrong element (`bad_burnin@1:1`; N unused)

"Once per job": a fault is recorded in events.jsonl (fsynced) before it acts, and a restarted
worker reads which faults already fired, so the replayed step N does not fail again.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.train.telemetry import EventLog, read_events

log = logging.getLogger(__name__)

ENV = "LLMOPS_FAULTS"
KINDS = ("kill", "hang", "spike", "nan", "corrupt_ckpt", "slow_save", "slow_restore", "slow_rank",
         "flip_bit", "bad_burnin")
SLOW_KINDS = ("slow_save", "slow_restore", "slow_rank")  # the ones that take a duration, kind@N+Ds
SLOW_S = 30.0
SPIKE_FACTOR = 100.0
_FAULT = re.compile(r"^(?P<kind>[a-z_]+)@(?P<step>\d+)(?:\*(?P<factor>\d+(?:\.\d*)?))?"
                    r"(?:\+(?P<seconds>\d+(?:\.\d*)?)s)?(?::(?P<rank>\d+))?$")


class FaultSpecError(ValueError):
    """The fault spec does not parse; the message shows the expected form."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0
    factor: float = SPIKE_FACTOR  # spike only: what the loss is multiplied by
    seconds: float = SLOW_S  # slow_save and slow_restore only: how long the I/O stalls

    @property
    def id(self) -> str:
        return f"{self.kind}@{self.step}:{self.rank}"


def parse_faults(spec: str) -> list[Fault]:
    """'kill@120,hang@300:1' -> [Fault('kill', 120, 0), Fault('hang', 300, 1)]."""
    faults = []
    for item in (s.strip() for s in (spec or "").split(",")):
        if not item:
            continue
        m = _FAULT.match(item)
        if not m or m["kind"] not in KINDS:
            raise FaultSpecError(f"Bad fault {item!r}: write kind@step[:rank] with kind one of "
                                 f"{list(KINDS)}, e.g. 'kill@120,hang@300:1,spike@450'.")
        if int(m["step"]) < 1:
            raise FaultSpecError(f"Bad fault {item!r}: write kind@step[:rank] with step >= 1 "
                                 "(steps count from 1, as in the logs).")
        if m["factor"] is not None and (m["kind"] != "spike" or float(m["factor"]) <= 1):
            raise FaultSpecError(f"Bad fault {item!r}: only spike takes a size, as spike@step*F "
                                 "with F > 1 (the loss multiplier), e.g. 'spike@450*5'.")
        if m["seconds"] is not None and m["kind"] not in SLOW_KINDS:
            raise FaultSpecError(f"Bad fault {item!r}: only {list(SLOW_KINDS)} take a duration, "
                                 "as kind@step+Ds, e.g. 'slow_save@50+600s'.")
        faults.append(Fault(m["kind"], int(m["step"]), int(m["rank"] or 0),
                            float(m["factor"] or SPIKE_FACTOR), float(m["seconds"] or SLOW_S)))
    return faults


class FaultInjector:
    """The faults of one rank, fired once each. All hooks are cheap no-ops without faults."""

    def __init__(self, faults: list[Fault], rank: int, events: EventLog | None) -> None:
        self.events = events
        fired = set()
        if events is not None:
            fired = {e.get("fault") for e in read_events(events.path.parent)
                     if e.get("kind") == "fault_injected"}
        self.pending = {f.id: f for f in faults if f.rank == rank and f.id not in fired}
        self._by_step = {(f.kind, f.step): f for f in self.pending.values()}
        # a slow_rank that fired before a restart still slows this worker down
        self._slow_rank: Fault | None = next(
            (f for f in faults if f.kind == "slow_rank" and f.rank == rank and f.id in fired), None)

    @classmethod
    def from_env(cls, rank: int, events: EventLog | None, spec: str | None = None) -> "FaultInjector":
        return cls(parse_faults(spec if spec is not None else os.environ.get(ENV, "")), rank, events)

    def __bool__(self) -> bool:
        return bool(self.pending) or self._slow_rank is not None

    def _take(self, kind: str, step: int) -> Fault | None:
        fault = self._by_step.get((kind, step))
        if fault is None or fault.id not in self.pending:
            return None
        del self.pending[fault.id]
        if self.events is not None:
            # durable: the record must outlive the kill that follows, or the retry would fire it
            # again and never get past step N
            self.events.emit("fault_injected", durable=True, fault=fault.id, fault_kind=kind,
                             step=step)
        return fault

    def before_compute(self, step: int) -> None:
        """Called once the step's batch is ready, before its forward pass."""
        if not self._by_step and self._slow_rank is None:
            return
        slow = self._slow_rank
        if slow is None:
            slow = self._slow_rank = self._take_due("slow_rank", step) or None
        if slow:  # not once: a degraded node stays slow
            time.sleep(slow.seconds)
        if self._take("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._take("hang", step):
            _hang_forever()

    def scale_loss(self, step: int, loss: Any) -> Any:
        if not self._by_step:
            return loss
        spike = self._take("spike", step)
        if spike:
            return loss * spike.factor
        if self._take("nan", step):
            return loss * float("nan")
        return loss

    def after_update(self, step: int, params: list[Any]) -> None:
        """Called after step's optimizer update."""
        if self._by_step and self._take("flip_bit", step):
            from tasks.train.health import flip_bit

            log.warning("fault injection: flipped %s", flip_bit(params))

    def corrupt_burn_in(self) -> bool:
        """Whether this rank's burn-in result is made wrong."""
        due = [f for f in list(self.pending.values()) if f.kind == "bad_burnin"]
        return bool(due) and self._take("bad_burnin", due[0].step) is not None

    def after_checkpoint(self, step: int, path: Path) -> None:
        """Called when checkpoint `step` is committed (and uploaded, when mirrored)."""
        if not self._take_due("corrupt_ckpt", step):
            return
        victim = path / "model.pt"
        with open(victim, "r+b") as fh:
            fh.seek(victim.stat().st_size // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0xFF]))
        log.warning("fault injection: flipped a byte of %s", victim)


    def before_checkpoint_write(self, step: int) -> None:
        """Called on the checkpoint writer's thread before checkpoint `step` is written."""
        self._stall("slow_save", step)

    def before_restore(self, step: int) -> None:
        """Called before the checkpoint of `step` is loaded."""
        self._stall("slow_restore", step)

    def _stall(self, kind: str, step: int) -> None:
        fault = self._take_due(kind, step)
        if fault:
            log.warning("fault injection: %s of step %d stalls for %.1fs", kind, step,
                        fault.seconds)
            time.sleep(fault.seconds)

    def _take_due(self, kind: str, step: int) -> Fault | None:
        """The pending fault of `kind` that fires at the first checkpoint of step >= its own."""
        # list() first: this runs on the checkpoint writer's thread while the training thread
        # may remove other fired faults from the dict
        due = [f for f in list(self.pending.values()) if f.kind == kind and step >= f.step]
        return self._take(kind, due[0].step) if due else None


def _hang_forever() -> None:
    log.warning("fault injection: hanging (no more progress from this worker)")
    while True:  # the watchdog's stack dump will show this frame
        time.sleep(3600)
