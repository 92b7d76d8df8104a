"""The job layer: spec validation, the local backend (submit, reattach, fail, stop), and the
JobOperator run through Airflow for real, in the worker and deferred to a trigger."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pendulum
import pytest

from llmops.jobs.backends import JobState, get_backend
from llmops.jobs.backends.local.local_backend import LocalBackend
from llmops.jobs.spec import JobSpec, JobSpecError, job_name

SAGEMAKER_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")


def sample_spec(name: str, **config) -> JobSpec:
    return JobSpec(stage="sample", entrypoint="tests.sample_job", name=name, config=config)


def wait_terminal(backend, handle, timeout=60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = backend.status(handle)
        if status.state.terminal:
            return status
        time.sleep(0.2)
    raise AssertionError(f"job {handle['name']} did not finish in {timeout}s")


def pid_alive(pid: int) -> bool:
    try:   # a zombie (Z) has ended; whoever adopted it reaps it later
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- spec -------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, message", [
    ("entrypoint", "tasks.pretrain; rm -rf /", "dotted module name"),
    ("name", "has_underscore", "letters, digits or hyphens"),
    ("argv", ("--lr", 3), "list of strings"),
    ("env", {"BAD NAME": "x"}, "valid name"),
    ("nproc_per_node", 0, "positive integer"),
])
def test_spec_refuses_bad_fields_naming_them(field, value, message):
    with pytest.raises(JobSpecError, match=message):
        JobSpec(**{"stage": "pretrain", "entrypoint": "tasks.pretrain", field: value})


def test_spec_round_trips_and_refuses_unknown_fields():
    spec = JobSpec(stage="pretrain", entrypoint="tasks.pretrain", argv=("--x", "1"),
                   env={"A": "b"}, config={"max_steps": 3})
    assert JobSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(JobSpecError, match="Unknown JobSpec field"):
        JobSpec.from_dict({**spec.to_dict(), "instance_typo": "ml.p5.48xlarge"})


def test_job_names_are_deterministic_and_valid_everywhere():
    a = job_name("llm_lifecycle", "manual__2026-01-01T00:00:00+00:00", "sweep_trial", "3",
                 prefix="sweep_trial-3")
    assert a == job_name("llm_lifecycle", "manual__2026-01-01T00:00:00+00:00", "sweep_trial", "3",
                         prefix="sweep_trial-3")
    assert a != job_name("llm_lifecycle", "manual__2026-01-01T00:00:00+00:00", "sweep_trial", "4",
                         prefix="sweep_trial-3")
    long = job_name("x", prefix="a_very_long_task_id_" * 10)
    for name in (a, long):
        assert SAGEMAKER_NAME.match(name) and len(name) <= 63


# -- local backend ----------------------------------------------------------------------------

def test_local_job_succeeds_streams_logs_and_returns_its_result(tmp_path):
    backend = LocalBackend(tmp_path / "jobs")
    handle = backend.submit(sample_spec("ok-job", seconds=0.3))
    status = wait_terminal(backend, handle)
    assert status.state is JobState.SUCCEEDED, (status, backend.read_logs(handle)[0])
    assert status.result["metrics"] == {"answer": 42.0}
    lines, cursor = backend.read_logs(handle)
    assert any("sample job starting" in line for line in lines)
    assert backend.read_logs(handle, cursor) == ([], cursor)  # nothing new: no repeats


def test_resubmitting_a_running_or_finished_job_reattaches_instead_of_duplicating(tmp_path):
    backend = LocalBackend(tmp_path / "jobs")
    spec = sample_spec("reattach-job", seconds=1.5, marker_dir=str(tmp_path / "m"))
    first = backend.submit(spec)
    time.sleep(0.5)
    second = backend.submit(spec)           # a retried Airflow task while the job runs
    assert second["reattached"] is True
    wait_terminal(backend, second)
    third = backend.submit(spec)            # a rerun after success
    assert third["reattached"] is True
    starts = (tmp_path / "m" / "starts").read_text().split()
    assert len(starts) == 1, "the job must have started exactly once"
    assert first["job_dir"] == third["job_dir"]


def test_a_job_just_started_is_never_mistaken_for_a_dead_one(tmp_path):
    """Right after the runner starts, /proc can show it with an empty command line: polling at
    that instant must say running (a flaky 'runner died' here once failed real tasks)."""
    backend = LocalBackend(tmp_path / "jobs")
    for i in range(15):
        handle = backend.submit(sample_spec(f"fresh-{i}", exit_code=3))
        status = backend.status(handle)
        while not status.state.terminal:
            status = backend.status(handle)
        assert "code 3" in status.message, status


def test_failed_job_reports_exit_code_and_a_resubmit_starts_a_new_attempt(tmp_path):
    backend = LocalBackend(tmp_path / "jobs")
    handle = backend.submit(sample_spec("fail-job", exit_code=3))
    status = wait_terminal(backend, handle)
    assert status.state is JobState.FAILED and "code 3" in status.message
    again = backend.submit(sample_spec("fail-job", exit_code=3))
    assert again["reattached"] is False and again["attempt"] == 2
    wait_terminal(backend, again)
    assert (Path(again["job_dir"]) / "output.log.attempt1").exists()


def test_invalid_stage_config_fails_the_job_before_work_starts(tmp_path):
    backend = LocalBackend(tmp_path / "jobs")
    handle = backend.submit(JobSpec(stage="sample", entrypoint="tests.sample_job",
                                    name="bad-config", config={"secondz": 1}))
    status = wait_terminal(backend, handle)
    assert status.state is JobState.FAILED and "code 2" in status.message
    log = "\n".join(backend.read_logs(handle)[0])
    assert "Unknown config key" in log and "secondz" in log


def test_stop_ends_the_whole_process_group(tmp_path):
    backend = LocalBackend(tmp_path / "jobs")
    markers = tmp_path / "m"
    handle = backend.submit(sample_spec("stop-job", seconds=60, spawn_child=True,
                                        marker_dir=str(markers)))
    deadline = time.time() + 30
    while not (markers / "child_pid").exists() and time.time() < deadline:
        time.sleep(0.1)
    child = int((markers / "child_pid").read_text())
    job_pid = int((markers / "starts").read_text().split()[0])
    assert pid_alive(child) and pid_alive(job_pid)
    backend.stop(handle)
    assert backend.status(handle).state is JobState.STOPPED
    deadline = time.time() + 15
    while (pid_alive(child) or pid_alive(job_pid)) and time.time() < deadline:
        time.sleep(0.1)
    assert not pid_alive(child) and not pid_alive(job_pid)


def test_unknown_backend_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="Choose one of"):
        get_backend("slurm")


# -- the operator, through Airflow ------------------------------------------------------------

OPERATOR_DAGS = Path(__file__).parent / "dags" / "operator_dags.py"


def _job_results(prefix: str) -> list[dict]:
    jobs = Path(os.environ["LLMOPS_HOME"], "jobs")
    return [json.loads((p / "result.json").read_text())
            for p in sorted(jobs.glob(f"{prefix}*")) if (p / "result.json").exists()]


@pytest.mark.parametrize("dag_id", ["job_operator_worker", "job_operator_deferred"])
def test_operator_runs_a_job_through_airflow(airflow_db, dag_id):
    from tests.isolated_env import airflow_cli

    before = len(_job_results("sample-"))
    proc = airflow_cli("dags", "test", dag_id, dags_folder=OPERATOR_DAGS.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "sample job starting" in output          # the job's log reached the task log
    assert re.search(r"sample job sample-[0-9a-f]{12} succeeded: answer=42", output)
    if dag_id == "job_operator_deferred":
        assert "deferred" in output.lower()
    assert len(_job_results("sample-")) == before + 1


def test_operator_fails_the_task_when_the_job_fails(airflow_db):
    from tests.isolated_env import airflow_cli

    proc = airflow_cli("dags", "test", "job_operator_failing", dags_folder=OPERATOR_DAGS.parent)
    output = proc.stdout + proc.stderr
    assert "sample job failing on purpose" in output  # the failure shows the job's last lines
    assert "exited with code 5" in output


def test_task_timeout_stops_the_job_and_its_children(airflow_db, tmp_path):
    from tests.isolated_env import airflow_cli

    markers = tmp_path / "markers"
    os.environ["AIRFLOW_VAR_MARKER_DIR"] = str(markers)
    try:
        started = time.time()
        proc = airflow_cli("dags", "test", "job_operator_timeout", dags_folder=OPERATOR_DAGS.parent)
    finally:
        del os.environ["AIRFLOW_VAR_MARKER_DIR"]
    output = proc.stdout + proc.stderr
    assert "Timeout" in output or "timed out" in output.lower(), output[-3000:]
    # Timed from the job's start, not the CLI's: `airflow dags test` itself takes a minute or
    # more to start on two loaded cores. The job would sleep 120 s; the task's timeout is 4 s.
    job_started = (markers / "starts").stat().st_mtime
    assert job_started > started
    assert time.time() - job_started < 60, "the task must end at its timeout, not when the job ends"
    job_pid = int((markers / "starts").read_text().split()[0])
    child = int((markers / "child_pid").read_text())
    deadline = time.time() + 15
    while (pid_alive(job_pid) or pid_alive(child)) and time.time() < deadline:
        time.sleep(0.2)
    assert not pid_alive(job_pid) and not pid_alive(child)
