"""The chain of attempts of one try (llmops.jobs.continuation): when a job ends for a reason
the next attempt fixes (a lost node, capacity), JobOperator submits the next attempt from the
newest checkpoint, within `max_attempts` and `run_deadline_hours`.

A chain must make progress: the newest committed checkpoint step in the job's storage
(`Backend.checkpoint_step`) is read when the chain's first attempt is submitted and when each
attempt ends. An attempt that ran and ended without a newer checkpoint than the one it started
from made no progress (it hung before its first save, failed at restore, or was ended sooner
than its checkpoint interval); after `max_stalled_attempts` such attempts in a row the chain
stops and the task fails without Airflow retries, since the next attempt would start from the
same checkpoint and end the same way. Attempts ended by a capacity error never ran, and those
whose host was lost or whose spot capacity was reclaimed were ended by the fleet, however early
(a new attempt runs on other hardware): they are not judged; nor is one whose progress cannot be
read (storage unreadable, a job an earlier try started).

JobChain is mixed into llmops.airflow.operators.job_operator.JobOperator.
"""

from __future__ import annotations

import os
import time
from typing import Any

from llmops.jobs import continuation, env_secrets
from llmops.jobs.backends import JobStatus
from llmops.jobs.backends.base import NO_CHECKPOINT

LOG_TAIL_LINES = 40
DEFAULT_MAX_STALLED_ATTEMPTS = 2


# Ends of an attempt that are the fleet's doing, not the job's (llmops.jobs.continuation's reasons):
# no sign that the next attempt would stall the same way.
FLEET_ENDS = frozenset({"capacity", "host", "spot"})


def max_stalled_attempts_setting(value: Any) -> int:
    """JobOperator's `max_stalled_attempts`, checked: an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"JobOperator max_stalled_attempts must be an integer >= 1 (attempts in a "
                         f"row without a newer checkpoint before the chain stops), got {value!r}.")
    return value


def _step_text(step: int | None) -> str:
    return "no checkpoint" if step is None or step == NO_CHECKPOINT else f"checkpoint step {step}"


class JobChain:
    """Mixed into JobOperator: needs its `_chain`, `max_attempts`, `max_stalled_attempts`,
    `run_deadline_hours`, `_prepare`, `_watch`, `_finish`, `_save` and `_defers_backend` (JobWait), and `_backend(name)`."""

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

    def _checkpoint_step(self) -> int | None:
        """The newest committed checkpoint step of the job's storage; None when unknown."""
        handle = self._handle or {}
        try:
            return self._backend(handle["backend"]).checkpoint_step(handle)
        except Exception as exc:  # noqa: BLE001 - unknown progress is not judged, never fatal
            self.log.warning("Could not read the newest checkpoint of job %s (%s: %s): this "
                             "attempt's progress is not judged.", handle.get("name"),
                             type(exc).__name__, exc)
            return None

    def _chain_begins(self) -> None:
        """The checkpoint the chain's first attempt starts from (unknown for a job an earlier
        try started: it may have saved since)."""
        if "from_step" not in self._chain:
            self._chain["from_step"] = (None if (self._handle or {}).get("reattached")
                                        else self._checkpoint_step())

    def _stalled(self, why: str) -> str:
        """Judge the attempt that just ended by `why`: the reason the chain stops for lack of
        progress, or ""."""
        chain = self._chain
        start, end = chain.get("from_step"), self._checkpoint_step()
        chain["from_step"] = end   # where the next attempt starts
        if why in FLEET_ENDS or start is None or end is None:
            return ""   # the fleet ended it, or its progress is unknown: the streak stands
        if end > start:
            chain["stalled"] = []
            return ""
        chain["stalled"] = [*chain.get("stalled", []), {
            "attempt": int(chain.get("attempts", 1)), "why": why, "from_step": start,
            "job": str((self._handle or {}).get("job_name") or (self._handle or {}).get("name"))}]
        if len(chain["stalled"]) < self.max_stalled_attempts:
            return ""
        chain["no_progress"] = True
        stalled = chain["stalled"]
        where = (self._handle or {}).get("checkpoint_uri") or "the job's checkpoint storage"
        each = "; ".join(f"attempt {s['attempt']} ({s['job']}, ended by {s['why']}) started from "
                         f"{_step_text(s['from_step'])}" for s in stalled)
        return (f"{len(stalled)} attempts in a row made no progress (max_stalled_attempts "
                f"{self.max_stalled_attempts}): {each}, and none saved a newer checkpoint in "
                f"{where}. The next attempt would start from the same {_step_text(end)} and end "
                "the same way, so this try stops without retries. Check the attempts' logs (the "
                "last lines below): a hang or an error before the first checkpoint save (data "
                "loading, a collective that never completes), a failure while restoring "
                f"{_step_text(end)} (damaged or incompatible: delete that step_* directory, or "
                "trigger with force_rerun to start from scratch), or a checkpoint interval longer "
                "than the job's max_run_seconds or the time a spot instance lasts. Clearing the "
                "task starts a new chain.")

    def _chain_exhausted(self, why: str = "") -> str:
        """Why no further attempt may start after one ended by `why` ("" when one may)."""
        stalled = self._stalled(why)
        if stalled:
            return stalled
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
        newest = chain.get("from_step")
        self.log.warning("Attempt %d (%s) ended: %s (%s). Attempt %d goes on from the newest "
                         "checkpoint%s%s.", chain["attempts"], (self._handle or {}).get("job_name"),
                         why, status.message, chain["attempts"] + 1,
                         "" if newest is None else f" ({_step_text(newest)})",
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
