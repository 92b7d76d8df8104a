"""The lifecycle DAG end to end with its pretraining stage on SageMaker (moto), deferred.

SETUP    a moto server, the `llmops_backends` Variable and an AWS connection pointing at it.
BODY     1. The DAG runs; pretraining becomes a CreateTrainingJob request. moto marks the job
            Completed at once and runs nothing, so no result exists: the task fails, and its
            retry reattaches to the same job instead of creating a second one.
         2. The job's container runs as SageMaker would run it (tests/aws_fixtures.py): channels
            from S3, the image's entry, checkpoints synced back, outputs and result to S3.
         3. The same DAG run again: every stage reattaches to its job; pretraining's result comes
            back from S3, its model is copied to local storage, and the rest of the lifecycle
            (fine-tuning, distillation, evaluation, promotion) runs on it.
TEARDOWN the moto server stops with the session; the Variable is removed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from llmops.infra.aws.validation import validate_request
from tests.aws_fixtures import run_training_container, sagemaker_settings

BUCKET = "llmops-e2e"
LOGICAL_DATE = "2026-03-01T00:00:00+00:00"


@pytest.fixture()
def sagemaker_deployment(moto_server, monkeypatch):
    moto_server.bucket(BUCKET)
    monkeypatch.setenv("AIRFLOW_VAR_LLMOPS_BACKENDS", json.dumps(
        {"sagemaker": sagemaker_settings(BUCKET, spot=True, retry_attempts=2)}))
    # Every job is waited for by the triggerer, as on MWAA with deferrable operators.
    monkeypatch.setenv("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", "true")
    return moto_server


# `airflow dags test` names each run after the current time; running the same DAG run twice (a
# restarted run, as after a scheduler crash) needs a fixed `run_after`, which only DAG.test takes.
RUNNER = r"""
import json, sys
from airflow.cli.commands.dag_command import get_bagged_dag
from airflow.sdk import timezone
from airflow.utils.providers_configuration_loader import providers_configuration_loaded

@providers_configuration_loaded
def main():
    when = timezone.parse(sys.argv[1])
    dag = get_bagged_dag(bundle_names=None, dag_id="llm_lifecycle", dagfile_path=None)
    run = dag.test(run_after=when, logical_date=when, run_conf=json.loads(sys.argv[2]))
    print(f"DAG RUN {run.run_id} state={run.state}")
    sys.exit(0 if run.state == "success" else 1)

main()
"""


def run_dag(conf: dict) -> tuple[int, str]:
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, LOGICAL_DATE, json.dumps(conf)],
                          capture_output=True, text=True, env=env, timeout=900)
    return proc.returncode, proc.stdout + proc.stderr


def test_lifecycle_with_pretraining_on_sagemaker(airflow_db, sagemaker_deployment, tmp_path):
    moto = sagemaker_deployment
    conf = {"recipe": "tiny", "sweep_trials": 1, "backend_pretrain": "sagemaker", "team": "research",
            "priority": 50,
            "storage_root": str(tmp_path / "storage"),
            "stage_resources": {"pretrain": {"instance_type": "ml.g5.2xlarge", "max_run_seconds": 432000}}}

    # The session's moto is shared: another test's pretraining jobs (made before this one ran,
    # wherever xdist put it) are not this run's.
    others = set(moto.training_jobs("pretrain-"))

    # 1. Submitted, nothing ran, the retry reattaches.
    code, output = run_dag(conf)
    assert "Submitted pretrain job" in output and "Reattached to pretrain job" in output, output[-4000:]
    assert "wrote no result" in output
    jobs = [j for j in moto.training_jobs("pretrain-") if j not in others]
    assert len(jobs) == 1, f"one training job, however often the task runs: {jobs}"
    job = jobs[0]
    described = moto.client("sagemaker").describe_training_job(TrainingJobName=job)
    assert described["ResourceConfig"]["InstanceType"] == "ml.g5.2xlarge"
    assert described["StoppingCondition"]["MaxRuntimeInSeconds"] == 432000
    staging = described["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"].rsplit("/llmops/", 1)[0]
    bucket, key = staging[len("s3://"):].split("/", 1)
    request = json.loads(moto.client("s3").get_object(Bucket=bucket, Key=f"{key}/request.json")["Body"].read())
    validate_request("sagemaker", "CreateTrainingJob", request)
    assert request["EnableManagedSpotTraining"] is True and request["RetryStrategy"]["MaximumRetryAttempts"] == 2
    assert request["Environment"]["MLFLOW_RUN_ID"], "the job logs into the task's MLflow child run"
    assert {"Key": "team", "Value": "research"} in request["Tags"]
    channels = {c["ChannelName"] for c in request["InputDataConfig"]}
    assert channels == {"llmops_config", "data_dir"}, "the local data prep output was staged as a channel"

    # 2. What SageMaker would run.
    proc = run_training_container(moto, job, tmp_path / "container")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"step 20/20", proc.stdout)

    # 3. The same run again: reattach everywhere, the result flows on.
    code, output = run_dag(conf)
    assert code == 0 and "state=success" in output, output[-6000:]
    # The job ended already: the reattaching task finishes it in the worker, without deferring
    # (Airflow's scheduler can fail a task whose trigger fires at once:
    # llmops.airflow.operators.job_wait)
    assert "has already ended (succeeded): finishing here rather than in the triggerer" in output, output[-6000:]
    assert re.search(r"Reattached to pretrain job pretrain-[0-9a-f]{12}", output)
    assert re.search(r"pretrain job pretrain-[0-9a-f]{12} succeeded: .*val_loss=", output)
    assert [j for j in moto.training_jobs("pretrain-") if j not in others] == [job], "still exactly one training job"
    pretrain_dir = tmp_path / "storage" / "llm_lifecycle"
    models = list(pretrain_dir.glob("*/pretrain/model/meta.json"))
    assert models, "the SageMaker job's model was copied to the run's local storage"

    from llmops.infra import tracking

    client = tracking.client()
    exp = client.get_experiment_by_name("llm_lifecycle")
    runs = client.search_runs([exp.experiment_id], "tags.stage = 'pretrain' and tags.backend = 'sagemaker'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["team"] == "research" and runs[0].data.tags["job_name"] == job
    assert "loss/train" in runs[0].data.metrics, "the container logged into the same MLflow run"
    # Other tests in this worker share the registry: one may hold a better champion already, or
    # (the tiny recipe is deterministic) have registered these very weights, which the gate then
    # does not register twice. So the check is that the gate judged this run, not that it won.
    [parent] = client.search_runs([exp.experiment_id], f"tags.kind = '{tracking.PARENT_KIND}' and "
                                                       f"tags.run_id = 'manual__{LOGICAL_DATE}'")
    verdict = parent.data.tags.get("gate", "")
    assert re.fullmatch(r"passed|refused|already registered as version \d+", verdict), parent.data.tags
    ours = client.search_model_versions(f"name = 'llm-lifecycle' and tags.run_id = 'manual__{LOGICAL_DATE}'")
    assert len(ours) == (0 if verdict.startswith("already") else 1), [v.tags for v in ours]
