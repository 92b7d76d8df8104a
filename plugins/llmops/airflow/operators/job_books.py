"""JobOperator's bookkeeping: the job ledger's rows (llmops.infra.ledger), the task's extra links
(llmops.airflow.operators.links) and the end of its MLflow child run. Best effort throughout: none
of it decides the task.

JobBooks is mixed into llmops.airflow.operators.job_operator.JobOperator.
"""

from __future__ import annotations

import time
from typing import Any

from llmops.airflow.operators import links
from llmops.airflow.operators.job_identity import JobIdentity
from llmops.infra import ledger, tracking
from llmops.infra.ledger.events import image_digest
from llmops.jobs.backends import Backend, JobStatus
from llmops.jobs.spec import JobSpec, cost_allocation_tags


class JobBooks:
    """Mixed into JobOperator: needs its `_handle`, `_ti`, `_run_id`, `_parent_run_id`,
    `_ledger_job`, `_started_at`, `_chain` and `retries`."""

    # -- the job ledger: best effort (llmops.infra.ledger never raises) ----------------------------
    def _record_start(self, backend: Backend, spec: JobSpec, record: dict[str, Any],
                      event: str | None = None) -> None:
        handle, ti = self._handle or {}, self._ti
        self._ledger_job = {
            "job_name": spec.name, "attempt": int(handle.get("attempt") or 1),
            "spec_hash": JobIdentity(spec, backend.fingerprint(spec)).spec_hash, "stage": spec.stage,
            "backend": spec.backend, "service_job_name": str(handle.get("job_name") or spec.name),
            "image": str(handle.get("image") or spec.image),
            "team": cost_allocation_tags(spec)["team"], "dag_id": ti.dag_id, "run_id": ti.run_id,
            "task_id": ti.task_id, "map_index": int(ti.map_index), "try_number": int(ti.try_number),
            "instance_type": str(handle.get("instance_type") or spec.instance_type),
            "instance_count": int(handle.get("instance_count") or spec.instance_count),
            "submitted_at": record.get("submitted_at"), "mlflow_run_id": self._run_id}
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

    def _push_links(self, mlflow_run_id: str, extra: dict[str, str] | None = None) -> None:
        """The task's extra links, as soon as the job's handle is known (links.py), with `extra`
        ({link name: URL}); the MLflow run's URL also goes to the task log."""
        mlflow_run = ""
        if mlflow_run_id:
            try:
                mlflow_run = tracking.run_url(mlflow_run_id)
                self.log.info("MLflow run: %s", mlflow_run)
            except Exception as exc:  # noqa: BLE001 - a link is never worth failing the task
                self.log.warning("Could not build the MLflow run's URL: %s", exc)
        try:
            links.push_links(self._ti, {**links.links_for(self._handle or {}, mlflow_run),
                                       **(extra or {})})
        except Exception as exc:  # noqa: BLE001
            self.log.warning("Could not store the task's links: %s", exc)

    # -- the MLflow child run (and the lifecycle's parent run on the last try) --------------
    def _mark_waiting(self, watch: Any) -> None:
        """The job's wait in its service's queue (or its start after one) on its MLflow run."""
        try:
            tracking.mark_waiting(self._run_id, watch.waiting, watch.submitted_at, watch.started_at)
        except Exception as exc:  # noqa: BLE001 - MLflow being down must not decide the task
            self.log.warning("Could not record the job's wait on MLflow run %s: %s", self._run_id, exc)

    def _record_attempt(self, status: JobStatus, why: str | None, stop: str) -> None:
        """An attempt of the chain ended: on the MLflow run (the run page lists them) and in the
        chain, which the task leaves as its XCom tracking.ATTEMPTS_XCOM (the run's note quotes it)."""
        handle = self._handle or {}
        attempt = {"attempt": int(self._chain.get("attempts", 1)),
                   "job": str(handle.get("job_name") or handle.get("name") or ""),
                   "state": status.state.value, "why": why or "", "message": _words(status),
                   "stopped_chain": stop, "ended_at": round(time.time(), 3)}
        self._chain["ended"] = [*self._chain.get("ended", []), attempt][-tracking.ATTEMPTS_KEPT:]
        try:
            self._ti.xcom_push(tracking.ATTEMPTS_XCOM, self._chain["ended"])
        except Exception as exc:  # noqa: BLE001
            self.log.warning("Could not leave the attempts as an XCom: %s", exc)
        try:
            tracking.record_attempt(self._run_id, attempt)
        except Exception as exc:  # noqa: BLE001
            self.log.warning("Could not record the attempt on MLflow run %s: %s", self._run_id, exc)

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


def _words(status: JobStatus) -> str:
    """Everything the service said about the end: the message, and the reason and secondary
    status it gives apart (Batch's statusReason: `Host EC2 (instance ...) terminated.`)."""
    details = status.details or {}
    extra = [str(details[k]) for k in ("reason", "secondary")
             if details.get(k) and str(details[k]) not in status.message]
    return ": ".join([status.message, *extra])
