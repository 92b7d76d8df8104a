"""A JobOperator whose job logs to an MLflow parent run, for the extra links test
(tests/test_links.py): run with `airflow dags test job_links_local`."""

import pendulum
from airflow.sdk import DAG

from llmops.airflow.operators.job_operator import JobOperator

with DAG("job_links_local", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
         default_args={"retries": 0}) as job_links_local:
    JobOperator(task_id="sample", deferrable=False, poll_interval=0.2,
                spec={"stage": "sample", "entrypoint": "tests.sample_job",
                      "config": {"seconds": 0.2}, "mlflow_experiment": "links-test",
                      "mlflow_parent_run_id": "{{ var.value.get('links_parent_run', '') }}"})
