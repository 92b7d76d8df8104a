"""One `llm_lifecycle` run in which some tasks' processes die before the task runs, for real:

    python -m tests.dying_tasks '{"recipe": "tiny"}' start_run     # only start_run's die
    python -m tests.dying_tasks '{"recipe": "tiny"}' start_run '*' # that, then a run where all do

The loop is `airflow dags test --use-executor`'s (Dag.test): `DagRun.update_state` schedules, the
scheduler's own `SchedulerJobRunner.process_executor_events` takes the executor's reports, and
the plugin's listener notes the run when it ends. A dying task goes to a real LocalExecutor
whose workers reach the execution API at a port nothing listens on (run this with
AIRFLOW__CORE__EXECUTION_API_SERVER_URL pointing there): the worker's supervisor forks the task
process, cannot start the task instance, and reports failed while the TI is still queued, which is
what `make up` on other ports did to every task before up.py set the base URL. Every other task
runs in this process against the in-process execution API, as `airflow dags test` runs them.
Prints one JSON line per run: {"dying": ..., "run_id": ...}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

DAG_ID = "llm_lifecycle"
TIMEOUT_S = 300


def _sync_dags(session):
    """The DAGs folder's bundle into the metadata DB, as Dag.test does before a run; its DAG."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import BundleDagBag, sync_bag_to_db

    manager = DagBundlesManager()
    manager.sync_bundles_to_db(session=session)
    session.commit()
    for bundle in manager.get_all_dag_bundles():
        if not bundle.is_initialized:
            bundle.initialize()
        bag = BundleDagBag(dag_folder=bundle.path, bundle_path=bundle.path, bundle_name=bundle.name)
        sync_bag_to_db(bag, bundle.name, bundle.version)
        if DAG_ID in bag.dags:
            return bag.dags[DAG_ID]
    raise LookupError(f"no bundle has {DAG_ID}")


def run(conf: dict, dying: str, dag=None) -> str:
    """One DAG run with `conf` in which the processes of task `dying` ('*': every task) die;
    its run id. `dag`: the SDK DAG already synced to the DB (else synced here)."""
    from sqlalchemy import select

    from airflow import settings
    from airflow.executors import workloads
    from airflow.callbacks.database_callback_sink import DatabaseCallbackSink
    from airflow.executors.local_executor import LocalExecutor
    from airflow.jobs.scheduler_job_runner import SchedulerJobRunner
    from airflow.models.dagbag import DBDagBag
    from airflow.models.dagrun import DagRun
    from airflow.sdk import timezone
    from airflow.sdk.definitions.dag import _run_task
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.state import DagRunState, TaskInstanceState
    from airflow.utils.types import DagRunTriggeredByType, DagRunType

    settings.configure_orm()
    session = settings.Session()
    dag = dag or _sync_dags(session)
    now = timezone.utcnow()
    # (Dag.test's get_or_create_dagrun would delete every earlier run without a logical date.)
    scheduler_dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    run_id = DagRun.generate_run_id(run_type=DagRunType.MANUAL, logical_date=None, run_after=now)
    dag_run: DagRun = scheduler_dag.create_dagrun(
        run_id=run_id, logical_date=None, data_interval=None, run_after=now, conf=conf,
        run_type=DagRunType.MANUAL, state=DagRunState.RUNNING, triggered_by=DagRunTriggeredByType.TEST,
        triggering_user_name="dying_tasks", start_date=now, session=session)
    session.commit()
    executor = LocalExecutor(parallelism=1)
    # Where the scheduler puts a failed task's callback requests (the DAGs' on_failure_callback
    # alert), as SchedulerJobRunner sets it up: the dag-processor would run them.
    executor.callback_sink = DatabaseCallbackSink()
    executor.start()
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while dag_run.state == DagRunState.RUNNING:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{dag_run.run_id} still running after {TIMEOUT_S}s")
            # A task run in this process ends the scoped session, detaching what it held: fetch
            # the run again each round, or the listener would get a run with no session to note.
            session = settings.Session()
            dag_run = session.scalars(select(DagRun).where(DagRun.run_id == run_id)).one()
            dag_run.dag = scheduler_dag
            schedulable, _ = dag_run.update_state(session=session)
            for ti in schedulable:
                ti.try_number += 1
                ti.state = TaskInstanceState.SCHEDULED
                ti.scheduled_dttm = timezone.utcnow()
            session.commit()
            for ti in dag_run.get_task_instances(state=[TaskInstanceState.SCHEDULED], session=session):
                if dying in ("*", ti.task_id):
                    executor.queue_workload(workloads.ExecuteTask.make(
                        ti, dag_rel_path=Path(dag.fileloc), generator=executor.jwt_generator,
                        bundle_info=workloads.BundleInfo(name="dags-folder")), session=session)
                    ti.state = TaskInstanceState.QUEUED
                    session.commit()
                else:
                    _run_task(ti=ti, task=dag.task_dict[ti.task_id])
            executor.heartbeat()
            session.expire_all()
            SchedulerJobRunner.process_executor_events(
                executor=executor, job_id=None, scheduler_dag_bag=DBDagBag(), session=session)
            session.commit()
            time.sleep(0.5)
    finally:
        executor.end()
    return run_id


def main(conf: dict, dying: list[str]) -> None:
    from airflow import settings

    settings.configure_orm()
    dag = _sync_dags(settings.Session())
    for who in dying:  # one process for all: imports and the DAG sync are paid once
        print(json.dumps({"dying": who, "run_id": run(conf, who, dag)}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2:])
