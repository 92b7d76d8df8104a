"""The DAG run's note: one line (recipe, key metric, gate outcome) on the run in the Airflow UI.

A task cannot write its DAG run's note (the Task SDK has no setter, and the REST API would need
a user's credentials in every task). So the promote task leaves the line as the XCom `run_note`
(llmops.run_summary.note_line) and this listener, loaded by the scheduler with the project's
plugins, copies it onto the run when the run finishes, in the scheduler's own transaction. A run
of such a DAG that failed before promote gets "failed at <tasks>". A note someone already wrote is kept.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

from llmops.run_summary import NOTE_XCOM as NOTE_KEY

NOTE_TASK = "promote"

try:
    from airflow.listeners import hookimpl
except ImportError:  # pragma: no cover - not in an Airflow environment (a job image)
    hookimpl = None


def pending_note(dag_run, session) -> str | None:
    """The line the promote task left for this run, if any."""
    from sqlalchemy import select

    from airflow.models.xcom import XComModel

    query = XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_run.dag_id, task_ids=NOTE_TASK,
                               key=NOTE_KEY, limit=1)
    row = session.scalars(query).first() if query is not None else None
    if row is None:
        return None
    value = XComModel.deserialize_value(row)
    return str(value) if value else None


def _failed_tasks(dag_run, session) -> list[str]:
    from airflow.utils.state import TaskInstanceState

    tis = dag_run.get_task_instances(state=[TaskInstanceState.FAILED,
                                            TaskInstanceState.UPSTREAM_FAILED], session=session)
    return sorted({ti.task_id for ti in tis if ti.state == TaskInstanceState.FAILED})


def set_note(dag_run, failed: bool) -> None:
    from sqlalchemy.orm import object_session

    session = object_session(dag_run)
    if session is None or dag_run.note:
        return
    note = pending_note(dag_run, session)
    dag = getattr(dag_run, "dag", None)
    ours = dag is not None and NOTE_TASK in getattr(dag, "task_ids", ())
    if note is None and failed and ours:  # only runs of DAGs with a promote task
        tasks = _failed_tasks(dag_run, session)
        note = f"failed at {', '.join(tasks)}" if tasks else None
    if note:
        dag_run.note = note[:1000]
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
