"""Submits a JobSpec to its backend and waits for the job, in the worker or deferred.

JobOperator itself prepares the spec (its name: llmops.airflow.operators.job_identity), submits or
reattaches, defers or waits, and ends the task; the rest is composed from one module per concern:
job_wait (the worker-side wait, the task state store, stopping the job), job_cache (the step
cache), job_books (the ledger, the task's links, the MLflow child run) and job_chain (the chain of
attempts). The deferred wait is llmops.airflow.triggers.job_trigger.JobTrigger.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import (AirflowException, AirflowFailException, AirflowSkipException,
                                    AirflowTaskTimeout)

from llmops.airflow.operators import links
from llmops.airflow.operators.job_books import JobBooks
from llmops.airflow.operators.job_cache import JobCache
from llmops.infra import ledger, tracking
from llmops.jobs import continuation, env_secrets
from llmops.jobs.alerts import JobAlerts, where_of
from llmops.jobs.backends import Backend, JobState, JobStatus, get_backend
from llmops.jobs.spec import JobSpec, JobSpecError, NothingToRun
from llmops.jobs.watch import JobWatch, call_with_retries
from llmops.airflow.operators.job_chain import (DEFAULT_MAX_STALLED_ATTEMPTS, LOG_TAIL_LINES,
                                                JobChain, max_stalled_attempts_setting)
from llmops.airflow.operators.job_identity import JobIdentity, NOT_IDENTITY, job_identity
from llmops.airflow.operators.job_pause import JobPause, paused
from llmops.airflow.operators.job_wait import (CHECKPOINT_SECONDS, DEFAULT_GRACE_SECONDS, STATE_KEY,
                                               STATE_LOOKUP_SECONDS, WORKER_BACKENDS, JobWait)
from llmops.airflow.triggers.job_trigger import JobTrigger

# Names this module has always offered (tests and callers import them from here).
__all__ = ["JobOperator", "job_identity", "JobIdentity", "NOT_IDENTITY", "LOG_TAIL_LINES",
           "WORKER_BACKENDS", "DEFAULT_GRACE_SECONDS", "STATE_KEY", "CHECKPOINT_SECONDS",
           "STATE_LOOKUP_SECONDS", "NOT_ENDED_BY_USER", "CLEARED"]

# Task states in which a SIGTERM is not the user's doing: the worker is going away, or Airflow
# lost its heartbeat and will retry. The job keeps running and the next try reattaches.
NOT_ENDED_BY_USER = frozenset({"running", "queued", "scheduled", "deferred", "up_for_retry",
                               "up_for_reschedule"})
# A cleared task instance: its next try reattaches to the running job, so a clear does not stop
# it — unless the run asked for fresh jobs (force_rerun), when the old one would be left unwatched.
CLEARED = frozenset({"restarting", None})


class JobOperator(JobCache, JobChain, JobWait, JobBooks, JobPause, BaseOperator):
    """Run one job and return its result (metrics, output URIs, MLflow run id) as the XCom.

    Give either `spec` (a JobSpec or its dict) or `build_spec(**op_kwargs)`, which builds the spec
    at run time from upstream results (both `spec` and `op_kwargs` are templated, so XComArgs and
    mapping work).

    **Which job.** The job's name is derived from the task instance (dag, run, task, map index) and
    everything that changes the job: entrypoint, argv, config, image, instance type and count,
    processes per node, env (but the MLFLOW_* variables the operator adds), inputs, output and
    checkpoint URIs, max_run_seconds, and the backend's settings (`Backend.fingerprint`). A retry
    or a clear of the task reattaches to the job an earlier try started (running: it is watched
    again; succeeded: its result is returned); a failed or stopped one is submitted again under the
    same name (the backend starts a new attempt, which resumes from its checkpoints). Change any of
    those and the next run starts a new job. The job's handle is also kept in Airflow's task state
    store right after submit, so a later try finds exactly that job; without the store (Airflow
    before 3.3, `airflow dags test`) the deterministic name alone does it.

    **force_rerun** (argument, templated, or the DAG run's `force_rerun` Param when the argument is
    None): the first try of a task instance, and the first try after each clear, submits a fresh
    job instead of reattaching to one that ran before. Retries within that sequence of tries (a
    worker lost, a failed try) reattach to the job the forced try started: the name is salted with
    the sequence's first try number (`max_tries - retries + 1`, which a clear moves on and a retry
    does not). It has no effect on a spec with an explicit `name`.

    **Where it waits.** `deferrable=None` (the default) defers every job but the local backend's
    to the triggerer, so a days-long job holds no worker slot; local jobs run on the worker and are
    waited for there. True/False decide for every backend; `[llmops] defer_remote_jobs = False`
    turns the default off for a deployment without a triggerer.

    **A job that paused on request** (its PAUSE marker: tasks/train/pause.py, written from the
    "Pause pretraining" link, llmops.airflow.pause_api) ends the task skipped, its log saying
    "paused at step N" and how to resume; no retry, no further attempt
    (llmops.airflow.operators.job_pause).

    **When the job is stopped.** Only when its deadline passes (`max_run_seconds` plus
    `deadline_grace_seconds` from when it started running: time queued does not count), when it
    waited in the queue past the handle's `max_queue_seconds` (the backend's settings, per stage;
    the task fails with the service's last waiting reason, and no further attempt follows), when the
    task's `execution_timeout` passes, or when a user ends the task (mark failed or success, clear).
    Never because an API call failed (transient errors are retried with backoff; others fail the
    task and leave the job running) or because the worker goes away: a SIGTERM while the task is
    still running in Airflow (worker shutdown, lost heartbeat) leaves the remote job running for
    the next try. Local jobs are stopped with the task, since they run on the worker.

    `poll_interval=None` uses the handle's `poll_interval` (the backend's settings), else the
    backend class's. `deadline_grace_seconds=None` uses the handle's (the backend's settings), else
    30 minutes (0 for local jobs, which have no other limit).

    **Step cache** (llmops.infra.step_cache, when the spec's `cache` names an index): before
    submitting, the task looks up the job's identity (stage, config, input content hashes, code,
    image; no run ids) in the index under the storage root. A verified hit returns the earlier
    job's result without submitting anything: the task log says so, the MLflow child run is tagged
    `cached_from` (the earlier MLflow run) and `cached_from_job`, and the ledger gets a `cached`
    event, charged nothing. force_rerun, or the spec's `cache.lookup` false (the `cache` Param),
    skips the lookup. Every job that succeeds is recorded (with its outputs' hashes) so later runs
    can reuse it; its result gains `content_hashes` (output name -> hash), which downstream specs
    key on. A spec whose `cache.taken` holds an earlier run's record (`from_run`, checked by
    start_run) returns that record's result the same way.

    With the spec's MLflow parent run set, the operator opens (or on retry re-opens) the task's
    child run, tags it, and hands its id to the job, which logs into it. The run is ended when the
    job ends or is stopped; it stays RUNNING while the job runs unwatched between tries.
    """

    template_fields = ("spec", "op_kwargs", "force_rerun")
    ui_color = "#e8f1ff"
    # MLflow run, SageMaker / Batch / EKS console, CloudWatch logs, Ray dashboard (links.py)
    operator_extra_links = links.JOB_LINKS

    def __init__(self, *, spec: JobSpec | dict | None = None,
                 build_spec: Callable[..., JobSpec | dict] | None = None,
                 op_kwargs: dict[str, Any] | None = None,
                 deferrable: bool | None = None,
                 poll_interval: float | None = None,
                 deadline_grace_seconds: float | None = None,
                 force_rerun: bool | str | None = None,
                 max_attempts: int = 20, run_deadline_hours: float | None = None,
                 max_stalled_attempts: int = DEFAULT_MAX_STALLED_ATTEMPTS,
                 **kwargs: Any):
        super().__init__(**kwargs)
        if (spec is None) == (build_spec is None):
            raise ValueError("JobOperator needs exactly one of spec= or build_spec=.")
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"JobOperator max_attempts must be an integer >= 1, got {max_attempts!r}.")
        if run_deadline_hours is not None and run_deadline_hours <= 0:
            raise ValueError(f"JobOperator run_deadline_hours must be > 0 or None, got "
                             f"{run_deadline_hours!r}.")
        self.spec = spec
        self.build_spec = build_spec
        self.op_kwargs = op_kwargs or {}
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self.deadline_grace_seconds = deadline_grace_seconds
        self.force_rerun = force_rerun
        self.max_attempts = max_attempts
        self.run_deadline_hours = run_deadline_hours
        self.max_stalled_attempts = max_stalled_attempts_setting(max_stalled_attempts)
        # The chain of attempts of this try (llmops.jobs.continuation): how many jobs so far,
        # since when, how many capacity waits. Travels through deferrals in the trigger's context.
        self._chain: dict[str, Any] = {"attempts": 1, "since": None, "capacity_waits": 0}
        self._handle: dict[str, Any] | None = None
        self._ti: Any = None
        self._run_id = ""
        self._parent_run_id = ""
        self._job_stopped = False
        self._forced = False   # force_rerun resolved for this try (set by _prepare)
        self._ledger_job: dict[str, Any] = {}   # the job's ledger fields (llmops.infra.ledger)
        self._started_at: float | None = None
        self._cache_ctx: dict[str, Any] = {}    # index, key, identity of this job (step cache)

    # -- execute -----------------------------------------------------------------------------
    def execute(self, context: Any) -> dict[str, Any]:
        self._ti = context["ti"]
        spec = self._prepare(context)
        # Before any job line reaches the task log: a local job inherits this worker's
        # environment, and whatever of it the job prints must show as ***.
        env_secrets.mask_in_task_logs(os.environ, spec.env)
        backend = get_backend(spec.backend)
        store = context.get("task_state_store")
        self._run_id = run_id = spec.env.get("MLFLOW_RUN_ID", "")
        self._parent_run_id = spec.mlflow_parent_run_id
        reused = self._reuse(backend, spec, started=self._recall(store).get("name") == spec.name)
        if reused is not None:
            return reused
        try:
            record = self._submit_or_reattach(backend, spec, store)
            self._chain_begins()
            status = self._watch(context, backend, spec, store, record)
        except AirflowTaskTimeout:
            # The task's own execution_timeout: the user's limit for this task, job included.
            # (The task runner calls on_kill next, which then has nothing left to do.)
            self._stop_job("the task's execution_timeout passed")
            raise
        return self._finish(context, status, spec.stage, run_id)

    def _watch(self, context: Any, backend: Backend, spec: JobSpec, store: Any,
               record: dict[str, Any], event: str | None = None) -> JobStatus:
        """Record the job's start, then wait for it here or defer to the triggerer."""
        self._chain["since"] = self._chain.get("since") or record.get("submitted_at") or time.time()
        self._record_start(backend, spec, record, event)
        self._push_links(self._run_id, self._pause_links(spec))
        watch_kwargs = {"poll_interval": self._poll_interval(backend),
                        "max_run_seconds": spec.max_run_seconds,
                        "grace_seconds": self._grace_seconds(),
                        "log_cursor": record.get("log_cursor"),
                        "started_at": record.get("started_at"),
                        "max_queue_seconds": (self._handle or {}).get("max_queue_seconds") or None,
                        "submitted_at": record.get("submitted_at")}
        if self._defers(spec):
            # Airflow does not apply execution_timeout to a deferred task: the trigger does.
            task_deadline = (time.time() + self.execution_timeout.total_seconds()
                             if self.execution_timeout else None)
            self.defer(trigger=JobTrigger(handle=self._handle, task_deadline=task_deadline,
                                          stop_on_clear=self._forced,
                                          context={"stage": spec.stage, "mlflow_run_id": self._run_id,
                                                   "parent_run_id": spec.mlflow_parent_run_id,
                                                   "ledger": self._ledger_job,
                                                   "cache": self._cache_ctx, "chain": self._chain},
                                          **watch_kwargs),
                       method_name="execute_complete")
        alerts = JobAlerts.from_settings(self._handle, where_of(self._ti))
        return self._wait(JobWatch(backend, self._handle, **watch_kwargs, alerts=alerts), store)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        self._ti = context["ti"]
        env_secrets.mask_in_task_logs(os.environ)  # a new worker process: the failure shows log lines
        self._handle = handle = event["handle"]
        self._run_id = event.get("mlflow_run_id", "")
        self._parent_run_id = event.get("parent_run_id", "")
        self._ledger_job = event.get("ledger") or {}
        self._cache_ctx = event.get("cache") or {}
        self._chain = event.get("chain") or self._chain
        self._started_at = event.get("started_at")
        state = event.get("state")
        store = context.get("task_state_store")
        if state == "progress":
            # The trigger checkpoints its log cursor (and the job's start) by handing them back:
            # a triggerer restart resumes from here instead of replaying the whole log. Nothing is
            # submitted or read; the task is deferred again at once.
            self._remember(store, log_cursor=event.get("log_cursor"), started_at=event.get("started_at"))
            self.defer(trigger=JobTrigger(**event["trigger"]), method_name="execute_complete")
        if state == "error":  # the status could not be read: fail the try, leave the job running
            self._fail_parent_if_last_try(context["ti"])
            raise AirflowException(event["message"])
        if state == "task_timeout":  # the trigger stopped the job at the task's execution_timeout
            self._job_stopped = True
            self._record_end(JobStatus(JobState.STOPPED, event["message"]))
            self._end_run(self._run_id, "KILLED")
            raise AirflowTaskTimeout(event["message"])
        if state == "timeout":
            self._job_stopped = True
            status = JobStatus(JobState.STOPPED, event["message"])
        else:
            backend = get_backend(handle["backend"])
            status = call_with_retries(lambda: backend.status(handle), "read the job's final status",
                                       logger=self.log)
        return self._finish(context, status, event["stage"], self._run_id)

    def on_kill(self) -> None:
        """Called on SIGTERM (a user ending the task, or the worker going away) and on timeout."""
        handle = self._handle
        if not handle or self._job_stopped:
            return
        if handle["backend"] in WORKER_BACKENDS:
            self._stop_job("the task was killed")
            return
        known, state = self._task_state_now()
        if known and state in CLEARED and not self._forced:
            self.log.warning("The task was cleared: job %s keeps running and the next try "
                             "reattaches to it (set force_rerun to start a fresh job instead).",
                             handle["name"])
            return
        if not known or state in NOT_ENDED_BY_USER:
            self.log.warning(
                "The task's process is being terminated while the task is %s in Airflow (a worker "
                "shutting down, or a lost heartbeat): job %s keeps running, and the next try "
                "reattaches to it. Mark the task failed to stop the job.",
                state if known else "in an unknown state", handle["name"])
            return
        self._stop_job(f"the task was set to {state}")

    # -- submit or reattach ------------------------------------------------------------------
    def _prepare(self, context: Any) -> JobSpec:
        try:
            raw = self.spec if self.build_spec is None else self.build_spec(**self.op_kwargs)
            spec = raw if isinstance(raw, JobSpec) else JobSpec.from_dict(raw)
            backend = get_backend(spec.backend)
        except NothingToRun as exc:
            raise AirflowSkipException(f"{self.task_id}: {exc}") from None
        except (JobSpecError, ValueError) as exc:
            raise AirflowFailException(f"Invalid job spec for task {self.task_id}: {exc}") from exc
        ti = context["ti"]
        identity = {"dag_id": ti.dag_id, "run_id": ti.run_id, "task_id": ti.task_id,
                    "map_index": str(ti.map_index)}
        # Cost allocation: every backend tags the job with these (llmops.jobs.spec.COST_TAGS).
        spec = spec.replace(tags={**spec.tags, "dag_id": ti.dag_id, "run_id": ti.run_id})
        salt = self._rerun_salt(context)
        if not spec.name:
            prefix = ti.task_id if ti.map_index < 0 else f"{ti.task_id}-{ti.map_index}"
            spec = spec.replace(name=JobIdentity(spec, backend.fingerprint(spec)).job_name(
                *identity.values(), salt=salt, prefix=prefix))
        elif salt:
            self.log.warning("force_rerun has no effect on a spec with an explicit name (%s).",
                             spec.name)
        if spec.mlflow_parent_run_id:
            # Found again on every try by the task's identity: one child run per task instance.
            run_id = tracking.start_child_run(
                experiment=spec.mlflow_experiment, parent_run_id=spec.mlflow_parent_run_id,
                stage=spec.stage, identity=identity,
                tags={"try_number": str(ti.try_number), "backend": spec.backend,
                      "job_name": spec.name, **spec.tags})
            spec = spec.replace(env={**spec.env, "MLFLOW_RUN_ID": run_id,
                                     "MLFLOW_TRACKING_URI": tracking.tracking_uri(),
                                     "MLFLOW_EXPERIMENT_NAME": spec.mlflow_experiment})
        return spec

    def _rerun_salt(self, context: Any) -> str:
        """"" normally; with force_rerun, a value that a clear changes and a retry keeps."""
        force = self.force_rerun
        if force is None:
            force = (context.get("params") or {}).get("force_rerun")
        self._forced = _as_bool(force)
        if not self._forced:
            return ""
        ti = context["ti"]
        first_try = int(getattr(ti, "max_tries", 0) or 0) - int(self.retries or 0) + 1
        return f"rerun-{first_try}"

    def _submit_or_reattach(self, backend: Backend, spec: JobSpec, store: Any) -> dict[str, Any]:
        """Set self._handle; return the stored record of the job (cursor, start) or {}."""
        record = self._recall(store)
        if record.get("name") == spec.name and record.get("handle"):
            handle = record["handle"]
            try:
                status = call_with_retries(lambda: backend.status(handle),
                                           "read the status of the job an earlier try started",
                                           poll_interval=self._poll_interval(backend, handle),
                                           logger=self.log)
            except Exception as exc:  # noqa: BLE001 - e.g. the job was deleted: submit by name
                self.log.warning("Job %s recorded by an earlier try cannot be read (%s: %s); "
                                 "submitting by name.", spec.name, type(exc).__name__, exc)
            else:
                if not status.state.terminal or status.state is JobState.SUCCEEDED:
                    self._handle = {**handle, "reattached": True}
                    self.log.info("Reattached to %s job %s (recorded by try %s, now %s) on backend %s",
                                  spec.stage, spec.name, record.get("try_number", "?"),
                                  status.state.value, spec.backend)
                    if record.get("log_cursor") is not None:
                        self.log.info("Its log continues where the earlier try left off; the "
                                      "lines before are in that try's log.")
                    return record
        submitted_at = time.time()
        # A submit is idempotent (it claims its attempt and reattaches by name), so an API hiccup
        # or outage while it looks for an earlier try's job is waited out as the watch waits one
        # out, not turned into a failed try (the fault matrix's 10-minute read outage found it).
        self._handle = call_with_retries(lambda: backend.submit(spec), f"submit or find job {spec.name}",
                                         logger=self.log)
        verb = "Reattached to" if self._handle.get("reattached") else "Submitted"
        self.log.info("%s %s job %s on backend %s", verb, spec.stage, spec.name, spec.backend)
        record = {"name": spec.name, "handle": self._handle, "try_number": self._ti.try_number}
        if not self._handle.get("reattached"):
            record["submitted_at"] = submitted_at
        self._save(store, record)
        return record

    def _backend(self, name: str) -> Backend:
        """The backend `name`: looked up here, where tests replace get_backend."""
        return get_backend(name)

    # -- end ---------------------------------------------------------------------------------
    def _finish(self, context: Any, status: JobStatus, stage: str, mlflow_run_id: str) -> dict[str, Any]:
        name = self._handle["name"]
        why = None if self._job_stopped else continuation.reason(status)
        stop = self._chain_exhausted(why) if why else ""   # reads the job's newest checkpoint
        self._record_end(dataclasses.replace(status, message=f"{status.message} (the chain of "
                                             f"attempts stopped: {stop})") if stop else status)
        if status.state is not JobState.SUCCEEDED and (why or int(self._chain.get("attempts", 1)) > 1):
            self._record_attempt(status, why, stop)   # a chain's attempt ended: say why
        if status.state is JobState.SUCCEEDED:
            result = dict(status.result or {})
            result.update(job_name=name, backend=self._handle["backend"], mlflow_run_id=mlflow_run_id)
            result = self._record_in_cache(result, ledger.end_fields(status, self._started_at))
            self._end_run(mlflow_run_id, "FINISHED")
            metrics = result.get("metrics", {})
            self.log.info("%s job %s succeeded: %s", stage, name,
                          ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                    for k, v in sorted(metrics.items())))
            return result
        was_paused, step = paused(status)
        if was_paused and not self._job_stopped:
            # paused on request (tasks/train/pause.py): skipped, no retry, no further attempt
            self._end_paused(context, stage, name, step, status.result)
        if why:
            if not stop:
                return self._continue(context, status, why)
            self.log.error("%s job %s ended (%s: %s) and %s: the chain of attempts stops here.",
                           stage, name, why, status.message, stop)
        self._end_run(mlflow_run_id, "KILLED" if status.state is JobState.STOPPED else "FAILED")
        final = bool(self._chain.get("no_progress"))   # the same again: no Airflow retry
        if final:
            self._end_run(self._parent_run_id, "FAILED")
        else:
            self._fail_parent_if_last_try(context["ti"])
        try:
            tail = get_backend(self._handle["backend"]).log_tail(self._handle, LOG_TAIL_LINES)
        except Exception as exc:  # noqa: BLE001 - the failure itself is what matters
            tail = [f"(could not read the log: {type(exc).__name__}: {exc})"]
        raise (AirflowFailException if final else AirflowException)(
            f"{stage} job {name} {status.state.value}: {status.message}.\n"
            + (f"The chain of attempts stopped: {stop}\n" if stop else "")
            + "Last lines of its log:\n" + "\n".join(env_secrets.redact_lines(tail)))


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):  # a templated "{{ params.force_rerun }}" renders as text
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)
