"""MLflow conventions: one parent run per DAG run, one child run per stage, trial or job.

Runs are found again by their tags, so a retried task logs into the run its first try opened
instead of leaving a trail of orphans. Tags on every child run: stage, dag_id, run_id, task_id,
map_index, try_number, backend, git_commit, data_hash, job_name; the parent run also carries
`airflow_run_url`. Child runs are named after their stage (trials: `trial-<n> lr=<lr>`).
Only the MLflow client is used here (mlflow-skinny on MWAA).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from llmops.core import settings
from llmops.core.provenance import source_commit
from llmops.infra.step_cache import RECORD_ARTIFACT
from tasks.configs import flatten  # stdlib only; shipped in plugins.zip beside llmops

PARENT_KIND = "lifecycle"
# The experiment's kind: what MLflow 3's API and older UIs read to pick the view for model
# training (runs, charts, models) over the GenAI one.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
# MLflow 3.17's UI no longer reads that tag to pick the view: a global "workflow type" does (the
# sidebar's GenAI / Machine learning switch, kept in the browser's localStorage, GenAI unless the
# user switched), and a link's `workflowType` query parameter overrides it. So every link to the
# MLflow UI carries it; the experiment's classic training view opens, stage runs listed as runs.
UI_VIEW_QUERY = "?workflowType=machine_learning"
# A job's wait in its service's queue and its chain of attempts, as tags of its stage's child run
# (mark_waiting, record_attempt): what the run page shows while the job waits and after.
WAITING_TAG = "waiting"                # the service's own reason, "" once the job started
WAITING_SINCE_TAG = "waiting.since"    # when the job was submitted (epoch seconds)
QUEUED_TAG = "queued_s"                # how long it waited before it started
ATTEMPTS_TAG = "attempts"              # JSON: the attempts that ended, and why
ATTEMPTS_XCOM = "llmops_attempts"      # the same list, the job task's XCom (for the run's note)
ATTEMPTS_KEPT = 20                     # the newest this many (a tag holds at most 8000 characters)
# Where the MLflow UI is, for links and the task log: this environment variable, else this
# Airflow Variable, else the tracking URI when it is a server, else `make up`'s local server.
MLFLOW_UI_ENV = "LLMOPS_MLFLOW_UI_URL"
MLFLOW_UI_VARIABLE = "llmops_mlflow_ui_url"


def tracking_uri() -> str:
    """`$MLFLOW_TRACKING_URI`, else a SQLite store under `$LLMOPS_HOME` (the file store is legacy)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{settings.home() / 'mlflow.db'}"


def client():
    from mlflow import MlflowClient

    # no tqdm bars in task logs for artifact transfers (tasks.common.entry does it for jobs)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

    uri = tracking_uri()
    if uri.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(uri[len("sqlite:///"):]) or ".", exist_ok=True)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def ensure_experiment(name: str) -> str:
    """The experiment's id, created if missing; tagged for MLflow's training view either way
    (experiments made before the tag existed get it on their next run)."""
    c = client()
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        if exp.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
            c.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return exp.experiment_id
    artifact_location = None
    if tracking_uri().startswith("sqlite:"):
        # Keep artifacts beside the store, not in whatever directory a worker happens to run in.
        artifact_location = (settings.home() / "mlartifacts" / name).as_uri()
    try:
        return c.create_experiment(name, artifact_location=artifact_location,
                                   tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except Exception:  # another task created it first
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def mlflow_ui_url() -> str:
    """The MLflow UI's base URL (see MLFLOW_UI_ENV)."""
    url = os.environ.get(MLFLOW_UI_ENV, "")
    if not url:
        try:
            from airflow.sdk import Variable

            url = Variable.get(MLFLOW_UI_VARIABLE, default="") or ""
        except Exception:  # noqa: BLE001 - outside a task, or no Airflow at all
            url = ""
    if not url:
        uri = tracking_uri()
        if uri.startswith(("http://", "https://")):
            url = uri
    if not url:
        # `make up` serves the local store here (scripts/up.py)
        url = f"http://localhost:{os.environ.get('MLFLOW_PORT') or 5000}"
    return url.rstrip("/")


def run_url(run_id: str, experiment_id: str | None = None) -> str:
    """The run's page in the MLflow UI (its training view: UI_VIEW_QUERY)."""
    if experiment_id is None:
        experiment_id = client().get_run(run_id).info.experiment_id
    return ui_route(mlflow_ui_url(), experiment_id, run_id)


def ui_route(base: str, experiment_id: str, run_id: str = "") -> str:
    """An experiment's (or one of its runs') page under the MLflow UI at `base`, in the training
    view (UI_VIEW_QUERY: the query goes inside the hash, where the UI's router reads it)."""
    run = f"/runs/{run_id}" if run_id else ""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}{run}{UI_VIEW_QUERY}"


def airflow_run_url(dag_id: str, run_id: str) -> str:
    """The DAG run's page in the Airflow UI: `[api] base_url`, else the local API server."""
    from urllib.parse import quote

    base = ""
    try:
        from airflow.configuration import conf

        base = conf.get("api", "base_url", fallback="") or ""
        if not base:
            base = f"http://localhost:{conf.get('api', 'port', fallback='8080') or 8080}"
    except Exception:  # noqa: BLE001 - no Airflow config (a job's container)
        base = "http://localhost:8080"
    return f"{base.rstrip('/')}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"


def _find_run(experiment_id: str, tags: dict[str, str]):
    query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    runs = client().search_runs([experiment_id], filter_string=query, max_results=1,
                                order_by=["attributes.start_time ASC"])
    return runs[0] if runs else None


def start_parent_run(*, experiment: str, dag_id: str, run_id: str, config: dict[str, Any],
                     tags: dict[str, str] | None = None) -> str:
    """The DAG run's parent run (the same one on a rerun), with the resolved config logged and
    `tags` (the recipe: the run page's headline names it from the start)."""
    exp_id = ensure_experiment(experiment)
    key = {"kind": PARENT_KIND, "dag_id": dag_id, "run_id": run_id}
    found = _find_run(exp_id, key)
    c = client()
    url = airflow_run_url(dag_id, run_id)
    wanted = {"airflow_run_url": url, **(tags or {})}
    if found:
        for name, value in wanted.items():  # a parent made before the tag existed
            if found.data.tags.get(name) != value:
                c.set_tag(found.info.run_id, name, value)
        return found.info.run_id
    run = c.create_run(exp_id, run_name=f"{dag_id} {run_id}",
                       tags={**key, "git_commit": source_commit(), **wanted})
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
        run_id = c.create_run(exp_id, run_name=child_run_name(stage, identity),
                              tags={"mlflow.parentRunId": parent_run_id, **all_tags}).info.run_id
    for k, v in all_tags.items():
        c.set_tag(run_id, k, str(v))
    return run_id


def child_run_name(stage: str, identity: dict[str, str]) -> str:
    """The stage's name; a mapped task's adds its map index (`sweep-3`)."""
    index = str(identity.get("map_index", "-1"))
    return stage if index in ("", "-1") else f"{stage}-{index}"


def rename_run(run_id: str, name: str) -> None:
    client().update_run(run_id, name=name)


def end_run(run_id: str, status: str) -> None:
    client().set_terminated(run_id, status=status)


def log_json(run_id: str, data: Any, name: str) -> None:
    """`data` as the JSON artifact `name` (a path: "gate/decision.json" lands in gate/)."""
    folder, base = os.path.split(name)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, base)
        with open(path, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=True, default=str)
        client().log_artifact(run_id, path, artifact_path=folder or None)


def mark_reused(run_id: str, source: dict[str, str], record: dict[str, Any]) -> None:
    """A stage's child run whose job was not run because an earlier one's outputs were reused
    (the step cache, or `from_run`): tagged with where they come from (`cached_from`: the earlier
    MLflow run, `cached_from_job`, `cached_from_run`: its DAG run), given the earlier run's params
    and latest metrics so it reads like the run it stands for, its step record as an artifact,
    and ended FINISHED."""
    from mlflow.entities import Metric, Param, RunTag

    c = client()
    tags = {"cached_from": source.get("mlflow_run_id", ""), "cached_from_job": source["job_name"],
            "cached_from_run": source.get("run_id", ""), "reuse": source.get("how", "cache"),
            "job_name": source["job_name"]}
    if source.get("key"):
        tags["cache_key"] = source["key"]
    c.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
    earlier = None
    if source.get("mlflow_run_id"):
        try:
            earlier = c.get_run(source["mlflow_run_id"])
        except Exception:  # noqa: BLE001 - deleted, or another tracking server
            earlier = None
    if earlier is not None:
        have = c.get_run(run_id).data.params
        params = [Param(k, v) for k, v in earlier.data.params.items() if k not in have]
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, 0) for k, v in earlier.data.metrics.items()]
        for i in range(0, len(params), 100):   # MLflow's limits per log_batch call
            c.log_batch(run_id, params=params[i:i + 100])
        for i in range(0, len(metrics), 1000):
            c.log_batch(run_id, metrics=metrics[i:i + 1000])

    log_json(run_id, record, RECORD_ARTIFACT)
    end_run(run_id, "FINISHED")


def mark_waiting(run_id: str, reason: str, submitted_at: float | None,
                 started_at: float | None) -> None:
    """The job of child run `run_id` waits in its service's queue for `reason` (the service's own
    words), submitted at `submitted_at`; once it started (`started_at`), how long it waited."""
    if not run_id or submitted_at is None:
        return
    tags = {WAITING_TAG: "" if started_at is not None else reason[:5000],
            WAITING_SINCE_TAG: f"{submitted_at:.3f}",
            # a later attempt waits anew: its queue time is unknown until it starts
            QUEUED_TAG: f"{max(0.0, started_at - submitted_at):.3f}" if started_at is not None else ""}
    from mlflow.entities import RunTag

    client().log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])


def record_attempt(run_id: str, attempt: dict[str, Any]) -> None:
    """Add an attempt that ended (`attempt`: its number, job, why it ended, the service's words)
    to child run `run_id`'s ATTEMPTS_TAG, the newest ATTEMPTS_KEPT of them."""
    if not run_id:
        return
    c = client()
    try:
        earlier = json.loads(c.get_run(run_id).data.tags.get(ATTEMPTS_TAG) or "[]")
    except ValueError:
        earlier = []
    attempts = [*earlier, {k: (v[:400] if isinstance(v, str) else v) for k, v in attempt.items()}]
    text = json.dumps(attempts[-ATTEMPTS_KEPT:])
    while len(text) > 7900 and len(attempts) > 1:   # MLflow's limit on a tag's value
        attempts = attempts[1:]
        text = json.dumps(attempts[-ATTEMPTS_KEPT:])
    c.set_tag(run_id, ATTEMPTS_TAG, text)


def read_json_artifact(run_id: str, path: str) -> Any | None:
    """A JSON artifact of a run (e.g. `lifecycle_config.json`), or None when it has none."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            local = client().download_artifacts(run_id, path, tmp)
            with open(local) as fh:
                return json.load(fh)
    except (OSError, ValueError):
        return None
    except Exception as exc:  # noqa: BLE001 - MLflow's "not found" is an MlflowException
        if "RESOURCE_DOES_NOT_EXIST" in str(getattr(exc, "error_code", "")) or "No such file" in str(exc):
            return None
        raise
