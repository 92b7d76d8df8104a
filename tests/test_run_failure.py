"""A task whose process dies before it runs: the run's note and its run page name the task that
failed first and what the scheduler reported, and `pick_best` (trigger rule all_done) skips as it
does when start_run refuses a conf.

The processes die for real (tests/dying_tasks.py): a LocalExecutor worker cannot reach the
execution API, as under `make up` on other ports before the base URL followed the port, and the
scheduler's own executor-event handling fails the task instance, which was still queued.
"""

from __future__ import annotations

import html
import json
import os
import socket
import subprocess
import sys

import pytest

from tests.isolated_env import ROOT

DAG_ID = "llm_lifecycle"
CONF = {"recipe": "tiny", "sweep_trials": 1}


def _closed_port() -> int:
    """A port nothing listens on (bound, then released: connecting to it is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def dying_runs(airflow_db) -> dict[str, str]:
    """{who dies: DAG run id}: one run where only start_run's processes die, one where every
    task's do (the issue's `make up` on port 8391: nothing could reach the execution API)."""
    env = {**os.environ,
           "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{_closed_port()}/execution/",
           # one connection attempt per try, not five over 31 s
           "AIRFLOW__WORKERS__EXECUTION_API_RETRIES": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.dying_tasks", json.dumps(CONF), "start_run", "*"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"dying"')]
    return {r["dying"]: r["run_id"] for r in runs}


def _run(run_id: str):
    from sqlalchemy import select

    from airflow.models.dagrun import DagRun
    from airflow.models.log import Log
    from airflow.utils.session import create_session

    with create_session() as session:
        dag_run = session.scalars(select(DagRun).where(DagRun.run_id == run_id)).one()
        states = {ti.task_id: (ti.state, ti.try_number) for ti in dag_run.get_task_instances(session=session)}
        mismatches = session.execute(
            select(Log.task_id, Log.try_number).where(Log.run_id == run_id, Log.event == "state mismatch")
            .order_by(Log.task_id, Log.try_number)).all()
        return dag_run.state, dag_run.note, states, [tuple(m) for m in mismatches]


def test_start_run_dying_fails_the_run_at_start_run_and_pick_best_skips(dying_runs):
    state, note, states, mismatches = _run(dying_runs["start_run"])
    assert state == "failed"
    # both tries died before running: the scheduler failed each itself, still queued
    assert mismatches == [("start_run", 1), ("start_run", 2)]
    assert states["start_run"] == ("failed", 2)
    assert states["pick_best"][0] == "skipped", states
    assert states["data_prep"][0] == "upstream_failed" and states["promote"][0] == "upstream_failed"
    assert note.startswith("failed at start_run (try 2): its process ended before the task ran; "
                           "the scheduler reported: Executor LocalExecutor"), note
    assert "finished with state failed, but the task instance's state attribute is queued" in note
    assert "later failed" not in note  # pick_best skipped: nothing else failed


def test_every_task_dying_names_start_run_first_not_by_name(dying_runs):
    """The issue's note read "failed at pick_best, start_run" (sorted by name): pick_best failed
    only because its own process died too, after start_run had."""
    state, note, states, mismatches = _run(dying_runs["*"])
    assert state == "failed"
    assert states["start_run"] == ("failed", 2) and states["pick_best"] == ("failed", 2), states
    assert ("pick_best", 2) in mismatches
    assert note.startswith("failed at start_run (try 2): its process ended before the task ran; "), note
    assert note.endswith("; later failed: pick_best"), note


def test_the_run_page_shows_the_failure_without_an_mlflow_run(dying_runs):
    from fastapi.testclient import TestClient

    from llmops.airflow import run_page
    from llmops.stages import run_summary

    run_id = dying_runs["start_run"]
    _, note, _, _ = _run(run_id)
    assert run_summary.collect(DAG_ID, run_id) is None  # start_run never ran: no MLflow run
    api = TestClient(run_page.make_app(authorize=lambda: None))
    resp = api.get(f"/runs/{DAG_ID}/{run_id}")
    assert resp.status_code == 200, resp.text
    assert f'<div class="failure" data-key="failure">{html.escape(note, quote=True)}</div>' in resp.text
    assert "data-key='state'>failed<" in resp.text
    as_json = api.get(f"/runs/{DAG_ID}/{run_id}/summary.json")
    assert as_json.status_code == 404 and as_json.json()["airflow"] == {
        "state": "failed", "note": note, "failure": note, "refusal": None}   # it died: no refusal
    # a run neither Airflow nor MLflow knows is still a 404
    assert api.get(f"/runs/{DAG_ID}/manual__never").status_code == 404
