"""Small DAGs for the fault matrix (tests/chaos/matrix.py): one JobOperator on SageMaker
(`pretrain`) and one on AWS Batch (`finetune`), side by side, each running
`tests.chaos.numbered_job` (one numbered line a second) for `params.seconds`, so that a fault
lands while the job runs.

- `chaos_remote`: both deferred (the triggerer waits, as on MWAA with deferrable operators);
- `chaos_remote_worker`: both waited for in the worker (the task holds a worker slot throughout).
- `chaos_hyperpod`: one deferred JobOperator, `train`, on HyperPod (a HyperPodPyTorchJob through
  the Kubernetes API of tests/chaos/fake_eks.py, served over HTTP by tests/chaos/fake_eks_http.py);
- `chaos_hyperpod_worker`: the same, waited for in the worker.

Params: `seconds` (job length), `exit_code` (non-zero: the job fails with it),
`max_run_seconds` (each attempt's MaxRuntime; the operator's next attempt goes on past it),
`settings_overrides` (backend settings for the run's jobs: spot, max_queue_seconds). The job
checkpoints its line every 5 lines in the run's storage and a new attempt resumes from there. Retries 2, 5 s
apart: a row's fault (a killed worker, a job failed on the service side) takes one, and a try
that dies before it runs (its start call to the execution API timing out on busy cores, seen on
PostgreSQL at load 17) must not leave the fault's try without its retry.
"""

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, Param

from llmops.airflow.operators.job_operator import JobOperator

PARAMS = {"seconds": Param(40, type="number", minimum=0),
          "exit_code": Param(0, type="integer", minimum=0, maximum=255),
          "max_run_seconds": Param(900, type="integer", minimum=1),
          # backend settings for this run's jobs ({"SageMakerSettings": {"spot": true}, ...})
          "settings_overrides": Param({}, type="object")}
# The label tells the matrix which task instance submitted a job (tests/chaos/numbered_job.py).
# output_dir and checkpoint_uri empty: the backend puts them in the run's storage (staging), where
# every attempt of the task's job, on whatever node, finds the checkpoints.
CONFIG = {"seconds": "{{ params.seconds }}", "exit_code": "{{ params.exit_code }}",
          "label": "{{ dag.dag_id }}/{{ run_id }}/{{ ti.task_id }}",
          "output_dir": "", "checkpoint_uri": ""}
ENTRYPOINT = "tests.chaos.numbered_job"
TASKS = [("pretrain", "sagemaker", "ml.g5.2xlarge"), ("finetune", "batch", "p4d.24xlarge")]

HYPERPOD_TASKS = [("train", "hyperpod", "ml.g5.2xlarge")]

for dag_id, deferrable, tasks in [("chaos_remote", True, TASKS), ("chaos_remote_worker", False, TASKS),
                                  ("chaos_hyperpod", True, HYPERPOD_TASKS),
                                  ("chaos_hyperpod_worker", False, HYPERPOD_TASKS)]:
    with DAG(dag_id, schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
             catchup=False, params=PARAMS, render_template_as_native_obj=True,
             max_active_runs=16, tags=["chaos", "test"],
             default_args={"retries": 2, "retry_delay": timedelta(seconds=5)}) as dag:
        for task_id, backend, instance_type in tasks:
            JobOperator(task_id=task_id, deferrable=deferrable, poll_interval=2.0,
                        spec={"stage": "sample", "entrypoint": ENTRYPOINT, "config": CONFIG,
                              "backend": backend, "instance_type": instance_type,
                              "max_run_seconds": "{{ params.max_run_seconds }}",
                              "settings_overrides": "{{ params.settings_overrides }}"})
    globals()[dag_id] = dag
