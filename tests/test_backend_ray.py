"""The Ray backend against a real one-node Ray cluster, through the Ray Jobs REST API only (the
Airflow side imports no `ray`): submit, stream logs, succeed with the result JSON, reattach by
submission id, fail with the job's message, stop a running job, and run real data prep on the
cluster."""

from __future__ import annotations

import ast
import json
import os
import time
from pathlib import Path

import pytest

from llmops.jobs.backends import JobState
from llmops.jobs.backends.ray.ray_backend import RayBackend
from llmops.jobs.spec import JobSpec, job_name
from tests.aws_fixtures import ENTRY, ROOT

CONN = "llmops_ray"


@pytest.fixture(scope="module")
def backend(ray_cluster, tmp_path_factory):
    os.environ[f"AIRFLOW_CONN_{CONN.upper()}"] = json.dumps({"conn_type": "http", "host": ray_cluster})
    staging = tmp_path_factory.mktemp("ray-staging")
    settings = {"ray": {"ray_conn_id": CONN, "staging_uri": str(staging), "entry_script": str(ENTRY),
                        "python": os.sys.executable,
                        "runtime_env": {"env_vars": {"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}}}}
    yield RayBackend(settings=settings)
    os.environ.pop(f"AIRFLOW_CONN_{CONN.upper()}", None)


def wait(backend, handle, timeout=120, until=lambda s: s.state.terminal):
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = backend.status(handle)
        if until(status):
            return status
        time.sleep(0.5)
    raise AssertionError(f"{handle['job_name']}: {backend.status(handle)}")


def sample(name: str, **config) -> JobSpec:
    return JobSpec(stage="sample", entrypoint="tests.sample_job", name=name, config=config,
                   env={"LLMOPS_SAMPLE": "1"})


def test_a_job_runs_on_the_cluster_returns_its_result_and_reattaches(backend):
    spec = sample(job_name("ray-ok", prefix="ray-ok"), seconds=0.3)
    handle = backend.submit(spec)
    assert handle["reattached"] is False
    status = wait(backend, handle)
    assert status.state is JobState.SUCCEEDED, status
    assert status.result["metrics"] == {"answer": 42.0}
    lines, cursor = backend.read_logs(handle)
    assert any("sample job starting" in line for line in lines)
    assert backend.read_logs(handle, cursor)[0] == []
    again = backend.submit(spec)                      # a retried task
    assert again["reattached"] is True and again["job_name"] == handle["job_name"]


def test_a_failing_job_reports_why_and_a_resubmit_starts_a_new_attempt(backend):
    spec = sample(job_name("ray-fail", prefix="ray-fail"), exit_code=5)
    handle = backend.submit(spec)
    status = wait(backend, handle)
    assert status.state is JobState.FAILED
    assert "exit code 5" in status.message or "failed" in status.message.lower()
    assert any("failing on purpose" in line for line in backend.read_logs(handle)[0])
    retry = backend.submit(spec)
    assert retry["reattached"] is False and retry["job_name"].endswith("-r2")
    wait(backend, retry)


def test_stop_ends_a_running_job(backend, tmp_path):
    spec = sample(job_name("ray-stop", prefix="ray-stop"), seconds=60, marker_dir=str(tmp_path))
    handle = backend.submit(spec)
    wait(backend, handle, until=lambda s: (tmp_path / "starts").exists())
    backend.stop(handle)
    status = wait(backend, handle, timeout=60)
    assert status.state is JobState.STOPPED
    pid = int((tmp_path / "starts").read_text().split()[0])
    deadline = time.time() + 20
    while Path(f"/proc/{pid}").exists() and time.time() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists(), "the stage process must be gone"


def test_data_prep_runs_on_the_cluster(backend, tmp_path):
    """The real data prep stage as a Ray job: its shards become Ray tasks on the cluster."""
    from tasks.configs import tiny, to_dict

    config = to_dict(tiny().data)
    config.update(output_dir=str(tmp_path / "data"), engine="ray", demo_corpus_docs=100,
                  demo_sft_examples=50)
    spec = JobSpec(stage="data_prep", entrypoint="tasks.data.prep", config=config,
                   name=job_name("ray-prep", str(tmp_path), prefix="data-prep"))
    handle = backend.submit(spec)
    status = wait(backend, handle, timeout=300)
    assert status.state is JobState.SUCCEEDED, "\n".join(backend.read_logs(handle)[0][-30:])
    assert (tmp_path / "data" / "manifest.json").exists()
    assert status.result["outputs"]["data_dir"] == str(tmp_path / "data")


def test_the_airflow_side_never_imports_ray():
    """MWAA workers have no Ray: the backend and its hook talk HTTP only."""
    for path in (ROOT / "plugins" / "llmops").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "ray" or n.startswith("ray.") for n in names), path


def test_the_deferred_wait_follows_the_jobs_deadline_not_a_poll_count(backend, tmp_path):
    """The triggerer keeps polling for as long as the job's max_run_seconds allows (no 60-poll
    cap: here 0.02 s polls for 4 s), then stops the job."""
    import asyncio

    from llmops.airflow.triggers.job_trigger import JobTrigger

    spec = sample(job_name("ray-deadline", prefix="ray-deadline"), seconds=120, marker_dir=str(tmp_path))
    handle = backend.submit(spec)
    wait(backend, handle, until=lambda s: (tmp_path / "starts").exists())
    trigger = JobTrigger(handle=handle, poll_interval=0.02, deadline=time.time() + 4)

    async def first_event():
        async for event in trigger.run():
            return event.payload

    started = time.monotonic()
    event = asyncio.run(first_event())
    while event["state"] == "progress":  # a log-cursor checkpoint: the task defers again from it
        trigger = JobTrigger(**event["trigger"])
        event = asyncio.run(first_event())
    assert event["state"] == "timeout" and time.monotonic() - started >= 4 > 60 * 0.02
    assert wait(backend, handle, timeout=60).state is JobState.STOPPED
