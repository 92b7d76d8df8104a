"""MLflow conventions: one parent run per DAG run, one child run per stage, trial or job.

Runs are found again by their tags, so a retried task logs into the run its first try opened
instead of leaving a trail of orphans. Tags on every child run: stage, dag_id, run_id, task_id,
map_index, try_number, backend, git_commit, data_hash, job_name. Only the MLflow client is used
here (mlflow-skinny on MWAA).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from llmops import settings
from llmops.provenance import source_commit
from tasks.configs import flatten  # stdlib only; shipped in plugins.zip beside llmops

PARENT_KIND = "lifecycle"


def tracking_uri() -> str:
    """`$MLFLOW_TRACKING_URI`, else a SQLite store under `$LLMOPS_HOME` (the file store is legacy)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{settings.home() / 'mlflow.db'}"


def client():
    from mlflow import MlflowClient

    uri = tracking_uri()
    if uri.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(uri[len("sqlite:///"):]) or ".", exist_ok=True)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def ensure_experiment(name: str) -> str:
    c = client()
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifact_location = None
    if tracking_uri().startswith("sqlite:"):
        # Keep artifacts beside the store, not in whatever directory a worker happens to run in.
        artifact_location = (settings.home() / "mlartifacts" / name).as_uri()
    try:
        return c.create_experiment(name, artifact_location=artifact_location)
    except Exception:  # another task created it first
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def _find_run(experiment_id: str, tags: dict[str, str]):
    query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    runs = client().search_runs([experiment_id], filter_string=query, max_results=1,
                                order_by=["attributes.start_time ASC"])
    return runs[0] if runs else None


def start_parent_run(*, experiment: str, dag_id: str, run_id: str, config: dict[str, Any]) -> str:
    """The DAG run's parent run (the same one on a rerun), with the resolved config logged."""
    exp_id = ensure_experiment(experiment)
    key = {"kind": PARENT_KIND, "dag_id": dag_id, "run_id": run_id}
    found = _find_run(exp_id, key)
    c = client()
    if found:
        return found.info.run_id
    run = c.create_run(exp_id, run_name=f"{dag_id} {run_id}",
                       tags={**key, "git_commit": source_commit()})
    for k, v in sorted(flatten(config).items()):
        c.log_param(run.info.run_id, k, str(v)[:6000])
    log_json(run.info.run_id, config, "lifecycle_config.json")
    c.set_tag(run.info.run_id, "mlflow.note.content",
              f"Lifecycle run {run_id} of DAG {dag_id}. Each stage is a child run.")
    return run.info.run_id


def start_child_run(*, experiment: str, parent_run_id: str, stage: str, tags: dict[str, str],
                    identity: dict[str, str]) -> str:
    """The child run for one task (found again on retry by `identity`), tags updated per try."""
    exp_id = ensure_experiment(experiment)
    key = {"mlflow.parentRunId": parent_run_id, **identity}
    found = _find_run(exp_id, key)
    c = client()
    all_tags = {"stage": stage, "git_commit": source_commit(), **identity, **tags}
    if found:
        run_id = found.info.run_id
        if found.info.status != "RUNNING":
            c.update_run(run_id, status="RUNNING")
    else:
        run_id = c.create_run(exp_id, run_name=identity.get("task_id", stage),
                              tags={"mlflow.parentRunId": parent_run_id, **all_tags}).info.run_id
    for k, v in all_tags.items():
        c.set_tag(run_id, k, str(v))
    return run_id


def end_run(run_id: str, status: str) -> None:
    client().set_terminated(run_id, status=status)


def log_json(run_id: str, data: Any, name: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, name)
        with open(path, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=True, default=str)
        client().log_artifact(run_id, path)
