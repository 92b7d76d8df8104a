"""The chain of attempts of one try (llmops.jobs.continuation): when a job ends for a reason
the next attempt fixes (a lost node, capacity), JobOperator submits the next attempt from the
newest checkpoint, within `max_attempts` and `run_deadline_hours`.

JobChain is mixed into llmops.operators.job.JobOperator.
"""

from __future__ import annotations

import os
import time
from typing import Any

from llmops.jobs import continuation, env_secrets
from llmops.jobs.backends import JobStatus

LOG_TAIL_LINES = 40


class JobChain:
    """Mixed into JobOperator: needs its `_chain`, `max_attempts`, `run_deadline_hours`,
    `_prepare`, `_watch`, `_finish`, `_save` and `_defers_backend` (JobWait), and `_backend(name)`."""

    def _quote_tail(self, who: str) -> None:
        """The ended job's last lines in this log part, each as `<who> | <line>`."""
        try:
            tail = self._backend(self._handle["backend"]).log_tail(self._handle, LOG_TAIL_LINES)
        except Exception as exc:  # noqa: BLE001 - a log read must not stop the chain
            self.log.warning("Could not read the last lines of %s's log: %s: %s", who,
                             type(exc).__name__, exc)
            return
        self.log.info("The last %d lines of %s's log (its whole log stays in the service's "
                      "logs):", len(tail), who)
        for line in env_secrets.redact_lines(tail):
            self.log.info("%s | %s", who, line)

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
            if self._defers_backend(backend_name):
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
        backend = self._backend(spec.backend)
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
