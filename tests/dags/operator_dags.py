"""DAGs that exercise JobOperator on the sample job: run with `airflow dags test -f THIS_FILE`."""

from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from llmops.airflow.operators.job_operator import JobOperator

PRINTED_SECRETS = ["AWS_SECRET_ACCESS_KEY", "WAREHOUSE_PASSWORD", "AIRFLOW_CONN_WAREHOUSE"]

for dag_id, deferrable, config, timeout in [
    ("job_operator_worker", False, {"seconds": 0.5}, None),
    ("job_operator_deferred", True, {"seconds": 0.5}, None),
    ("job_operator_failing", False, {"exit_code": 5}, None),
    # Prints planted secrets of the worker's environment: the task log must show *** (test_secrets).
    ("job_operator_prints_secrets", False, {"print_env": PRINTED_SECRETS}, None),
    ("job_operator_prints_secrets_deferred", True, {"print_env": PRINTED_SECRETS}, None),
    # The task's own timeout must stop the job, not leave it running unwatched.
    ("job_operator_timeout", False, {"seconds": 120, "spawn_child": True,
                                     "marker_dir": "{{ var.value.get('marker_dir', '') }}"},
     timedelta(seconds=4)),
]:
    with DAG(dag_id, schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
             default_args={"retries": 0}) as dag:
        JobOperator(task_id="sample", deferrable=deferrable, poll_interval=0.2,
                    execution_timeout=timeout,
                    spec={"stage": "sample", "entrypoint": "tests.sample_job", "config": config})
    globals()[dag_id] = dag
