"""Submits a JobSpec to its backend and waits for the job, in the worker or deferred."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Callable

from airflow.sdk import BaseOperator, conf
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from llmops import tracking
from llmops.jobs.backends import JobState, JobStatus, get_backend
from llmops.jobs.spec import JobSpec, JobSpecError, job_name

LOG_TAIL_LINES = 40


class JobOperator(BaseOperator):
    """Run one job and return its result (metrics, output URIs, MLflow run id) as the XCom.

    Give either `spec` (a JobSpec or its dict) or `build_spec(**op_kwargs)`, which builds the spec
    at run time from upstream results (both `spec` and `op_kwargs` are templated, so XComArgs and
    mapping work). The job's name is derived from the task's identity and the spec's content: a
    retried task reattaches to the job its earlier try started, instead of running it twice.

    With the spec's MLflow parent run set, the operator opens (or on retry re-opens) the task's
    child run, tags it, and hands its id to the job, which logs into it.
    """

    template_fields = ("spec", "op_kwargs")
    ui_color = "#e8f1ff"

    def __init__(self, *, spec: JobSpec | dict | None = None,
                 build_spec: Callable[..., JobSpec | dict] | None = None,
                 op_kwargs: dict[str, Any] | None = None,
                 deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
                 poll_interval: float = 2.0, **kwargs: Any):
        super().__init__(**kwargs)
        if (spec is None) == (build_spec is None):
            raise ValueError("JobOperator needs exactly one of spec= or build_spec=.")
        self.spec = spec
        self.build_spec = build_spec
        self.op_kwargs = op_kwargs or {}
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self._handle: dict[str, Any] | None = None

    # -- execute -----------------------------------------------------------------------------
    def execute(self, context: Any) -> dict[str, Any]:
        spec = self._prepare(context)
        backend = get_backend(spec.backend)
        self._handle = backend.submit(spec)
        verb = "Reattached to" if self._handle.get("reattached") else "Submitted"
        self.log.info("%s %s job %s on backend %s", verb, spec.stage, spec.name, spec.backend)
        run_id = spec.env.get("MLFLOW_RUN_ID", "")
        deadline = time.time() + spec.max_run_seconds
        if self.deferrable:
            from llmops.triggers.job import JobTrigger

            self.defer(trigger=JobTrigger(handle=self._handle, poll_interval=self.poll_interval,
                                          deadline=deadline,
                                          context={"stage": spec.stage, "mlflow_run_id": run_id,
                                                   "parent_run_id": spec.mlflow_parent_run_id}),
                       method_name="execute_complete")
        try:
            status = self._wait(backend, deadline)
        except BaseException:
            # Task timeout, SIGTERM, a crash of ours: never leave the job running unwatched.
            backend.stop(self._handle)
            raise
        return self._finish(context, status, spec.stage, run_id, spec.mlflow_parent_run_id)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        self._handle = handle = event["handle"]
        status = get_backend(handle["backend"]).status(handle)
        if event.get("state") == "timeout":
            status = JobStatus(JobState.STOPPED, event["message"])
        return self._finish(context, status, event["stage"], event["mlflow_run_id"],
                            event.get("parent_run_id", ""))

    def on_kill(self) -> None:
        if self._handle:
            self.log.info("Stopping job %s", self._handle["name"])
            get_backend(self._handle["backend"]).stop(self._handle)

    # -- helpers -----------------------------------------------------------------------------
    def _prepare(self, context: Any) -> JobSpec:
        try:
            raw = self.spec if self.build_spec is None else self.build_spec(**self.op_kwargs)
            spec = raw if isinstance(raw, JobSpec) else JobSpec.from_dict(raw)
        except (JobSpecError, ValueError) as exc:
            raise AirflowFailException(f"Invalid job spec for task {self.task_id}: {exc}") from exc
        ti = context["ti"]
        identity = {"dag_id": ti.dag_id, "run_id": ti.run_id, "task_id": ti.task_id,
                    "map_index": str(ti.map_index)}
        if not spec.name:
            content = hashlib.sha256(json.dumps(
                [spec.entrypoint, spec.argv, spec.config], sort_keys=True, default=str).encode()
            ).hexdigest()
            prefix = ti.task_id if ti.map_index < 0 else f"{ti.task_id}-{ti.map_index}"
            spec = spec.replace(name=job_name(*identity.values(), content, prefix=prefix))
        if spec.mlflow_parent_run_id:
            run_id = tracking.start_child_run(
                experiment=spec.mlflow_experiment, parent_run_id=spec.mlflow_parent_run_id,
                stage=spec.stage, identity=identity,
                tags={"try_number": str(ti.try_number), "backend": spec.backend,
                      "job_name": spec.name, **spec.tags})
            spec = spec.replace(env={**spec.env, "MLFLOW_RUN_ID": run_id,
                                     "MLFLOW_TRACKING_URI": tracking.tracking_uri(),
                                     "MLFLOW_EXPERIMENT_NAME": spec.mlflow_experiment})
        return spec

    def _wait(self, backend: Any, deadline: float) -> JobStatus:
        cursor = None
        while True:
            lines, cursor = backend.read_logs(self._handle, cursor)
            for line in lines:
                self.log.info("[job] %s", line)
            status = backend.status(self._handle)
            if status.state.terminal:
                lines, cursor = backend.read_logs(self._handle, cursor)
                for line in lines:
                    self.log.info("[job] %s", line)
                return status
            if time.time() > deadline:
                backend.stop(self._handle)
                return JobStatus(JobState.STOPPED, "the job ran past its max_run_seconds and was stopped")
            time.sleep(self.poll_interval)

    def _finish(self, context: Any, status: JobStatus, stage: str, mlflow_run_id: str,
                parent_run_id: str = "") -> dict[str, Any]:
        name = self._handle["name"]
        if status.state is JobState.SUCCEEDED:
            result = dict(status.result or {})
            result.update(job_name=name, backend=self._handle["backend"], mlflow_run_id=mlflow_run_id)
            if mlflow_run_id:
                tracking.end_run(mlflow_run_id, "FINISHED")
            metrics = result.get("metrics", {})
            self.log.info("%s job %s succeeded: %s", stage, name,
                          ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                    for k, v in sorted(metrics.items())))
            return result
        if mlflow_run_id:
            tracking.end_run(mlflow_run_id, "KILLED" if status.state is JobState.STOPPED else "FAILED")
        if parent_run_id and context["ti"].try_number > self.retries:
            # The last try failed: the lifecycle run as a whole has failed, say so in MLflow.
            tracking.end_run(parent_run_id, "FAILED")
        tail = get_backend(self._handle["backend"]).read_logs(self._handle, 0)[0][-LOG_TAIL_LINES:]
        raise AirflowException(
            f"{stage} job {name} {status.state.value}: {status.message}.\n"
            f"Last lines of its log:\n" + "\n".join(tail))
