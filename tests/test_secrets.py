"""No secret reaches disk, logs or MLflow (issue 14, part 1).

The local backend records only the job's own env and keeps job directories private; remote
backends refuse credentials in a job's env; a secret a job prints shows as *** in the task log.
The lifecycle-wide scan (state directory, MLflow, task logs) runs on the lifecycle e2e test's run:
tests/test_lifecycle_e2e.py::test_no_planted_secret_reaches_disk_logs_or_mlflow.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path

import pytest

from llmops.jobs import env_secrets
from llmops.jobs.backends import JobState
from llmops.jobs.backends.local.local_backend import LocalBackend
from llmops.jobs.backends.remote import check_environment
from llmops.jobs.spec import JobSpec, JobSpecError
from tests.test_jobs import wait_terminal


def planted_secrets() -> dict[str, str]:
    """Fresh fake credentials, as a worker's environment would hold them."""
    aws_secret = "fakeAWS" + secrets.token_hex(16)
    db_password = "fakeDB" + secrets.token_hex(12)
    return {"AWS_SECRET_ACCESS_KEY": aws_secret, "WAREHOUSE_PASSWORD": db_password,
            "AIRFLOW_CONN_WAREHOUSE": f"postgres://etl:{db_password}@warehouse.internal:5432/dw"}


def test_a_local_job_records_only_its_own_env_and_its_files_are_private(tmp_path, monkeypatch):
    planted = planted_secrets()
    for name, value in planted.items():
        monkeypatch.setenv(name, value)
    backend = LocalBackend(tmp_path / "jobs")
    spec = JobSpec(stage="sample", entrypoint="tests.sample_job", name="env-job",
                   env={"STAGE_SETTING": "on"}, config={"print_env": ["AWS_SECRET_ACCESS_KEY"]})
    handle = backend.submit(spec)
    assert wait_terminal(backend, handle).state is JobState.SUCCEEDED
    job_dir = Path(handle["job_dir"])

    recorded = json.loads((job_dir / "command.json").read_text())["env"]
    assert set(recorded) == {"STAGE_SETTING", "PYTHONUNBUFFERED", "PYTHONPATH"}
    # The job got the inherited key (it printed it, not '<unset>'); its log shows *** instead.
    lines, _ = backend.read_logs(handle)
    assert "env AWS_SECRET_ACCESS_KEY=***" in lines, lines
    for path in job_dir.iterdir():
        assert not any(v in path.read_text() for v in planted.values()), path.name

    for directory in (job_dir.parent, job_dir):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    # result.json is written by the job itself: the runner's umask covers it too.
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in job_dir.iterdir()}
    assert {"command.json", "output.log", "result.json", "exit_code"} <= set(modes)
    assert set(modes.values()) == {0o600}, modes


@pytest.mark.parametrize("name", sorted(env_secrets.AWS_CREDENTIAL_NAMES))
def test_remote_jobs_refuse_aws_credentials_in_their_env(name):
    with pytest.raises(JobSpecError) as err:
        check_environment({"MLFLOW_RUN_ID": "abc", name: "AKIAFAKE0123456789"})
    assert repr(name) in str(err.value) and "IAM role" in str(err.value)


def test_lines_pass_through_airflows_masker_once_the_env_is_registered(monkeypatch):
    planted = planted_secrets()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", planted["AWS_SECRET_ACCESS_KEY"])
    line = f"key={planted['AWS_SECRET_ACCESS_KEY']} dsn={planted['AIRFLOW_CONN_WAREHOUSE']}"
    assert env_secrets.mask_in_task_logs(os.environ, {"AIRFLOW_CONN_WAREHOUSE":
                                                      planted["AIRFLOW_CONN_WAREHOUSE"]}) >= 2
    assert env_secrets.redact_lines([line]) == [
        "key=*** dsn=postgres://etl:***@warehouse.internal:5432/dw"]


def test_secret_values_are_secret_names_and_uri_passwords():
    env = {"HF_TOKEN": "hf_abcdef", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TOKEN": "true",
           "AIRFLOW_CONN_WAREHOUSE": "postgres://u:p%40ss-word@h/db", "PLAIN_URL": "https://h/x"}
    assert env_secrets.secret_values(env) == sorted({"hf_abcdef", "p%40ss-word", "p@ss-word"})


@pytest.mark.parametrize("dag_id", ["job_operator_prints_secrets",
                                    "job_operator_prints_secrets_deferred"])
def test_a_secret_a_job_prints_shows_as_stars_in_the_task_log(airflow_db, monkeypatch, dag_id):
    from tests.isolated_env import airflow_cli

    planted = planted_secrets()
    for name, value in planted.items():
        monkeypatch.setenv(name, value)
    proc = airflow_cli("dags", "test", dag_id,
                       dags_folder=Path(__file__).parent / "dags")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "env AWS_SECRET_ACCESS_KEY=***" in output, output[-3000:]
    assert "env WAREHOUSE_PASSWORD=***" in output
    assert "env AIRFLOW_CONN_WAREHOUSE=postgres://etl:***@warehouse.internal:5432/dw" in output
    task_logs = [p for p in Path(os.environ["AIRFLOW_HOME"], "logs").rglob("*")
                 if p.is_file() and f"dag_id={dag_id}" in str(p)]
    for text in [output, *(p.read_text(errors="replace") for p in task_logs)]:
        for value in planted.values():
            assert value not in text


def test_a_remote_request_carries_no_worker_credential(monkeypatch):
    """SageMaker's request is built from the spec and the backend's settings, never from the
    worker's environment; credentials put in the settings' env are refused like the spec's."""
    from tests.test_backend_sagemaker import pretrain_spec, render

    planted = planted_secrets()
    for name, value in planted.items():
        monkeypatch.setenv(name, value)
    request, _ = render(pretrain_spec())
    text = json.dumps(request)
    assert not any(value in text for value in planted.values())
    assert not set(request["Environment"]) & env_secrets.AWS_CREDENTIAL_NAMES
    with pytest.raises(JobSpecError, match="'AWS_SECRET_ACCESS_KEY'.*IAM role"):
        render(pretrain_spec(), env={"AWS_SECRET_ACCESS_KEY": planted["AWS_SECRET_ACCESS_KEY"]})
