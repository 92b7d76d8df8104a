"""A plain-text account of the latest lifecycle run, read back from MLflow: `python -m llmops.summary`."""

from __future__ import annotations

import sys

from llmops import tracking
from llmops.params import STAGES

# MLflow names (tasks.common.tracking.CHART_NAMES; evaluate logs "<model>/<metric>")
KEY_METRICS = ("documents_in", "documents_kept", "train_tokens", "loss/val", "perf/tokens_per_s",
               "task/accuracy_before", "task/accuracy_after", "params",
               "teacher/task_accuracy", "student/task_accuracy", "pretrained/task_accuracy",
               "teacher/perplexity", "student/perplexity", "teacher/params", "student/params")


def summarize(dag_id: str) -> str:
    client = tracking.client()
    exp = client.get_experiment_by_name(dag_id)
    if exp is None:
        return f"No MLflow experiment {dag_id!r} in {tracking.tracking_uri()}."
    parents = client.search_runs([exp.experiment_id], "tags.kind = 'lifecycle'",
                                 order_by=["attributes.start_time DESC"], max_results=1)
    if not parents:
        return f"No lifecycle run in experiment {dag_id!r}."
    parent = parents[0]
    lines = [f"MLflow store: {tracking.tracking_uri()}",
             f"Lifecycle run {parent.data.tags.get('run_id')}: {parent.info.status} "
             f"(MLflow run {parent.info.run_id})"]
    children = client.search_runs([exp.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
                                  order_by=["attributes.start_time ASC"], max_results=200)
    for stage in STAGES:
        for run in (r for r in children if r.data.tags.get("stage") == stage):
            shown = {k: v for k, v in run.data.metrics.items() if k in KEY_METRICS}
            if "optim.lr" in run.data.params:  # the configured peak, not the last decayed value
                shown["peak_lr"] = float(run.data.params["optim.lr"])
            figures = ", ".join(f"{k}={v:.4g}" for k, v in sorted(shown.items()))
            lines.append(f"  {stage:<10} {run.data.tags.get('task_id', ''):<14} "
                         f"{run.info.status:<9} {figures}")
            tags = run.data.tags
            if tags.get("fork.step"):   # tasks/train/fork.py
                lines.append(f"  {'':<10} forked from MLflow run {tags.get('fork.parent_run_id')} "
                             f"at step {tags['fork.step']}")
            if tags.get("checkpoints.kept"):   # tasks/pretrain.py: what the retention policy left
                lines.append(f"  {'':<10} kept checkpoints: steps "
                             f"{tags['checkpoints.kept'].replace(',', ', ')}")
    champion = parent.data.tags.get("champion")
    if champion:
        name, version = champion.rsplit("/", 1)
        mv = client.get_model_version(name, version)
        lines.append(f"Registered model: {name} version {version} (alias 'champion'), "
                     f"the {mv.tags.get('candidate')}: models:/{name}@champion")
    else:
        lines.append("No model was promoted to 'champion' in this run.")
    lines.append(f"Open the MLflow UI: .venv/bin/mlflow ui --backend-store-uri "
                 f"{tracking.tracking_uri()} --port 5000   (or `make up`)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1] if len(sys.argv) > 1 else "llm_lifecycle"))
