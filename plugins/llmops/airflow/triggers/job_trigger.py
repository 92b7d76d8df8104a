"""Waits for a job from the triggerer, so a deferred task holds no worker slot while it runs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from typing import Any, AsyncIterator, Awaitable

from airflow.triggers.base import BaseTrigger, TriggerEvent

from llmops.infra import tracking
from llmops.jobs import env_secrets
from llmops.jobs.alerts import JobAlerts, where_of
from llmops.jobs.backends import get_backend, shared
from llmops.jobs.errors import Backoff
from llmops.jobs.watch import JobWatch, call_with_retries, log_cursor_uri

# on_kill's calls (the task's state, the stop) get threads of their own: the loop's default
# executor can be full of polls (a cancelled trigger's poll runs on in its thread, and a
# throttled poll holds its thread through its retries), and Airflow bounds on_kill to 30 s.
_ON_KILL_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="llmops-on-kill")
STATE_TIMEOUT = 20.0   # s to ask Airflow for the task's state (the triggerer's supervisor answers)
# A running trigger asks this often whether its task still waits on it. A user's mark-failed
# does not always reach on_kill: seen in the fault matrix with the trigger polling and no
# "invoking on_kill" from the triggerer, the job left running to its max_run_seconds. One state
# read per job every 30 s, against polls every poll_interval.
TASK_CHECK_SECONDS = 30.0
# When on_kill cannot read the task's state in time, the triggerer asks again this often, this long.
FOLLOW_UP_EVERY = 10.0
FOLLOW_UP_SECONDS = 300.0
_FOLLOW_UPS: set[asyncio.Task] = set()   # held here: the loop keeps only weak references to tasks
ENDED = {"failed", "success", "skipped", "upstream_failed", "removed"}   # no try will take our event
_TASK_ENDED = object()


async def _or_task_end(work: Awaitable[Any], ended: asyncio.Future | None) -> Any:
    """`work`'s result, or _TASK_ENDED if `ended` (JobTrigger._until_task_ended) finished first.
    A poll given up on runs on to its end in its thread; its result is not used."""
    if ended is None:
        return await work
    job = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({job, ended}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:   # the triggerer cancelled this trigger: no sleep is left behind
        job.cancel()
        raise
    if job in done:
        return job.result()
    job.cancel()
    return _TASK_ENDED

# A checkpoint hands the log cursor back to the task, which defers again from it at once: a
# triggerer restart replays at most the lines since the last one. It costs the task a worker slot
# for a second (and each hand-over is a window in which Airflow's own state changes can race), so
# it is taken only for what nothing durable covers: the log cursor of a job whose handle has no
# place to save it beside its result (llmops.jobs.watch), and the start of a job whose backend
# does not report one. Then every CHECKPOINT_SECONDS while lines come in, or sooner once
# CHECKPOINT_LINES lines came in (but not more often than every MIN_CHECKPOINT_SECONDS).
CHECKPOINT_SECONDS = 600
CHECKPOINT_LINES = 2000
MIN_CHECKPOINT_SECONDS = 120


class JobTrigger(BaseTrigger):
    """Polls a backend until the job ends, streaming its log lines into the task log.

    Each poll is one `JobWatch.poll()` (llmops.jobs.watch), the same step the worker wait runs,
    its status read shared with every other trigger of this triggerer process where the service
    answers for many jobs in one call (one DescribeJobs for up to 100 Batch jobs, one list of the
    SageMaker jobs that changed, one Kubernetes list of a DAG run's HyperPod jobs and pods:
    llmops.jobs.backends.shared), at most a third of a poll interval old;
    transient API errors are retried with backoff, log errors skipped, and the deadline
    (`max_run_seconds + grace_seconds` from `started_at`) stops the job, as does a wait in the queue
    past `max_queue_seconds` from `submitted_at`; each change of the job's waiting state and
    reason is logged once (`waiting` carries the last one across checkpoints). `task_deadline` (epoch
    seconds) is the task's execution_timeout, which Airflow does not apply while a task is deferred:
    past it the job is stopped and the task fails with a timeout.

    Events (the first one ends the trigger): the job's final state (`succeeded`, `failed`,
    `stopped`), `timeout` (its deadline passed and it was stopped), `task_timeout`, `error` (its
    status cannot be read; the job is left running), and `progress`: a checkpoint carrying this
    trigger's kwargs with the current log cursor and start time, from which the task defers again.
    The first sight of the job's start is checkpointed at once, so a restarted trigger keeps the
    same deadline.

    Every TASK_CHECK_SECONDS it asks Airflow whether its task still waits on it, in one question
    per DAG for all the triggers of this triggerer (task_states_board), beside its polls: a poll
    held up by an outage (its read's retries, then a backoff of up to Backoff.cap) does not delay
    it.

    A user ending the task (mark failed or success) stops the job (`on_kill`). A clear does not:
    the next try reattaches to the running job (with `stop_on_clear`, set by force_rerun, it is
    stopped, since the next try starts a fresh one). Nor does a triggerer restart or shutdown:
    Airflow 3.3 calls `on_kill` only when the trigger is no longer wanted, and the trigger is
    resumed elsewhere from its serialized kwargs. When the task's state cannot be read the job
    keeps running: it is never stopped on a guess, and the triggerer asks again for
    FOLLOW_UP_SECONDS, past on_kill's own 30 s.
    """

    def __init__(self, handle: dict[str, Any], poll_interval: float = 30.0,
                 max_run_seconds: float | None = None, grace_seconds: float = 0.0,
                 started_at: float | None = None, log_cursor: Any = None,
                 task_deadline: float | None = None, context: dict[str, Any] | None = None,
                 deadline: float | None = None, stop_on_clear: bool = False,
                 max_queue_seconds: float | None = None, submitted_at: float | None = None,
                 waiting: str = ""):
        super().__init__()
        self.handle = handle
        self.context = context or {}  # handed back in the event: what the task resumes with
        self.poll_interval = poll_interval
        self.max_run_seconds = max_run_seconds
        self.grace_seconds = grace_seconds
        self.started_at = started_at
        self.log_cursor = log_cursor
        self.task_deadline = task_deadline
        self.stop_on_clear = stop_on_clear  # force_rerun: a clear means "start a fresh job"
        self.max_queue_seconds = max_queue_seconds
        self.submitted_at = submitted_at
        self.waiting = waiting
        # An absolute deadline from submission: only in triggers deferred by an older version.
        self.deadline = deadline

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("llmops.airflow.triggers.job_trigger.JobTrigger", self._kwargs())

    def _kwargs(self, **changes: Any) -> dict[str, Any]:
        kwargs = {"handle": self.handle, "poll_interval": self.poll_interval,
                  "max_run_seconds": self.max_run_seconds, "grace_seconds": self.grace_seconds,
                  "started_at": self.started_at, "log_cursor": self.log_cursor,
                  "task_deadline": self.task_deadline, "context": self.context,
                  "stop_on_clear": self.stop_on_clear, "max_queue_seconds": self.max_queue_seconds,
                  "submitted_at": self.submitted_at, "waiting": self.waiting}
        if self.deadline is not None:
            kwargs["deadline"] = self.deadline
        return {**kwargs, **changes}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        # A local job inherits the worker's environment; what it prints of it shows as ***.
        await env_secrets.amask_in_task_logs(os.environ)
        # Off the loop: the first trigger of a backend imports it (its provider hooks, seconds of
        # CPU on a busy triggerer), which would stall every other trigger's poll meanwhile.
        backend = await asyncio.to_thread(get_backend, self.handle["backend"])
        # Every trigger of this triggerer reads its job's status through one shared read where
        # the service answers for many jobs at once (llmops.jobs.backends.shared).
        backend.shared_max_age = shared.max_age_for(self.poll_interval)
        watch = JobWatch(backend, self.handle, poll_interval=self.poll_interval,
                         max_run_seconds=self.max_run_seconds, grace_seconds=self.grace_seconds,
                         log_cursor=self.log_cursor, started_at=self.started_at,
                         fixed_deadline=self.deadline if self.max_run_seconds is None else None,
                         max_queue_seconds=self.max_queue_seconds, submitted_at=self.submitted_at,
                         waiting=self.waiting,
                         # polled in a thread: the alerts' S3 and SNS calls stay off the loop
                         alerts=JobAlerts.from_settings(
                             self.handle, where_of(getattr(self, "task_instance", None))))
        checkpoint_at, lines_since = time.monotonic(), 0
        cursor_is_saved = bool(log_cursor_uri(self.handle))
        # Beside the polls, not between them: a poll waits out an outage's retries and then up to
        # poll_interval + Backoff.cap, and a user's mark-failed must not wait that long.
        ended = (asyncio.ensure_future(self._until_task_ended())
                 if getattr(self, "task_instance", None) is not None else None)
        try:
            while True:
                step = await _or_task_end(asyncio.to_thread(watch.poll), ended)
                if step is _TASK_ENDED:
                    break
                for warning in step.warnings:
                    self.log.warning("[%s] %s", self.handle["name"], warning)
                if step.waiting:
                    self.log.info("[%s] %s", self.handle["name"], step.waiting)
                    await asyncio.to_thread(self._mark_waiting, watch)
                for line in env_secrets.redact_lines(step.lines):
                    self.log.info("[%s] %s", self.handle["name"], line)
                if not cursor_is_saved:
                    lines_since += len(step.lines)
                if step.error:
                    yield self._event(watch, "error", step.error)
                    return
                if step.done:
                    state = "timeout" if step.stopped else step.status.state.value
                    yield self._event(watch, state, step.status.message)
                    return
                if self.task_deadline is not None and time.time() > self.task_deadline:
                    await self._stop_quietly()
                    yield self._event(watch, "task_timeout",
                                      f"the task's execution_timeout passed while it waited for job "
                                      f"{self.handle['name']}, which was stopped")
                    return
                since = time.monotonic() - checkpoint_at
                if step.start_from_poll or (lines_since and since >= CHECKPOINT_SECONDS) or (
                        lines_since >= CHECKPOINT_LINES and since >= MIN_CHECKPOINT_SECONDS):
                    yield self._event(watch, "progress", "checkpoint",
                                      trigger=self._kwargs(log_cursor=watch.log_cursor,
                                                           started_at=watch.started_at,
                                                           submitted_at=watch.submitted_at,
                                                           waiting=watch.waiting))
                    return
                if await _or_task_end(asyncio.sleep(step.delay), ended) is _TASK_ENDED:
                    break
            assert ended is not None
            state = ended.result()
            self.log.warning("The task is %s in Airflow, yet this trigger was not cancelled "
                             "(Airflow did not call on_kill).", state)
            await self._end_for_user(state)
            yield self._event(watch, "stopped", f"the task was set to {state}")
        finally:
            if ended is not None:
                ended.cancel()

    async def _until_task_ended(self) -> str:
        """The task's state once Airflow says a user ended it (asked every TASK_CHECK_SECONDS, in
        the triggerer's one question per DAG); until then it keeps asking."""
        while True:
            await asyncio.sleep(TASK_CHECK_SECONDS)
            known, state = await self._task_state(shared_read=True)
            if known and state in ENDED:
                return state

    def _mark_waiting(self, watch: JobWatch) -> None:
        """The job's wait in its service's queue (or its start after one) on its MLflow run,
        where the run page shows it while the task is deferred."""
        run_id = self.context.get("mlflow_run_id") or ""
        try:
            tracking.mark_waiting(run_id, watch.waiting, watch.submitted_at, watch.started_at)
        except Exception as exc:  # noqa: BLE001 - MLflow being down must not end the wait
            self.log.warning("Could not record the job's wait on MLflow run %s: %s", run_id, exc)

    def _event(self, watch: JobWatch, state: str, message: str, **extra: Any) -> TriggerEvent:
        return TriggerEvent({"state": state, "message": message, "handle": self.handle,
                             "log_cursor": watch.log_cursor, "started_at": watch.started_at,
                             "submitted_at": watch.submitted_at, **self.context, **extra})

    async def _stop(self) -> None:
        """Stop the job, retrying transient errors a few times (Airflow bounds on_kill to 30 s)."""
        backend = get_backend(self.handle["backend"])
        await asyncio.get_running_loop().run_in_executor(
            _ON_KILL_THREADS, lambda: call_with_retries(lambda: backend.stop(self.handle), "stop the job",
                                                        attempts=3, backoff=Backoff(base=0.5, cap=2.0),
                                                        logger=self.log))

    async def _stop_quietly(self) -> None:
        try:
            await self._stop()
        except Exception:  # noqa: BLE001 - the task fails with the timeout either way
            self.log.exception("Could not stop job %s: stop it by hand", self.handle["name"])

    async def on_kill(self) -> None:
        # Airflow 3.3 calls this only when the trigger is cancelled as no longer wanted, never on
        # a triggerer restart or shutdown. "No longer wanted" is also what a live triggerer sees
        # when its triggers were handed to another one (it missed heartbeats): the task is then
        # still deferred, and the job must keep running.
        known, state = await self._task_state()
        if not known:
            # Airflow calls on_kill only for a user's action (a clear, mark failed or success):
            # ask again after on_kill's 30 s, from a task of the triggerer's loop that outlives it.
            # Once, under a fault matrix's load, no answer came in time and a marked-failed task's
            # job ran on to its end.
            self.log.warning("Could not read the task's state in Airflow: job %s keeps running "
                             "while this triggerer asks again for %.0f s.", self.handle["name"],
                             FOLLOW_UP_SECONDS)
            follow_up = asyncio.get_running_loop().create_task(self._follow_up())
            _FOLLOW_UPS.add(follow_up)
            follow_up.add_done_callback(_FOLLOW_UPS.discard)
            return
        await self._act_on(state)

    async def _follow_up(self) -> None:
        """Ask the task's state every FOLLOW_UP_EVERY s for FOLLOW_UP_SECONDS; act on the first answer."""
        deadline = time.monotonic() + FOLLOW_UP_SECONDS
        while time.monotonic() < deadline:
            await asyncio.sleep(FOLLOW_UP_EVERY)
            known, state = await self._task_state()
            if known:
                try:
                    await self._act_on(state)
                except Exception:  # noqa: BLE001 - nothing awaits this task to see it raise
                    self.log.exception("Could not stop job %s: stop it by hand", self.handle["name"])
                return
        self.log.error("Airflow did not say the task's state for %.0f s: job %s was left running. "
                       "If a user ended the task, stop the job by hand.", FOLLOW_UP_SECONDS,
                       self.handle["name"])

    async def _act_on(self, state: str | None) -> None:
        """What a user's action on the task means for its job, from the task's state after it."""
        if state == "deferred":
            self.log.warning("The task is deferred in Airflow (this trigger moved to another "
                             "triggerer): job %s keeps running.", self.handle["name"])
            return
        # "running": a cancelled trigger's task is never running in its own try (a trigger that
        # fired is not cancelled), so a newer try runs: the task was cleared and picked up again
        # before Airflow answered (seen at 6.6 s under load), and that try reattaches.
        if state in ("restarting", "scheduled", "queued", "running", "up_for_retry", None) and not self.stop_on_clear:
            self.log.warning("The task was cleared (now %s): job %s keeps running and the next try "
                             "reattaches to it.", state, self.handle["name"])
            return
        await self._end_for_user(state)

    async def _end_for_user(self, state: str | None) -> None:
        """A user ended the task (mark failed or success): stop the job and record its end."""
        self.log.info("The task was ended by a user (now %s): stopping job %s",
                      state or "unknown", self.handle["name"])
        await self._stop()
        # No task resumes to record the end: the trigger does (llmops.infra.ledger never raises).
        job = self.context.get("ledger")
        if job:
            from llmops.infra import ledger
            from llmops.jobs.backends import JobState, JobStatus

            status = JobStatus(JobState.STOPPED, f"stopped: the task was set to {state or 'unknown'}")
            await asyncio.get_running_loop().run_in_executor(
                _ON_KILL_THREADS, lambda: ledger.record_job("ended", job,
                                                            **ledger.end_fields(status, self.started_at)))

    async def _task_state(self, shared_read: bool = False) -> tuple[bool, str | None]:
        """(True, the task instance's state in Airflow now), or (False, None) if it cannot be
        asked. `shared_read` (the periodic check): one question per DAG for every trigger of this
        triggerer that asks within TASK_CHECK_SECONDS / 3 (task_states_board); on_kill asks alone."""
        ti = getattr(self, "task_instance", None)
        if ti is None:
            return False, None
        try:
            from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

            started = time.monotonic()
            if shared_read:
                key = (ti.dag_id, ti.run_id, ti.task_id, ti.map_index)
                state = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                    _ON_KILL_THREADS, lambda: task_states_board().get(key, TASK_CHECK_SECONDS / 3)),
                    timeout=STATE_TIMEOUT)
                return True, getattr(state, "value", state)
            states = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                _ON_KILL_THREADS, lambda: RuntimeTaskInstance.get_task_states(
                    dag_id=ti.dag_id, task_ids=[ti.task_id], run_ids=[ti.run_id],
                    map_index=ti.map_index)), timeout=STATE_TIMEOUT)
            if time.monotonic() - started > 2:
                self.log.info("Airflow took %.1f s to say the task's state", time.monotonic() - started)
        except Exception as exc:  # noqa: BLE001 - unknown: a user's action is what Airflow says
            self.log.warning("Could not ask Airflow for the task's state (%s): %r", type(exc).__name__, exc)
            return False, None
        state = states.get(ti.run_id, {}).get(_state_key(ti.task_id, ti.map_index))
        return True, getattr(state, "value", state)


def _state_key(task_id: str, map_index: int) -> str:
    """How get_task_states names a task instance: its task id, `<task id>_<map index>` if mapped."""
    return task_id if map_index < 0 else f"{task_id}_{map_index}"


def task_states_board() -> shared.SharedReads:
    """The triggerer's one question per DAG for the states of every task instance its triggers
    ask about: get_task_states(dag_id, task_ids, run_ids) answers for all their runs and map
    indexes at once (a sweep's 100 trials: one call every TASK_CHECK_SECONDS / 3, not 100)."""
    def read(keys: list[tuple]) -> dict[tuple, Any]:
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

        found = {}
        for (dag_id,), members in shared.grouped(keys, 1).items():
            states = RuntimeTaskInstance.get_task_states(
                dag_id=dag_id, task_ids=sorted({k[2] for k in members}), run_ids=sorted({k[1] for k in members}))
            for key in members:
                _, run_id, task_id, map_index = key
                found[key] = (states.get(run_id) or {}).get(_state_key(task_id, map_index))
        return found

    return shared.board(("airflow-task-states",), lambda: shared.SharedReads(read, 10_000))
