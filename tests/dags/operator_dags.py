"""DAGs that exercise JobOperator on the sample job: run with `airflow dags test -f THIS_FILE`."""

import pendulum
from airflow.sdk import DAG

from llmops.operators.job import JobOperator

for dag_id, deferrable, config in [
    ("job_operator_worker", False, {"seconds": 0.5}),
    ("job_operator_deferred", True, {"seconds": 0.5}),
    ("job_operator_failing", False, {"exit_code": 5}),
]:
    with DAG(dag_id, schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
             default_args={"retries": 0}) as dag:
        JobOperator(task_id="sample", deferrable=deferrable, poll_interval=0.2,
                    spec={"stage": "sample", "entrypoint": "tests.sample_job", "config": config})
    globals()[dag_id] = dag
