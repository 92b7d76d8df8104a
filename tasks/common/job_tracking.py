"""MLflow from inside a job.

The Airflow side creates the child run and hands its id to the job as MLFLOW_RUN_ID (with
MLFLOW_TRACKING_URI), so a local process and a SageMaker container log to the same run. Run from
the CLI without those, a job opens its own run in experiment MLFLOW_EXPERIMENT_NAME (or 'llmops').
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any, Iterator

from tasks.configs import flatten, to_dict

MAX_PARAM_CHARS = 6000  # MLflow's param value limit
# MLflow 3 shows an experiment without this tag in its GenAI view (runs listed as evaluations).
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"

# The names metrics get in MLflow. Its UI groups a run's charts by the part of the name before
# "/", one section per group, so the loss curves (train and validation side by side) come first
# and the rest follows in sections that sort after them: optim/, perf/, resilience/ (goodput,
# badput, restarts, events). Results handed back to Airflow keep the plain keys.
CHART_NAMES = {
    "loss": "loss/train", "val_loss": "loss/val", "prose_val_loss": "loss/val_prose",
    "lr": "optim/lr", "grad_norm": "optim/grad_norm",
    "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu",
}


def chart_name(key: str) -> str:
    """The MLflow name of a training metric (CHART_NAMES); events: `resilience/event_<kind>`."""
    if key.startswith("event."):
        return "resilience/event_" + key[len("event."):]
    return CHART_NAMES.get(key, key)


def chart_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {chart_name(k): v for k, v in metrics.items()}


@contextlib.contextmanager
def stage_run(stage: str, config: Any) -> Iterator[Any]:
    """Open the job's MLflow run, log the resolved config as params and as config.json."""
    import mlflow

    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not run_id:
        _set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "llmops"))
    with mlflow.start_run(run_id=run_id or None) as run:
        if not run_id:
            mlflow.set_tag("stage", stage)
        resolved = to_dict(config) if not isinstance(config, dict) else config
        params = {k: str(v)[:MAX_PARAM_CHARS] for k, v in flatten(resolved).items()}
        existing = run.data.params
        # A retried job logs into the same run; MLflow refuses to change a logged param.
        fresh = {k: v for k, v in params.items() if k not in existing}
        if fresh:
            mlflow.log_params(fresh)
        log_json_artifact(resolved, "config.json")
        yield run


def _set_experiment(name: str) -> None:
    """Select (creating if needed) an experiment. With a local SQLite store its artifacts go beside
    the database: MLflow's default, ./mlruns, would land in whatever directory the job runs in."""
    import mlflow

    uri = mlflow.get_tracking_uri()
    if uri.startswith("sqlite:///") and mlflow.get_experiment_by_name(name) is None:
        db_dir = os.path.dirname(os.path.abspath(uri[len("sqlite:///"):]))
        location = "file://" + os.path.join(db_dir, "mlartifacts", name)
        try:
            mlflow.create_experiment(name, artifact_location=location,
                                     tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except Exception:  # created concurrently by another job
            pass
    experiment = mlflow.set_experiment(name)
    if experiment.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
        mlflow.set_experiment_tag(EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)


def log_json_artifact(data: Any, name: str, artifact_path: str | None = None) -> None:
    import mlflow

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, name)
        with open(path, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=True, default=str)
        mlflow.log_artifact(path, artifact_path=artifact_path)


def log_figure(fig: Any, name: str) -> None:
    """Log a matplotlib figure as a PNG artifact and close it."""
    import mlflow

    mlflow.log_figure(fig, name)
    import matplotlib.pyplot as plt

    plt.close(fig)
