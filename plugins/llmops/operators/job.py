"""Submits a JobSpec to its backend and waits for the job, in the worker or deferred."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from typing import Any, Callable

from airflow.sdk import BaseOperator, conf
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowTaskTimeout

from llmops import ledger, step_cache, tracking
from llmops.jobs import continuation, env_secrets
from llmops.jobs.backends import Backend, JobState, JobStatus, get_backend
from llmops.jobs.errors import Backoff
from llmops.jobs.spec import JobSpec, JobSpecError, cost_allocation_tags, job_name
from llmops.jobs.watch import JobWatch, Step, call_with_retries
from llmops.operators import links

LOG_TAIL_LINES = 40
# Backends whose jobs run on the worker itself: waited for there, and stopped with the task.
WORKER_BACKENDS = frozenset({"local"})
# Airflow's deadline = max_run_seconds + this, from the job's start (see llmops.jobs.watch). The
# service enforces max_run_seconds itself; the local backend has only Airflow's deadline.
DEFAULT_GRACE_SECONDS = 30 * 60
# The task state store key of the job a task instance started (kept across tries and clears).
STATE_KEY = "llmops_job"
# How often the worker wait saves its log cursor to the task state store.
CHECKPOINT_SECONDS = 600
# Task states in which a SIGTERM is not the user's doing: the worker is going away, or Airflow
# lost its heartbeat and will retry. The job keeps running and the next try reattaches.
NOT_ENDED_BY_USER = frozenset({"running", "queued", "scheduled", "deferred", "up_for_retry",
                               "up_for_reschedule"})
# A cleared task instance: its next try reattaches to the running job, so a clear does not stop
# it — unless the run asked for fresh jobs (force_rerun), when the old one would be left unwatched.
CLEARED = frozenset({"restarting", None})
STATE_LOOKUP_SECONDS = 3.0
# Spec fields that do not change what the job computes: left out of the job's identity.
# settings_overrides: the backend's fingerprint hashes the settings they produce
NOT_IDENTITY = ("name", "tags", "mlflow_experiment", "mlflow_parent_run_id", "settings_overrides")


class JobOperator(BaseOperator):
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

    **Step cache** (llmops.step_cache, when the spec's `cache` names an index): before
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
        # The chain of attempts of this try (llmops.jobs.continuation): how many jobs so far,
        # since when, how many capacity waits. Travels through deferrals in the trigger's context.
        self._chain: dict[str, Any] = {"attempts": 1, "since": None, "capacity_waits": 0}
        self._handle: dict[str, Any] | None = None
        self._ti: Any = None
        self._run_id = ""
        self._parent_run_id = ""
        self._job_stopped = False
        self._forced = False   # force_rerun resolved for this try (set by _prepare)
        self._ledger_job: dict[str, Any] = {}   # the job's fields in the ledger (llmops.ledger)
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
        self._push_links(self._run_id)
        watch_kwargs = {"poll_interval": self._poll_interval(backend),
                        "max_run_seconds": spec.max_run_seconds,
                        "grace_seconds": self._grace_seconds(),
                        "log_cursor": record.get("log_cursor"),
                        "started_at": record.get("started_at"),
                        "max_queue_seconds": (self._handle or {}).get("max_queue_seconds") or None,
                        "submitted_at": record.get("submitted_at")}
        if self._defers(spec):
            from llmops.triggers.job import JobTrigger

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
        return self._wait(JobWatch(backend, self._handle, **watch_kwargs), store)

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
            from llmops.triggers.job import JobTrigger

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
            spec = spec.replace(name=job_name(*identity.values(),
                                              job_identity(spec, backend.fingerprint(spec)),
                                              *([salt] if salt else []), prefix=prefix))
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
        self._handle = backend.submit(spec)
        verb = "Reattached to" if self._handle.get("reattached") else "Submitted"
        self.log.info("%s %s job %s on backend %s", verb, spec.stage, spec.name, spec.backend)
        record = {"name": spec.name, "handle": self._handle, "try_number": self._ti.try_number}
        if not self._handle.get("reattached"):
            record["submitted_at"] = submitted_at
        self._save(store, record)
        return record

    # -- the step cache: a finished job with the same identity is reused (llmops.step_cache) ---
    def _reuse(self, backend: Backend, spec: JobSpec, started: bool = False) -> dict[str, Any] | None:
        """The result of an earlier job this task reuses instead of running one, or None (then
        `self._cache_ctx` says where the job's record goes once it succeeds). A task that
        already started its job (`started`: an earlier try's, in the task state store) keeps
        it: it reattaches rather than leave that job running unwatched."""
        cache = spec.cache or {}
        if not cache.get("index"):
            return None
        if cache.get("taken"):  # from_run: the earlier run's stage, checked by start_run
            return self._reused(spec, cache["taken"], "from_run")
        parts = step_cache.identity(spec, backend.fingerprint(spec))
        key = step_cache.key_of(parts)
        self._cache_ctx = {"index": cache["index"], "key": key, "identity": parts}
        if self._forced:
            self.log.info("Step cache: force_rerun is set, so %s runs its job afresh (identity %s).",
                          spec.stage, key[:12])
            return None
        if started:
            self.log.info("Step cache: an earlier try of this task started job %s; reattaching to "
                          "it (identity %s).", spec.name, key[:12])
            return None
        if not cache.get("lookup", True):
            self.log.info("Step cache: off for this run (Param cache), so %s runs its job (identity "
                          "%s); it is recorded for later runs.", spec.stage, key[:12])
            return None
        index = step_cache.Index(cache["index"])
        record, why = step_cache.lookup(index, spec.stage, key)
        if record is None:
            self.log.info("Step cache miss for %s (identity %s): %s%s. Running the job.", spec.stage,
                          key[:12], why, self._what_changed(index, spec.stage, parts))
            return None
        return self._reused(spec, record, "cache")

    def _what_changed(self, index: step_cache.Index, stage: str, parts: dict[str, Any]) -> str:
        try:
            latest = index.latest(stage)
        except Exception:  # noqa: BLE001 - only an explanation
            return ""
        if not latest or not latest.get("identity"):
            return ""
        changed = step_cache.differences(latest["identity"], parts)
        return (f"; the newest recorded {stage} job ({latest.get('job_name')}, run "
                f"{latest.get('run_id')}) differs in {', '.join(changed[:8])}") if changed else ""

    def _reused(self, spec: JobSpec, record: dict[str, Any], how: str) -> dict[str, Any]:
        """Hand back `record`'s result as this task's: tag the child run, ledger it, log it."""
        source = {"mlflow_run_id": record.get("mlflow_run_id", ""), "job_name": record["job_name"],
                  "dag_id": record.get("dag_id", ""), "run_id": record.get("run_id", ""),
                  "key": record.get("key", ""), "how": how}
        saved = record.get("job_seconds")
        self.log.info(
            "%s %s: reusing the outputs of job %s (DAG run %s, MLflow run %s), %s; no job submitted%s.",
            "Step cache hit for" if how == "cache" else "from_run: taking", spec.stage,
            source["job_name"], source["run_id"], source["mlflow_run_id"],
            f"identity {source['key'][:12]}, outputs verified" if how == "cache"
            else "its outputs checked by start_run",
            f" (the job took {saved:.0f} s)" if isinstance(saved, (int, float)) else "")
        result = {**record["result"], "cached_from": source}
        self._push_links(self._run_id)   # the task's MLflow link: the child run that says cached_from
        if self._run_id:
            try:
                tracking.mark_reused(self._run_id, source, record)
            except Exception as exc:  # noqa: BLE001 - bookkeeping never decides the task
                self.log.warning("Could not tag MLflow run %s as reused: %s", self._run_id, exc)
        ledger.record_job("cached", {
            "job_name": source["job_name"], "spec_hash": source["key"], "stage": spec.stage,
            "backend": spec.backend, "image": spec.image, "team": cost_allocation_tags(spec)["team"],
            "dag_id": self._ti.dag_id, "run_id": self._ti.run_id, "task_id": self._ti.task_id,
            "map_index": int(self._ti.map_index), "try_number": int(self._ti.try_number),
            "instance_type": spec.instance_type, "instance_count": spec.instance_count,
            "mlflow_run_id": self._run_id}, state="succeeded")
        return result

    def cache_entry(self, result: dict[str, Any]) -> dict[str, Any] | None:
        """What of a succeeded job's result the step cache keeps; None: not reusable. Subclasses
        narrow it (a pruned trial's outcome depended on the other trials)."""
        return result

    def _record_in_cache(self, result: dict[str, Any], ended: dict[str, Any]) -> dict[str, Any]:
        """Record the job that just succeeded (after its result and outputs are complete) and
        return its result with the outputs' content hashes. Never fails the task."""
        ctx = self._cache_ctx
        if not ctx:
            return result
        entry = self.cache_entry(result)
        started, finished = ended.get("started_at"), ended.get("ended_at")
        ti = self._ti
        try:
            if entry is None:
                outputs = step_cache.output_fingerprints(result.get("outputs") or {})
                return {**result, "content_hashes": {n: o["hash"] for n, o in outputs.items()}}
            record = step_cache.make_record(key=ctx["key"], parts=ctx["identity"], result=entry, where={
                "job_name": result["job_name"], "mlflow_run_id": result.get("mlflow_run_id", ""),
                "dag_id": ti.dag_id, "run_id": ti.run_id, "task_id": ti.task_id,
                "map_index": int(ti.map_index),
                "job_seconds": (finished - started) if started and finished else None})
            uri = step_cache.Index(ctx["index"]).put(record)
        except Exception as exc:  # noqa: BLE001
            self.log.warning("Step cache: could not record job %s (%s: %s); later runs will run it "
                             "again.", result.get("job_name"), type(exc).__name__, exc)
            return result
        self.log.info("Step cache: recorded job %s as %s.", result["job_name"], uri)
        if self._run_id:
            try:
                tracking.log_json(self._run_id, record, step_cache.RECORD_ARTIFACT)
                tracking.client().set_tag(self._run_id, "cache_key", ctx["key"])
            except Exception as exc:  # noqa: BLE001
                self.log.warning("Could not log the step record to MLflow run %s: %s", self._run_id, exc)
        return {**result, "content_hashes": record["result"]["content_hashes"]}

    # -- the job ledger: best effort (llmops.ledger never raises) ----------------------------
    def _record_start(self, backend: Backend, spec: JobSpec, record: dict[str, Any],
                      event: str | None = None) -> None:
        handle, ti = self._handle or {}, self._ti
        self._ledger_job = {
            "job_name": spec.name, "attempt": int(handle.get("attempt") or 1),
            "spec_hash": job_identity(spec, backend.fingerprint(spec)), "stage": spec.stage,
            "backend": spec.backend, "service_job_name": str(handle.get("job_name") or spec.name),
            "image": str(handle.get("image") or spec.image),
            "team": cost_allocation_tags(spec)["team"], "dag_id": ti.dag_id, "run_id": ti.run_id,
            "task_id": ti.task_id, "map_index": int(ti.map_index), "try_number": int(ti.try_number),
            "instance_type": str(handle.get("instance_type") or spec.instance_type),
            "instance_count": int(handle.get("instance_count") or spec.instance_count),
            "submitted_at": record.get("submitted_at"), "mlflow_run_id": self._run_id}
        from llmops.ledger.events import image_digest

        self._ledger_job["image_digest"] = image_digest(self._ledger_job["image"])
        # `event` given: e.g. "continued", the next attempt of a chain (llmops.jobs.continuation)
        event = event or ("reattached" if handle.get("reattached") else
                          "retried" if int(ti.try_number) > 1 else "submitted")
        ledger.record_job(event, self._ledger_job, state="pending",
                          started_at=record.get("started_at"))

    def _record_end(self, status: JobStatus) -> None:
        if self._ledger_job:
            ledger.record_job("ended", {**self._ledger_job, "try_number": int(self._ti.try_number)},
                              **ledger.end_fields(status, self._started_at))

    def _push_links(self, mlflow_run_id: str) -> None:
        """The task's extra links, as soon as the job's handle is known (links.py); the MLflow
        run's URL also goes to the task log."""
        mlflow_run = ""
        if mlflow_run_id:
            try:
                mlflow_run = tracking.run_url(mlflow_run_id)
                self.log.info("MLflow run: %s", mlflow_run)
            except Exception as exc:  # noqa: BLE001 - a link is never worth failing the task
                self.log.warning("Could not build the MLflow run's URL: %s", exc)
        try:
            links.push_links(self._ti, links.links_for(self._handle or {}, mlflow_run))
        except Exception as exc:  # noqa: BLE001
            self.log.warning("Could not store the task's links: %s", exc)

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
        return self._defers_backend(spec.backend)

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
        backend = get_backend(handle["backend"])
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

    def _end_run(self, run_id: str, status: str) -> None:
        if not run_id:
            return
        try:
            tracking.end_run(run_id, status)
        except Exception as exc:  # noqa: BLE001 - MLflow being down must not decide the task
            self.log.warning("Could not mark MLflow run %s %s: %s", run_id, status, exc)

    def _fail_parent_if_last_try(self, ti: Any) -> None:
        if self._parent_run_id and ti.try_number > self.retries:
            # The last try failed: the lifecycle run as a whole has failed, say so in MLflow.
            self._end_run(self._parent_run_id, "FAILED")

    def _finish(self, context: Any, status: JobStatus, stage: str, mlflow_run_id: str) -> dict[str, Any]:
        name = self._handle["name"]
        self._record_end(status)
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
        why = None if self._job_stopped else continuation.reason(status)
        if why:
            exhausted = self._chain_exhausted()
            if not exhausted:
                return self._continue(context, status, why)
            self.log.error("%s job %s ended (%s: %s) and %s: the chain of attempts stops here.",
                           stage, name, why, status.message, exhausted)
        self._end_run(mlflow_run_id, "KILLED" if status.state is JobState.STOPPED else "FAILED")
        self._fail_parent_if_last_try(context["ti"])
        try:
            tail = get_backend(self._handle["backend"]).log_tail(self._handle, LOG_TAIL_LINES)
        except Exception as exc:  # noqa: BLE001 - the failure itself is what matters
            tail = [f"(could not read the log: {type(exc).__name__}: {exc})"]
        raise AirflowException(
            f"{stage} job {name} {status.state.value}: {status.message}.\n"
            f"Last lines of its log:\n" + "\n".join(env_secrets.redact_lines(tail)))

    def _quote_tail(self, who: str) -> None:
        """The ended job's last lines in this log part, each as `<who> | <line>`."""
        try:
            tail = get_backend(self._handle["backend"]).log_tail(self._handle, LOG_TAIL_LINES)
        except Exception as exc:  # noqa: BLE001 - a log read must not stop the chain
            self.log.warning("Could not read the last lines of %s's log: %s: %s", who,
                             type(exc).__name__, exc)
            return
        self.log.info("The last %d lines of %s's log (its whole log stays in the service's "
                      "logs):", len(tail), who)
        for line in env_secrets.redact_lines(tail):
            self.log.info("%s | %s", who, line)


    # -- the chain of attempts (llmops.jobs.continuation) -----------------------------------
    def _chain_exhausted(self) -> str:
        """Why no further attempt may start ("" when one may)."""
        attempts = int(self._chain.get("attempts", 1))
        if attempts >= self.max_attempts:
            return f"this try has run {attempts} attempts (max_attempts {self.max_attempts})"
        since = self._chain.get("since")
        if self.run_deadline_hours is not None and since is not None and \
                time.time() > since + self.run_deadline_hours * 3600:
            return (f"the stage's run deadline ({self.run_deadline_hours:g} h from its first "
                    "submit) has passed")
        return ""

    def _continue(self, context: Any, status: JobStatus, why: str) -> dict[str, Any]:
        """The job ended for a reason the next attempt fixes: submit it, from the newest
        checkpoint, after a backoff for capacity errors, and wait for it as for the first."""
        chain = self._chain
        if why == "capacity":
            chain["capacity_waits"] = int(chain.get("capacity_waits", 0)) + 1
        backend_name = (self._handle or {}).get("backend", "")
        if self._defers_backend(backend_name):
            # Airflow opens a try's trigger log part anew for each deferral (the triggerer's
            # TriggerLoggingFactory writes with mode "wb"), so the lines this attempt's trigger
            # showed give way to the next attempt's: keep its last lines here, quoted.
            self._quote_tail(f"attempt {chain['attempts']}")
        delay = continuation.backoff_seconds(why, int(chain.get("capacity_waits", 0)))
        self.log.warning("Attempt %d (%s) ended: %s (%s). Attempt %d goes on from the newest "
                         "checkpoint%s.", chain["attempts"], (self._handle or {}).get("job_name"),
                         why, status.message, chain["attempts"] + 1,
                         f" in {delay:.0f} s" if delay else "")
        if delay:
            # The spec (and its MLflow child run) is built once, by the next attempt.
            if self._defers_backend((self._handle or {}).get("backend", "")):
                from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger
                from datetime import timedelta

                self.defer(trigger=TimeDeltaTrigger(timedelta(seconds=delay)),
                           method_name="execute_continue",
                           kwargs={"chain": chain, "mlflow_run_id": self._run_id,
                                   "parent_run_id": self._parent_run_id})
            time.sleep(delay)
        return self._next_attempt(context)

    def execute_continue(self, context: Any, event: Any = None, *, chain: dict[str, Any],
                         mlflow_run_id: str = "", parent_run_id: str = "") -> dict[str, Any]:
        """After a deferred capacity backoff: the next attempt of the chain."""
        self._ti = context["ti"]
        env_secrets.mask_in_task_logs(os.environ)
        self._chain, self._run_id, self._parent_run_id = chain, mlflow_run_id, parent_run_id
        return self._next_attempt(context)

    def _next_attempt(self, context: Any) -> dict[str, Any]:
        spec = self._prepare(context)
        env_secrets.mask_in_task_logs(os.environ, spec.env)
        backend = get_backend(spec.backend)
        store = context.get("task_state_store")
        self._run_id = spec.env.get("MLFLOW_RUN_ID", self._run_id)
        self._chain["attempts"] = int(self._chain.get("attempts", 1)) + 1
        self._job_stopped, self._started_at = False, None
        submitted_at = time.time()
        self._handle = backend.submit(spec)
        self.log.info("Submitted attempt %d of %s job %s: %s", self._chain["attempts"], spec.stage,
                      spec.name, self._handle.get("job_name", spec.name))
        record = {"name": spec.name, "handle": self._handle, "try_number": self._ti.try_number,
                  "submitted_at": submitted_at}
        self._save(store, record)
        status = self._watch(context, backend, spec, store, record, event="continued")
        return self._finish(context, status, spec.stage, self._run_id)


def job_identity(spec: JobSpec, fingerprint: str = "") -> str:
    """A hash of everything that changes what the job is (see JobOperator: "Which job")."""
    data = {k: v for k, v in spec.to_dict().items() if k not in NOT_IDENTITY}
    # The MLFLOW_* variables are added per try (run id, tracking URI); the child run they name is
    # found by the task's identity, which is in the name already.
    data["env"] = {k: v for k, v in spec.env.items() if not k.startswith("MLFLOW_")}
    # The inputs' content (the paths are in the config): where the index is, or whether to
    # look in it, changes nothing the job computes.
    data["cache"] = {n: i.get("hash") for n, i in (spec.cache.get("inputs") or {}).items()}
    data["backend_settings"] = fingerprint
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):  # a templated "{{ params.force_rerun }}" renders as text
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)
