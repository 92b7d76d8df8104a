"""The goodput benchmark's baselines (benchmarks/pretrain_goodput.py): the pretraining job as a
plain job (no supervisor, no spare, no spike guard), recovered from each fault only by Airflow's
task retries, as a DAG without our supervision would run it.

One DAG per retry_delay in $LLMOPS_BENCH_RETRY_DELAYS (seconds, comma-separated; default
Airflow's `[core] default_task_retry_delay`, 300 s): bench_goodput_baseline_retry<seconds>, each
one JobOperator on the local backend (waited for in the worker, as local jobs are). Params:
`config` (the TrainConfig as a dict) and `faults` (the fault spec).
"""

import os
from datetime import timedelta

import pendulum
from airflow.sdk import DAG, Param

from llmops.airflow.operators.job_operator import JobOperator


def _retry_delays() -> list[float]:
    if os.environ.get("LLMOPS_BENCH_RETRY_DELAYS"):
        return [float(x) for x in os.environ["LLMOPS_BENCH_RETRY_DELAYS"].split(",")]
    from airflow.configuration import conf

    return [conf.getfloat("core", "default_task_retry_delay")]


for _delay in _retry_delays():
    with DAG(f"bench_goodput_baseline_retry{_delay:g}", schedule=None,
             start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False,
             render_template_as_native_obj=True, tags=["benchmark"],
             params={"config": Param({}, type="object"), "faults": Param("", type="string")}) as dag:
        JobOperator(task_id="pretrain", deferrable=False, poll_interval=2.0, retries=10,
                    retry_delay=timedelta(seconds=_delay),
                    spec={"stage": "pretrain", "entrypoint": "tasks.pretrain", "backend": "local",
                          "config": "{{ params.config }}", "argv": ["--faults", "{{ params.faults }}"],
                          "max_run_seconds": 6 * 3600})
    globals()[dag.dag_id] = dag  # one module-level name per DAG, as the DAG processor finds them
