"""The session's one full lifecycle run on the tiny recipe, shared by the modules that check it
(tests/test_lifecycle_e2e.py) and the ones that build on it (tests/test_lifecycle_reuse.py: the
step cache's second run, from_run, replay), so the suite pays for it once. Registered as
fixtures by tests/conftest.py."""

from __future__ import annotations

import json
import re
import time

import pytest

DAG_ID = "llm_lifecycle"
# Cache off: every stage of this run runs its job, even when an earlier test of the session ran
# the same recipe (its jobs are still recorded in the step cache, for the modules that reuse it).
TINY_CONF = {"recipe": "tiny", "cache": False}


def run_lifecycle(conf: dict, timeout: int = 900) -> dict:
    """`airflow dags test llm_lifecycle -c CONF` to success: the DAG run's id, its MLflow parent
    and child runs, the CLI's output and its wall time."""
    from tests.isolated_env import airflow_cli  # (isolated_env registers this module's fixture)

    started = time.monotonic()
    proc = airflow_cli("dags", "test", DAG_ID, "-c", json.dumps(conf), timeout=timeout)
    seconds = time.monotonic() - started
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "state=success" in output, output[-6000:]
    run_id = re.search(rf"DagRun Finished: dag_id={DAG_ID}, .*?run_id=([^,\s]+),", output).group(1)
    return {**mlflow_runs(run_id), "run_id": run_id, "output": output, "seconds": seconds}


def mlflow_runs(run_id: str) -> dict:
    from llmops.infra import tracking

    client = tracking.client()
    exp = client.get_experiment_by_name(DAG_ID)
    parent = client.search_runs([exp.experiment_id],
                                f"tags.kind = 'lifecycle' and tags.run_id = '{run_id}'")[0]
    children = client.search_runs(
        [exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'", max_results=100)
    return {"client": client, "parent": parent, "children": children}


@pytest.fixture(scope="session")
def tiny_lifecycle_run(airflow_db):
    # The worker runs with credentials in its environment, as a real one would: an AWS secret
    # key and a database password (plain and in an Airflow connection). None may leak (issue 14).
    from tests.test_secrets import planted_secrets

    planted = planted_secrets()
    with pytest.MonkeyPatch.context() as env:
        for name, value in planted.items():
            env.setenv(name, value)
        run = run_lifecycle(TINY_CONF)
    return {**run, "planted": planted, "conf": TINY_CONF}
