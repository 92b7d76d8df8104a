"""`make up`'s settings, without starting it (tests/test_browser.py starts it for real): the port
moves every address that embeds it, values the user set are kept, and scripts/airflow reaches the
deployment the Makefile describes, not ~/airflow."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from scripts import up

ROOT = Path(__file__).resolve().parents[1]


def test_the_port_comes_from_airflow_port_or_the_users_own_setting():
    assert up.airflow_port({}) == 8080
    assert up.airflow_port({"AIRFLOW_PORT": "8391"}) == 8391
    assert up.airflow_port({"AIRFLOW__API__PORT": "8392"}) == 8392
    assert up.airflow_port({"AIRFLOW_PORT": "8391", "AIRFLOW__API__PORT": "8391"}) == 8391
    with pytest.raises(SystemExit, match="AIRFLOW_PORT=8391 and AIRFLOW__API__PORT=8392 disagree"):
        up.airflow_port({"AIRFLOW_PORT": "8391", "AIRFLOW__API__PORT": "8392"})


def _execution_api_url(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    """Where Airflow's executors send task processes with `env` (its own resolution)."""
    from airflow.executors.base_executor import get_execution_api_server_url

    for name in ("AIRFLOW__API__BASE_URL", "AIRFLOW__CORE__EXECUTION_API_SERVER_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        if name.startswith("AIRFLOW__"):
            monkeypatch.setenv(name, value)
    return get_execution_api_server_url()


def test_both_servers_listen_on_this_machine_only_unless_the_user_asks():
    """Issue 48: the API server listened on 0.0.0.0 (Airflow's default) beside MLflow on
    127.0.0.1. Now both take BIND_HOST, 127.0.0.1 by default; a user's own AIRFLOW__API__HOST
    counts as asking, and two that disagree are refused."""
    assert up.bind_host({}) == "127.0.0.1"
    assert up.airflow_server_env({}, 8080)["AIRFLOW__API__HOST"] == "127.0.0.1"
    assert up.airflow_server_env({"BIND_HOST": "0.0.0.0"}, 8080)["AIRFLOW__API__HOST"] == "0.0.0.0"
    assert up.bind_host({"AIRFLOW__API__HOST": "0.0.0.0"}) == "0.0.0.0"
    with pytest.raises(SystemExit, match="disagree"):
        up.bind_host({"BIND_HOST": "127.0.0.1", "AIRFLOW__API__HOST": "0.0.0.0"})


def test_task_processes_reach_the_execution_api_on_the_chosen_port(monkeypatch):
    # Before: only AIRFLOW__API__PORT moved, and Airflow sent every task to localhost:8080.
    assert _execution_api_url({"AIRFLOW__API__PORT": "8391"}, monkeypatch) == \
        "http://localhost:8080/execution/"
    env = up.airflow_server_env({}, 8391)
    assert env["AIRFLOW__API__PORT"] == "8391"
    assert env["AIRFLOW__API__BASE_URL"] == "http://localhost:8391"
    assert _execution_api_url(env, monkeypatch) == "http://localhost:8391/execution/"


def test_a_base_url_or_execution_api_address_the_user_set_is_kept(monkeypatch):
    proxied = up.airflow_server_env({"AIRFLOW__API__BASE_URL": "https://airflow.example.com"}, 8391)
    assert proxied["AIRFLOW__API__BASE_URL"] == "https://airflow.example.com"
    own = up.airflow_server_env({"AIRFLOW__CORE__EXECUTION_API_SERVER_URL": "http://10.0.0.5:9000/execution/"},
                                8391)
    assert _execution_api_url(own, monkeypatch) == "http://10.0.0.5:9000/execution/"


def test_the_block_names_paused_dags_and_the_way_to_unpause():
    dags = [{"dag_id": "llm_lifecycle", "is_paused": False}, {"dag_id": "llm_retrain", "is_paused": True},
            {"dag_id": "llm_platform_report", "is_paused": True}]
    lines = up._dag_lines(dags)
    assert lines[0].startswith("Paused       llm_platform_report, llm_retrain: runs triggered from the CLI")
    assert "scripts/airflow dags unpause <dag_id>" in lines[-1]
    assert up._dag_lines([{"dag_id": "llm_lifecycle", "is_paused": False}]) == ["DAGs         1, none paused"]
    assert "not parsed yet" in up._dag_lines(None)[0]


def test_scripts_airflow_uses_the_makefiles_deployment(tmp_path):
    """A plain shell (no AIRFLOW_HOME): the wrapper's Airflow is the one under LLMOPS_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env["LLMOPS_HOME"] = str(tmp_path / "home")
    proc = subprocess.run([str(ROOT / "scripts" / "airflow"), "config", "get-value", "database",
                           "sql_alchemy_conn"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"sqlite:///{tmp_path}/home/airflow/airflow.db"
