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
            mlflow.create_experiment(name, artifact_location=location)
        except Exception:  # created concurrently by another job
            pass
    mlflow.set_experiment(name)


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
