"""One poll of a running job: the logic the worker wait and the trigger share.

`JobWatch.poll()` reads the job's new log lines and its status once and says what to do next:
show these lines and wait `delay` seconds, or stop waiting (the job ended, or it ran past its
deadline and was stopped), or fail the wait without touching the job. The worker calls it in a
loop with `time.sleep`; the trigger runs the same call in a thread between `asyncio.sleep`s.

Rules it implements, so both places keep them alike:

- a log read never fails the wait: its error is logged and skipped, the cursor kept;
- a transient status error (throttling, 5xx, a dropped connection) is retried for as long as the
  job may be running, waiting the poll interval plus an exponential, jittered backoff;
- any other status error fails the wait but leaves the job running: the next try reattaches;
- the log cursor is saved beside the job's result (`log-cursor.json` next to `result_uri`, on S3
  or local disk) *before* the lines it covers are shown, and a new watch starts from the saved one:
  a triggerer killed at any moment, a worker lost, or a retry that reattaches shows no line twice.
  (A kill between the save and the log write loses those lines from the task log only; they stay
  in the job's own log, CloudWatch or output.log.)
- the deadline is `max_run_seconds + grace` counted from when the job *started running*, so time
  spent queued for capacity does not eat into the run. Backends report the start as
  `JobStatus.details["started_at"]` (epoch seconds); for one that does not, the first poll that
  sees the job RUNNING stands in. The service enforces the job's own limit; Airflow's deadline is
  the safety net for a service that does not, hence the grace.
- waiting is visible: each change of a queued job's state and the service's reason (Batch
  `RUNNABLE CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY ...`, SageMaker `Starting` and its capacity
  StatusMessage, Kueue's Suspended message) is reported once as `Step.waiting`, with the time
  queued so far; the worker wait and the trigger log it. `waiting` (the last reported state and
  reason) travels with a trigger's checkpoints, so a triggerer restart repeats at most one line.
  A wait that does not change is said again every WAITING_REPEAT_SECONDS ("still waiting: ...",
  with the time queued by then), so a task log that waits for hours shows it still does.
- a job's end is reported after one more log read, `min(poll interval, backend.log_lag_seconds)`
  later, when its backend's log service delivers lines late (CloudWatch: seconds after Describe*
  says the job ended); the task log then ends with the job's own last lines, and the failure
  message's log tail (read after the wait) has them too.
- log reads cost what a queued job cannot repay: a job last seen waiting to start (PENDING) has
  no container and no new lines, so its log is not read until it runs (or ends). Each read takes
  a token from the backend's budget for the process (`Backend.log_budget`: CloudWatch's
  account-wide rates, shared by every trigger of a triggerer); without one the read is skipped
  and its lines come with a later read, from the cursor; the read after a job's end waits for one.
- waiting is bounded: with `max_queue_seconds` (None or 0: no bound), a job that has not started
  that long after its submission (`JobStatus.details["submitted_at"]`, else the time the caller
  recorded, else this watch's first poll) is stopped and the wait ends with the service's last
  waiting reason and the limit. Only the first start counts: a job that ran and is queued again
  (a spot interruption, a Batch retry) is under the run deadline instead.
- alerts: `alerts(step, watch)` (llmops.jobs.alerts) sees every step after its lines are
  counted as shown, in the poll's own thread; its failure is a warning, never the wait's.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from llmops.jobs.backends.base import Backend, JobState, JobStatus
from llmops.jobs.errors import Backoff, is_transient

log = logging.getLogger(__name__)
WAITING_REPEAT_SECONDS = 15 * 60   # an unchanged wait is said again this often


@dataclass
class Step:
    lines: list[str] = field(default_factory=list)  # new log lines, to show now
    delay: float = 0.0                  # wait this long before the next poll (when not done)
    status: JobStatus | None = None     # set when done: the job's final status
    error: str = ""                     # set when the wait must fail (the job is left running)
    warnings: list[str] = field(default_factory=list)  # retried or skipped errors, to log
    started: bool = False               # started_at became known (or changed) in this poll
    start_from_poll: bool = False       # ... and only this watch knows it (the backend reports none)
    stopped: bool = False               # this watch stopped the job (its deadline passed)
    waiting: str = ""                   # the job's waiting state changed (or still holds): say so

    @property
    def done(self) -> bool:
        return self.status is not None


class JobWatch:
    def __init__(self, backend: Backend, handle: dict[str, Any], *, poll_interval: float,
                 max_run_seconds: float | None, grace_seconds: float = 0.0,
                 log_cursor: Any = None, started_at: float | None = None,
                 fixed_deadline: float | None = None, backoff: Backoff | None = None,
                 clock: Callable[[], float] | None = None, max_queue_seconds: float | None = None,
                 submitted_at: float | None = None, waiting: str = "",
                 alerts: Callable[[Step, "JobWatch"], None] | None = None):
        self.backend = backend
        self.handle = handle
        self.poll_interval = poll_interval
        self.max_run_seconds = max_run_seconds
        self.grace_seconds = grace_seconds
        self.log_cursor = log_cursor
        self.started_at = started_at
        self.fixed_deadline = fixed_deadline  # a trigger deferred by an older version of this code
        self.backoff = backoff or Backoff()
        self.clock = clock or (lambda: time.time())  # looked up at call time (tests patch it)
        self.max_queue_seconds = max_queue_seconds or None
        self.submitted_at = submitted_at
        self.waiting = waiting  # the waiting state and reason last reported ("" = none yet)
        self.alerts = alerts    # called with each step (llmops.jobs.alerts.JobAlerts)
        self._waiting_said_at: float | None = None   # when this watch last said it
        self._stop_message = ""
        self._stopping = False
        self._cursor_loaded = False
        self._ended: JobStatus | None = None   # the job's end, held for one more log read
        self._state: JobState | None = None    # the job's state at the last poll that read it

    @property
    def deadline(self) -> float | None:
        """When the job is stopped; None while it is queued (not started) and has no deadline."""
        if self.fixed_deadline is not None:
            return self.fixed_deadline
        if self.started_at is None or self.max_run_seconds is None:
            return None
        return self.started_at + self.max_run_seconds + self.grace_seconds

    def poll(self) -> Step:
        step = self._poll()
        if step.lines:
            # Saved as the last thing before the caller shows the lines: a watcher killed at any
            # other moment (in a status call, a backoff, a sleep) shows none of them twice.
            try:
                save_log_cursor(self.handle, self.log_cursor)
            except Exception as exc:  # noqa: BLE001 - a restart may then repeat these lines
                step.warnings.append(f"could not save the log cursor: {_describe(exc)}")
        if self.alerts is not None:
            try:
                self.alerts(step, self)
            except Exception as exc:  # noqa: BLE001 - an alert never fails the wait
                step.warnings.append(f"could not send an alert: {_describe(exc)}")
        return step

    def _poll(self) -> Step:
        step = Step()
        if self._ended is not None:   # the read of the lines that arrived after the job's end
            self._read_logs(step, final=True)
            step.status = self._ended
            return step
        if self._stopping:  # an earlier stop at the deadline hit a transient error: try again
            return self._stop(step)
        # No container runs while the job waits to start: its log is read again once it runs.
        if self._state is not JobState.PENDING:
            self._read_logs(step)
        try:
            status = self.backend.status(self.handle)
        except Exception as exc:  # noqa: BLE001 - sorted into transient or not right here
            return self._status_error(step, exc)
        self.backoff.reset()
        self._state = status.state
        self._note_start(step, status)
        self._note_waiting(step, status)
        if status.state.terminal:
            lag = min(self.poll_interval, float(getattr(self.backend, "log_lag_seconds", 0.0)))
            if lag > 0:
                # Its log service delivers the last lines seconds after the job's status says it
                # ended (CloudWatch): one read a little later, then the end.
                self._ended = status
                step.delay = lag
                return step
            self._read_logs(step, final=True)  # the last lines the job wrote before it ended
            step.status = status
            return step
        deadline = self.deadline
        if deadline is not None and self.clock() > deadline:
            self._stopping = True
            return self._stop(step)
        if self._queued_too_long(status):
            self._stopping = True
            return self._stop(step)
        step.delay = self.poll_interval
        return step

    # -- the pieces ------------------------------------------------------------------------------
    def _read_logs(self, step: Step, final: bool = False) -> None:
        """The job's new lines into `step`. Within the backend's budget of log reads for the
        process (CloudWatch's account-wide rates, llmops.jobs.backends.shared.RateBudget): a
        poll without a token skips its read (the lines come with a later one, from the cursor);
        the read after the job's end waits for one."""
        budget_of = getattr(self.backend, "log_budget", None)   # a backend of any shape (tests')
        budget = budget_of(self.handle) if budget_of else None
        if budget is not None and not budget.take(wait=final):
            return
        try:
            if not self._cursor_loaded:
                # Newer than the cursor this watch was given whenever the last watcher died
                # between two checkpoints: resume where it stopped, not where it was deferred.
                saved = load_log_cursor(self.handle)
                if saved is not None:
                    self.log_cursor = saved
                self._cursor_loaded = True
            lines, self.log_cursor = self.backend.read_logs(self.handle, self.log_cursor)
        except Exception as exc:  # noqa: BLE001 - logs are a courtesy; the status decides
            step.warnings.append(f"could not read the job's log, will try again: {_describe(exc)}")
            return
        step.lines.extend(lines)

    def _status_error(self, step: Step, exc: Exception) -> Step:
        if is_transient(exc):
            deadline = self.deadline
            if deadline is not None and self.clock() > deadline:
                self._stopping = True  # the deadline holds even while the status cannot be read
                return self._stop(step)
            step.delay = self.poll_interval + self.backoff.next_delay()
            step.warnings.append(f"could not read the job's status (attempt {self.backoff.attempt}), "
                                 f"retrying in {step.delay:.0f}s: {_describe(exc)}")
            return step
        step.error = (f"could not read the status of job {self.handle.get('name')}: "
                      f"{_describe(exc)}. The job was not stopped; a retry of this task "
                      f"reattaches to it")
        return step

    def _note_start(self, step: Step, status: JobStatus) -> None:
        reported = status.details.get("started_at")
        if reported is not None:
            if self.started_at != float(reported):
                self.started_at = float(reported)
                step.started = True
        elif self.started_at is None and status.state is JobState.RUNNING:
            self.started_at = self.clock()
            step.started = step.start_from_poll = True

    def queued_seconds(self) -> float:
        return max(0.0, self.clock() - self.submitted_at) if self.submitted_at is not None else 0.0

    def _note_waiting(self, step: Step, status: JobStatus) -> None:
        reported = status.details.get("submitted_at")
        if reported is not None:
            self.submitted_at = float(reported)
        elif self.submitted_at is None:
            self.submitted_at = self.clock()
        if status.state is JobState.PENDING:
            now = status.message or "pending"
            # Queue time counts until the first start; later waits (a spot interruption,
            # a Batch retry) are the run's.
            when = (f"queued {duration(self.queued_seconds())}" if self.started_at is None
                    else "after it had started")
            if now != self.waiting:
                self.waiting, self._waiting_said_at = now, self.clock()
                step.waiting = f"waiting: {now} ({when})"
            elif self._waiting_said_at is None:   # said before this watch (a triggerer restart)
                self._waiting_said_at = self.clock()
            elif self.clock() - self._waiting_said_at >= WAITING_REPEAT_SECONDS:
                self._waiting_said_at = self.clock()
                step.waiting = f"still waiting: {now} ({when})"
        elif status.state is JobState.RUNNING and self.waiting:
            self.waiting = ""
            step.waiting = "running"

    def _queued_too_long(self, status: JobStatus) -> bool:
        if (self.max_queue_seconds is None or self.started_at is not None
                or status.state is not JobState.PENDING or self.queued_seconds() <= self.max_queue_seconds):
            return False
        self._stop_message = queue_limit_message(self.max_queue_seconds, self.queued_seconds(),
                                                 status.message)
        return True

    def _stop(self, step: Step) -> Step:
        try:
            self.backend.stop(self.handle)
        except Exception as exc:  # noqa: BLE001
            if not is_transient(exc):
                step.error = (f"job {self.handle.get('name')} ran past its deadline and could not "
                              f"be stopped: {_describe(exc)}. Stop it by hand")
                return step
            step.delay = self.poll_interval + self.backoff.next_delay()
            step.warnings.append(f"could not stop the job at its deadline, retrying in "
                                 f"{step.delay:.0f}s: {_describe(exc)}")
            return step
        self._stopping = False
        step.stopped = True
        step.status = JobStatus(JobState.STOPPED, self._stop_message or deadline_message(
            self.max_run_seconds, self.grace_seconds, self.fixed_deadline is not None))
        return step


# -- the durable log cursor ---------------------------------------------------------------------

LOG_CURSOR_FILE = "log-cursor.json"


def log_cursor_uri(handle: dict[str, Any]) -> str:
    """Where this job's log cursor is kept: beside its result (every backend's handle has one),
    so it lives as long as the job's own records and needs no Airflow database."""
    return beside_result_uri(handle, LOG_CURSOR_FILE)


def beside_result_uri(handle: dict[str, Any], name: str) -> str:
    """The file `name` beside the job's result (local or s3://); "" when there is no such place."""
    result = str(handle.get("result_uri") or "")
    if not result or ("://" in result and not result.startswith("s3://")):
        return ""
    return result.rsplit("/", 1)[0] + "/" + name


def load_log_cursor(handle: dict[str, Any]) -> Any:
    return (read_beside_result(handle, LOG_CURSOR_FILE) or {}).get("cursor")


def save_log_cursor(handle: dict[str, Any], cursor: Any) -> None:
    write_beside_result(handle, LOG_CURSOR_FILE, {
        "job_name": handle.get("job_name") or handle.get("name"), "cursor": cursor,
        "saved_at": time.time()})


def read_beside_result(handle: dict[str, Any], name: str) -> Any:
    """The JSON file `name` beside the job's result; None when it (or the place) does not exist."""
    uri = beside_result_uri(handle, name)
    if not uri:
        return None
    if uri.startswith("s3://"):
        from llmops.infra.aws import s3

        return s3.read_json(s3.s3_hook(handle.get("aws_conn_id") or None,
                                       handle.get("region_name") or None), uri)
    try:
        with open(uri) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None


def write_beside_result(handle: dict[str, Any], name: str, data: Any) -> None:
    """Write the JSON file `name` beside the job's result (no place: nothing is written)."""
    uri = beside_result_uri(handle, name)
    if not uri:
        return
    if uri.startswith("s3://"):
        from llmops.infra.aws import s3

        s3.write_json(s3.s3_hook(handle.get("aws_conn_id") or None,
                                 handle.get("region_name") or None), uri, data)
        return
    os.makedirs(os.path.dirname(uri), exist_ok=True)
    tmp = f"{uri}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, default=str)
    os.replace(tmp, uri)


def deadline_message(max_run_seconds: float | None, grace_seconds: float, legacy: bool = False) -> str:
    if legacy or max_run_seconds is None:
        return "the job ran past its max_run_seconds and was stopped"
    return (f"the job ran past its max_run_seconds ({max_run_seconds:.0f}s) plus a grace of "
            f"{grace_seconds:.0f}s since it started, and was stopped")


def queue_limit_message(max_queue_seconds: float, queued: float, reason: str) -> str:
    return (f"the job waited {duration(queued)} without starting, past its max_queue_seconds "
            f"({max_queue_seconds:.0f}s), and was stopped; the service's last word: "
            f"{reason or 'pending'}")


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def call_with_retries(fn: Callable[[], Any], what: str, *, sleep: Callable[[float], None] | None = None,
                      attempts: int | None = None, poll_interval: float = 0.0,
                      backoff: Backoff | None = None, logger: Any = log) -> Any:
    """`fn()`, retrying transient errors with the same backoff as a poll (forever by default)."""
    backoff = backoff or Backoff()
    tried = 0
    while True:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            tried += 1
            if not is_transient(exc) or (attempts is not None and tried >= attempts):
                raise
            delay = poll_interval + backoff.next_delay()
            logger.warning("Could not %s (attempt %d), retrying in %.0fs: %s",
                           what, tried, delay, _describe(exc))
            (sleep or time.sleep)(delay)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
