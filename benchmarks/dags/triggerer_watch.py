"""benchmarks/triggerer_watch.py --airflow N: N timed jobs (SageMaker, Batch and HyperPod in
turn, from tests/chaos/ simulators) as N mapped JobOperator tasks that submit and defer to the
triggerer, as a sweep's trials do.

Param `jobs`: [{"backend", "end_at", "exit_code"}]: each job's backend, the moment it ends (epoch
seconds: the simulators' SIM_END_AT) and its exit code (SIM_EXIT_CODE).
"""

import pendulum
from airflow.sdk import DAG, Param, task

from llmops.airflow.operators.job_operator import JobOperator

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llmops:bench"
INSTANCES = {"sagemaker": ("ml.m5.xlarge", 1), "batch": ("m5.xlarge", 2), "hyperpod": ("ml.g5.2xlarge", 2)}

with DAG("bench_triggerer_watch", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
         catchup=False, render_template_as_native_obj=True, tags=["benchmark"],
         max_active_tasks=2000, params={"jobs": Param([], type="array")}) as dag:

    @task
    def specs(params=None) -> list[dict]:
        return [{"stage": "bench", "entrypoint": "benchmarks.timed_job", "backend": job["backend"],
                 "image": IMAGE, "instance_type": INSTANCES[job["backend"]][0],
                 "instance_count": INSTANCES[job["backend"]][1], "max_run_seconds": 3600,
                 "env": {"SIM_END_AT": f"{job['end_at']:.3f}", "SIM_EXIT_CODE": str(job["exit_code"])}}
                for job in params["jobs"]]

    JobOperator.partial(task_id="job", deferrable=True, retries=0).expand(spec=specs())
