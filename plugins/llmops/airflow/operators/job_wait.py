"""Waiting for a job on the worker, and the task state store (JobOperator's wait side).

JobWait is mixed into llmops.airflow.operators.job_operator.JobOperator: how often to poll, the
deadline's grace, whether to defer, the worker-side wait loop, stopping the job, and asking Airflow
for the task's state from the SIGTERM handler. The job's handle is kept in Airflow's task state
store (best effort: the deterministic job name is the fallback).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from airflow.sdk import conf
from airflow.sdk.exceptions import AirflowException

from llmops.jobs import continuation, env_secrets
from llmops.jobs.backends import Backend, JobState, JobStatus
from llmops.jobs.errors import Backoff
from llmops.jobs.spec import JobSpec
from llmops.jobs.watch import JobWatch, Step, call_with_retries

# Backends whose jobs run on the worker itself: waited for there, and stopped with the task.
WORKER_BACKENDS = frozenset({"local"})
# Airflow's deadline = max_run_seconds + this, from the job's start (see llmops.jobs.watch). The
# service enforces max_run_seconds itself; the local backend has only Airflow's deadline.
DEFAULT_GRACE_SECONDS = 30 * 60
# The task state store key of the job a task instance started (kept across tries and clears).
STATE_KEY = "llmops_job"
# How often the worker wait saves its log cursor to the task state store.
CHECKPOINT_SECONDS = 600
STATE_LOOKUP_SECONDS = 3.0


class JobWait:
    """Mixed into JobOperator: needs its `_handle`, `_ti`, `poll_interval`,
    `deadline_grace_seconds`, `deferrable`, `_backend(name)` and the bookkeeping (JobBooks)."""

    # -- the task state store: best effort, the job name is the fallback ---------------------
    def _recall(self, store: Any) -> dict[str, Any]:
        if store is None:
            return {}
        try:
            record = store.get(STATE_KEY)
        except Exception as exc:  # noqa: BLE001
            self.log.warning("Could not read the task state store (%s); finding the job by name.", exc)
            return {}
        return record if isinstance(record, dict) else {}

    def _save(self, store: Any, record: dict[str, Any]) -> None:
        if store is None:
            return
        try:
            store.set(STATE_KEY, record)
        except Exception as exc:  # noqa: BLE001 - a retry still finds the job by name
            self.log.warning("Could not write job %s to the task state store: %s",
                             record.get("name"), exc)

    def _remember(self, store: Any, **changes: Any) -> None:
        record = self._recall(store)
        if record.get("handle", {}).get("name") == (self._handle or {}).get("name"):
            self._save(store, {**record, **{k: v for k, v in changes.items() if v is not None}})

    # -- wait --------------------------------------------------------------------------------
    def _poll_interval(self, backend: Backend, handle: dict[str, Any] | None = None) -> float:
        if self.poll_interval is not None:
            return float(self.poll_interval)
        handle = handle if handle is not None else (self._handle or {})
        return float(handle.get("poll_interval") or backend.poll_interval)

    def _grace_seconds(self) -> float:
        if self.deadline_grace_seconds is not None:
            return float(self.deadline_grace_seconds)
        handle = self._handle or {}
        if handle.get("deadline_grace_seconds") is not None:
            return float(handle["deadline_grace_seconds"])
        return 0.0 if handle.get("backend") in WORKER_BACKENDS else float(DEFAULT_GRACE_SECONDS)

    def _defers(self, spec: JobSpec) -> bool:
        return self._defers_backend(spec.backend) and not self._reattached_to_ended_job(spec)

    def _reattached_to_ended_job(self, spec: JobSpec) -> bool:
        """Whether this try reattached to a job that has already ended. Such a job is finished
        here, in the worker: deferred, its trigger would fire within seconds, and Airflow's
        scheduler (3.3.2 and MWAA's 3.3.1) can then read the deferring try's late exit report as
        an external kill of the resumed task and fail or retry it though the job succeeded
        (apache/airflow#66374, #67287, #72716; the fault matrix's killed-worker row met it)."""
        handle = self._handle or {}
        if not handle.get("reattached"):
            return False
        try:
            status = self._backend(spec.backend).status(handle)
        except Exception:  # noqa: BLE001 - unread now: defer as usual, the trigger reads it again
            return False
        # An end the chain goes on from (MaxRuntime, a lost host) still defers: its next attempt
        # is waited for in the triggerer.
        if not status.state.terminal or continuation.reason(status) is not None:
            return False
        self.log.info("Job %s has already ended (%s): finishing here rather than in the triggerer",
                      spec.name, status.state.value)
        return True

    def _defers_backend(self, backend: str) -> bool:
        if self.deferrable is not None:
            return bool(self.deferrable)
        if backend in WORKER_BACKENDS:
            return False
        return conf.getboolean("llmops", "defer_remote_jobs", fallback=True)

    def _wait(self, watch: JobWatch, store: Any) -> JobStatus:
        saved_at, saved_cursor = time.monotonic(), watch.log_cursor
        while True:
            step = watch.poll()
            self._show(step)
            if step.waiting:
                self._mark_waiting(watch)
            if step.started or (watch.log_cursor != saved_cursor
                                and time.monotonic() - saved_at > CHECKPOINT_SECONDS):
                self._remember(store, log_cursor=watch.log_cursor, started_at=watch.started_at)
                saved_at, saved_cursor = time.monotonic(), watch.log_cursor
            if step.error:
                self._fail_parent_if_last_try(self._ti)
                raise AirflowException(step.error)
            if step.done:
                self._job_stopped = step.stopped
                self._started_at = watch.started_at
                return step.status
            time.sleep(step.delay)

    def _show(self, step: Step) -> None:
        for warning in step.warnings:
            self.log.warning("%s", warning)
        if step.waiting:
            self.log.info("[job] %s", step.waiting)
        for line in env_secrets.redact_lines(step.lines):
            self.log.info("[job] %s", line)

    # -- end ---------------------------------------------------------------------------------
    def _stop_job(self, reason: str) -> None:
        """Stop the job now; a few quick retries, since the task is on its way out."""
        handle = self._handle
        if not handle or self._job_stopped:
            return
        self.log.info("Stopping job %s: %s", handle["name"], reason)
        backend = self._backend(handle["backend"])
        try:
            call_with_retries(lambda: backend.stop(handle), "stop the job", attempts=3,
                              backoff=Backoff(base=0.5, cap=2.0), logger=self.log)
        except Exception as exc:  # noqa: BLE001 - never hide why the task is ending
            self.log.error("Could not stop job %s (%s: %s): stop it by hand.", handle["name"],
                           type(exc).__name__, exc)
            return
        self._job_stopped = True
        self._end_run(self._run_id, "KILLED")
        self._record_end(JobStatus(JobState.STOPPED, f"stopped: {reason}"))

    def _task_state_now(self) -> tuple[bool, str | None]:
        """(True, the task instance's state in Airflow's DB now) or (False, None) if unknown.

        Asked from a thread with a timeout: on_kill runs in the SIGTERM handler, which may have
        interrupted a call to the supervisor that holds its lock.
        """
        ti = self._ti
        if ti is None:
            return False, None
        answer: dict[str, Any] = {}

        def ask() -> None:
            try:
                from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

                states = RuntimeTaskInstance.get_task_states(
                    dag_id=ti.dag_id, task_ids=[ti.task_id], run_ids=[ti.run_id],
                    map_index=ti.map_index)
                key = ti.task_id if ti.map_index < 0 else f"{ti.task_id}_{ti.map_index}"
                state = states.get(ti.run_id, {}).get(key)
                answer["state"] = getattr(state, "value", state)
            except Exception as exc:  # noqa: BLE001
                answer["error"] = exc

        thread = threading.Thread(target=ask, daemon=True)
        thread.start()
        thread.join(STATE_LOOKUP_SECONDS)
        if "state" not in answer:
            self.log.warning("Could not ask Airflow for the task's state: %s",
                             answer.get("error", "no answer in time"))
            return False, None
        return True, answer["state"]
