"""The DAG run's note: one line (recipe, key metric, gate outcome) on the run in the Airflow UI.

A task cannot write its DAG run's note (the Task SDK has no setter, and the REST API would need
a user's credentials in every task). So the promote task leaves the line as the XCom `run_note`
(llmops.stages.run_summary_text.note_line), or a pretraining paused on request leaves "paused at
step N of M" with the conf that resumes it (llmops.airflow.operators.job_pause), and this listener,
loaded by the scheduler with the project's plugins, copies it onto the run when the run finishes, in
the scheduler's own transaction. A note someone already wrote is kept.

A run of such a DAG that failed before promote gets the failure line instead (`Failure.line`).
A run its first task refused (a misspelled Param, an impossible combination: start_run checks
every input before any job) quotes the refusal, which that task leaves as the XCom `refusal`
(llmops.stages.run_summary.REFUSAL_XCOM) before it fails: "refused at start_run: Unknown Param
'pretrain_step' ... (did you mean 'pretrain_steps'?)", the Param and the fix, not only the
task's name. Any other failure names the task that failed first (by end time: the others
mostly failed because of it) and, when the scheduler failed it itself, what the scheduler
reported. That report is the only trace of a task whose process died before the task ran: its
own log stops after "Pre Execute" with no error, and the scheduler records the executor's
"finished with state failed, but the task instance's state attribute is queued" only in its
output and the audit log. A job task whose chain ran several attempts left them as its XCom
(llmops.infra.tracking.ATTEMPTS_XCOM): the line says why each ended. The run page shows the same
line.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from llmops.infra.tracking import ATTEMPTS_XCOM
from llmops.stages.run_summary import NOTE_XCOM as NOTE_KEY
from llmops.stages.run_summary import REFUSAL_XCOM

log = logging.getLogger(__name__)

NOTE_TASK = "promote"
# The tasks that may leave a note line, the first found wins: the gate's, or a paused pretraining's.
NOTE_TASKS = (NOTE_TASK, "pretrain")
NOTE_LIMIT = 1000  # Airflow's dag_run_note.content column
# Audit-log events the scheduler writes when it fails (or gives up on) a task instance itself,
# rather than the task reporting its own failure (airflow/jobs/scheduler_job_runner.py).
SCHEDULER_EVENTS = ("state mismatch", "heartbeat timeout", "stuck in queued tries exceeded")
NEVER = dt.datetime.max.replace(tzinfo=dt.timezone.utc)

try:
    from airflow.listeners import hookimpl
except ImportError:  # pragma: no cover - not in an Airflow environment (a job image)
    hookimpl = None


@dataclass
class Failure:
    """The task instance of a run that failed first, and what else failed after it."""

    task: str                      # task_id, with [map_index] for a mapped one
    try_number: int
    event: str | None = None       # the scheduler's audit-log event, when it failed the task itself
    reported: str | None = None    # and its own words
    others: list[str] = field(default_factory=list)
    refusal: str | None = None     # the task refused the run's input: its message (XCom `refusal`)
    attempts: list[dict[str, Any]] = field(default_factory=list)  # its chain's ended attempts

    def line(self) -> str:
        if self.refusal:
            # The message names the Param and the fix; the tasks downstream were only skipped.
            return f"refused at {self.task}: {self.refusal}"[:NOTE_LIMIT]
        text = f"failed at {self.task}"
        if self.reported:
            text += f" (try {self.try_number}): {_plainly(self.event, self.reported)}; " \
                    f"the scheduler reported: {self.reported}"
        if self.attempts:
            text += f" after {len(self.attempts)} attempt{'s' if len(self.attempts) > 1 else ''}: " \
                    + attempts_line(self.attempts)
        if self.others:
            text += f"; later failed: {', '.join(self.others)}"
        return text[:NOTE_LIMIT]


def attempts_line(attempts: list[dict[str, Any]]) -> str:
    """'1 ended by capacity (CapacityError: ...), 2 failed (AlgorithmError: ...)'"""
    return ", ".join(f"{a.get('attempt', '?')} "
                     + (f"ended by {a['why']}" if a.get("why") else str(a.get("state") or "ended"))
                     + (f" ({_short(a['message'])})" if a.get("message") else "") for a in attempts)


def _short(text: str, limit: int = 90) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _plainly(event: str | None, reported: str) -> str:
    """What the scheduler's report means, for someone who has not read its source."""
    if event == "state mismatch":  # the executor's "finished" while the TI had not started
        return ("its process ended before the task ran"
                if re.search(r"state attribute is (queued|scheduled)\b", reported)
                else "its process ended without the task reporting an outcome")
    return {"heartbeat timeout": "it stopped sending heartbeats",
            "stuck in queued tries exceeded": "it never left the queue"}.get(event or "", event or "")


def pending_note(dag_run, session) -> str | None:
    """The line the promote task (or a paused pretrain task) left for this run, if any."""
    for task_id in NOTE_TASKS:
        value = _xcom(dag_run, session, task_id, NOTE_KEY)
        if value:
            return str(value)
    return None


def _xcom(dag_run, session, task_id: str, key: str, map_index: int | None = None) -> Any:
    from airflow.models.xcom import XComModel

    query = XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_run.dag_id, task_ids=task_id,
                               key=key, map_indexes=map_index, limit=1)
    row = session.scalars(query).first() if query is not None else None
    return XComModel.deserialize_value(row) if row is not None else None


def refusal(dag_run, session, task_id: str) -> str | None:
    """What the task refused the run for (its XCom `refusal`), if it refused it."""
    value = _xcom(dag_run, session, task_id, REFUSAL_XCOM)
    return " ".join(str(value).split()) if value else None


def _label(ti: Any) -> str:
    return ti.task_id + (f"[{ti.map_index}]" if ti.map_index is not None and ti.map_index >= 0 else "")


def first_failure(dag_run, session) -> Failure | None:
    """The run's failed task instance with the earliest end (a retried task counts once, by its
    last try), with the scheduler's report on that try if the scheduler failed it; None if no
    task instance of the run has failed."""
    from sqlalchemy import select

    from airflow.models.log import Log
    from airflow.utils.state import TaskInstanceState

    failed = dag_run.get_task_instances(state=[TaskInstanceState.FAILED], session=session)
    if not failed:
        return None
    # No end date sorts last (not expected of a failed TI); the task id breaks ties.
    failed.sort(key=lambda ti: (ti.end_date or NEVER, ti.task_id, ti.map_index))
    first = failed[0]
    report = session.execute(
        select(Log.event, Log.extra)
        .where(Log.dag_id == first.dag_id, Log.run_id == first.run_id, Log.task_id == first.task_id,
               Log.map_index == first.map_index, Log.try_number == first.try_number,
               Log.event.in_(SCHEDULER_EVENTS))
        .order_by(Log.dttm.desc(), Log.id.desc()).limit(1)).first()
    event, message = report if report else (None, None)
    return Failure(task=_label(first), try_number=first.try_number, event=event,
                   reported=" ".join(message.split()) if message else None,
                   others=[_label(ti) for ti in failed[1:]],
                   refusal=refusal(dag_run, session, first.task_id) if not report else None,
                   attempts=list(_xcom(dag_run, session, first.task_id, ATTEMPTS_XCOM,
                                       first.map_index) or []))


def airflow_run(dag_id: str, run_id: str) -> dict[str, Any] | None:
    """The DAG run as Airflow's metadata DB has it, for the run page: {state, note, failure,
    refusal}, or None when Airflow has no such run. Read from the API server's own DB session."""
    from sqlalchemy import select

    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        dag_run = session.scalars(select(DagRun).where(DagRun.dag_id == dag_id,
                                                       DagRun.run_id == run_id)).first()
        if dag_run is None:
            return None
        failure = first_failure(dag_run, session)
        return {"state": str(dag_run.state), "note": dag_run.note,
                "failure": failure.line() if failure else None,
                "refusal": {"task": failure.task, "message": failure.refusal}
                if failure and failure.refusal else None}


def set_note(dag_run, failed: bool) -> None:
    from sqlalchemy import inspect
    from sqlalchemy.orm import object_session

    dag = getattr(dag_run, "dag", None)
    session = object_session(dag_run)
    if session is None:
        # `airflow dags test` hands the listener its run detached (its task runs close the
        # thread's scoped session, which held it). That scoped session is the one dag.test
        # commits right after, so the note goes on the run as stored, through it.
        from airflow import settings
        from airflow.models.dagrun import DagRun

        identity = inspect(dag_run).identity
        session = settings.Session()
        dag_run = session.get(DagRun, identity[0]) if identity else None
        if dag_run is None:
            return
    if dag_run.note:
        return
    note = pending_note(dag_run, session)
    ours = dag is not None and NOTE_TASK in getattr(dag, "task_ids", ())
    if note is None and failed and ours:  # only runs of DAGs with a promote task
        failure = first_failure(dag_run, session)
        note = failure.line() if failure else None
    if note:
        dag_run.note = note[:NOTE_LIMIT]
        log.info("DAG run %s %s: note %r", dag_run.dag_id, dag_run.run_id, note)


if hookimpl is not None:
    @hookimpl
    def on_dag_run_success(dag_run, msg: str) -> None:
        try:
            set_note(dag_run, failed=False)
        except Exception:  # a note is never worth a scheduler error
            log.exception("could not set the note of %s", dag_run.run_id)

    @hookimpl
    def on_dag_run_failed(dag_run, msg: str) -> None:
        try:
            set_note(dag_run, failed=True)
        except Exception:
            log.exception("could not set the note of %s", dag_run.run_id)
