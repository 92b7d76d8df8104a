"""Alerts from inside a running job, out of what each poll of its watch already sees.

`JobAlerts` is handed to a `JobWatch` (llmops.jobs.watch) by the worker wait and by the trigger;
the watch calls it with every step, in the poll's own thread (the trigger runs polls off the
event loop, so the SNS call is too). It sends (llmops.infra.notify) one alert per job per kind:

  rollback   the loss guard rolled the job back (the job's log line
             `[worker rank 0] rollback from_step=N to_step=M anomaly=spike ...`, tasks/train/loop.py)
  stalled    the hang watchdog saw no progress from a worker (`[supervisor rank R] no progress
             from worker ...` or its `hang` event, tasks/train/supervisor.py)
  capacity   the job is still queued, not yet started, `[llmops] notify_queue_seconds` after its
             submission (the watch's waiting state and reason)
  plateau    the validation loss made no new best (by more than PLATEAU_MIN_GAIN of it) for
             `[llmops] notify_plateau_evals` evaluations in a row (the evaluation's log line
             `step N/M | val_loss L | ...`, tasks/train/loop.py). The count lives in the watch: a
             new watch (the log cursor resumes past the lines it saw) starts it again, which can
             delay this alert but never repeat it.

No storm: a kind is sent at most once per job. What was sent is kept in memory for the watch and
in `alerts.json` beside the job's result (where the log cursor lives), written *before* the alert
is sent, so a new watch (a checkpoint, a triggerer restart, a retry that reattaches) reads it and
does not send that kind again; a watcher killed between the write and the send loses that one
alert rather than repeating it. A job whose handle has no such place dedupes per watch only.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Callable

from llmops.infra import notify
from llmops.jobs.watch import Step, duration, read_beside_result, write_beside_result

log = logging.getLogger(__name__)
ALERTS_FILE = "alerts.json"
ROLLBACK = re.compile(r"\] rollback from_step=(?P<from_step>\d+) to_step=(?P<to_step>\d+) "
                      r"anomaly=(?P<anomaly>\S+)")
STALLED = re.compile(r"\] no progress from worker \d+ for (?P<stale>[\d.]+)s \(step (?P<step>\d+), "
                     r"(?P<phase>[^,]+),|\] hang attempt=\S+ step=(?P<hang_step>\d+) phase=(?P<hang_phase>\S+)")
EVAL = re.compile(r"\bstep (?P<step>\d+)/\d+ \|(?:.*? \|)? val_loss (?P<loss>[^\s|]+)")
PLATEAU_MIN_GAIN = 1e-3   # a new best must beat the old one by 0.1% of it
ANOMALY_WORDS = {"spike": "a loss spike", "nan": "a NaN loss"}


class JobAlerts:
    def __init__(self, handle: dict[str, Any], where: dict[str, Any] | None = None, *,
                 queue_seconds: float | None = None, plateau_evals: int | None = None,
                 sender: Callable[[str, str], bool] | None = None):
        self.handle = handle
        self.where = where or {}   # dag_id, run_id, task_id, map_index of the task that waits
        self.queue_seconds = queue_seconds
        self.plateau_evals = plateau_evals
        self.best: tuple[float, int] | None = None   # (lowest val_loss, its step)
        self.evals_since_best = 0
        self.sender = sender or (lambda subject, message: notify.send(subject, message))
        self.sent: set[str] = set()
        self._loaded = False

    @classmethod
    def from_settings(cls, handle: dict[str, Any], where: dict[str, Any] | None = None) -> "JobAlerts | None":
        """The alerts the deployment asks for; None when no alert goes anywhere."""
        if not notify.configured():
            return None
        return cls(handle, where, queue_seconds=_or_off(notify.queue_seconds, "capacity-wait"),
                   plateau_evals=_or_off(notify.plateau_evals, "loss plateau"))

    def __call__(self, step: Step, watch: Any) -> None:
        for kind, what in self.events(step, watch):
            self.alert(kind, what)

    def events(self, step: Step, watch: Any) -> list[tuple[str, str]]:
        """(kind, what happened) for each alert this step calls for, sent or not."""
        found = []
        for line in step.lines:
            m = ROLLBACK.search(line)
            if m:
                found.append(("rollback", (
                    f"rolled back from step {m['from_step']} to step {m['to_step']} after "
                    f"{ANOMALY_WORDS.get(m['anomaly'], m['anomaly'])}")))
            m = STALLED.search(line)
            if m:
                if m["stale"]:
                    what = (f"stalled: no progress from a worker for {float(m['stale']):.0f} s "
                            f"(step {m['step']}, {m['phase']})")
                else:
                    what = f"stalled: the watchdog killed a hung worker (step {m['hang_step']}, {m['hang_phase']})"
                found.append(("stalled", what))
            m = EVAL.search(line)
            if m and self.plateau_evals:
                plateau = self._evaluated(int(m["step"]), m["loss"])
                if plateau:
                    found.append(("plateau", plateau))
        if (self.queue_seconds and watch.started_at is None and watch.waiting
                and watch.submitted_at is not None and watch.queued_seconds() >= self.queue_seconds):
            found.append(("capacity", f"still waiting for capacity after "
                                      f"{duration(watch.queued_seconds())}: {watch.waiting}"))
        return found

    def _evaluated(self, step: int, text: str) -> str:
        """Count one evaluation; what to say when it makes the plateau, else ""."""
        try:
            loss = float(text)
        except ValueError:
            return ""
        if loss != loss and self.best is None:   # a NaN before any loss: nothing to compare
            return ""
        if self.best is None or loss < self.best[0] - PLATEAU_MIN_GAIN * abs(self.best[0]):
            self.best, self.evals_since_best = (loss, step), 0
            return ""
        self.evals_since_best += 1   # a NaN never beats the best: it counts here too
        if self.evals_since_best < self.plateau_evals:
            return ""
        return (f"stopped improving: val_loss {self.best[0]:.4f} at step {self.best[1]} is still "
                f"the best after {self.evals_since_best} more evaluations (now {loss:.4f} at "
                f"step {step})")

    def alert(self, kind: str, what: str) -> bool:
        """Send `kind` unless it was sent for this job before; True when sent now."""
        self._load()
        if kind in self.sent:
            return False
        self.sent.add(kind)
        try:
            write_beside_result(self.handle, ALERTS_FILE, {
                "job_name": self.handle.get("name"), "sent": sorted(self.sent), "saved_at": time.time()})
        except Exception as exc:  # noqa: BLE001 - then a new watch may send it again
            log.warning("Could not record the %s alert beside the job's result: %s", kind, exc)
        subject, message = self.message(kind, what)
        return self.sender(subject, message)

    def message(self, kind: str, what: str) -> tuple[str, str]:
        name = self.handle.get("name", "?")
        w = self.where
        task = w.get("task_id") or "?"
        if w.get("map_index") is not None and int(w["map_index"]) >= 0:
            task = f"{task}[{w['map_index']}]"
        lines = [f"Job {name} {what}."]
        if w.get("dag_id"):
            lines.append(f"Task {task} in DAG {w['dag_id']}, run {w.get('run_id', '?')}.")
            lines.append(f"Run page: {notify.run_url(w['dag_id'], w.get('run_id', ''))}")
        lines.append(f"The job goes on; this is sent once per job ({kind}).")
        head = f"{w['dag_id']} {task}" if w.get("dag_id") else name
        return f"[llmops] {head}: {kind}", "\n".join(lines)

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        try:
            saved = read_beside_result(self.handle, ALERTS_FILE) or {}
        except Exception as exc:  # noqa: BLE001 - unknown: this watch's memory only
            log.warning("Could not read the job's sent alerts: %s", exc)
            return
        self.sent |= set(saved.get("sent") or [])


def _or_off(setting: Callable[[], Any], alert: str) -> Any:
    try:
        return setting()
    except notify.NotifySettingsError as exc:
        log.warning("The %s alert is off: %s", alert, exc)
        return None


def where_of(ti: Any) -> dict[str, Any]:
    """The task instance's identity, for the alert's text."""
    if ti is None:
        return {}
    return {k: getattr(ti, k, None) for k in ("dag_id", "run_id", "task_id", "map_index")}
