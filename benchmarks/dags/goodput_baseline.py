"""The goodput benchmark's baseline (benchmarks/pretrain_goodput.py): the pretraining job with its
in-job supervision off, recovered from each fault only by Airflow's task retries, as a DAG
without a supervisor would be.

One JobOperator on the local backend (waited for in the worker, as local jobs are). Its retries
wait `retry_delay`: Airflow's default, `[core] default_task_retry_delay` (300 s), unless
$LLMOPS_BENCH_RETRY_DELAY says otherwise. Params: `config` (the TrainConfig as a dict) and
`faults` (the fault spec).
"""

import os
from datetime import timedelta

import pendulum
from airflow.sdk import DAG, Param

from llmops.operators.job import JobOperator


def _retry_delay() -> timedelta:
    if os.environ.get("LLMOPS_BENCH_RETRY_DELAY"):
        return timedelta(seconds=float(os.environ["LLMOPS_BENCH_RETRY_DELAY"]))
    from airflow.configuration import conf

    return timedelta(seconds=conf.getfloat("core", "default_task_retry_delay"))


with DAG("bench_goodput_baseline", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
         catchup=False, render_template_as_native_obj=True, tags=["benchmark"],
         params={"config": Param({}, type="object"), "faults": Param("", type="string")}) as dag:
    JobOperator(task_id="pretrain", deferrable=False, poll_interval=2.0, retries=10,
                retry_delay=_retry_delay(),
                spec={"stage": "pretrain", "entrypoint": "tasks.pretrain", "backend": "local",
                      "config": "{{ params.config }}", "argv": ["--faults", "{{ params.faults }}"],
                      "max_run_seconds": 6 * 3600})
