"""One lifecycle DAG run, read back from MLflow: what the run page shows and the promote task mirrors.

    collect(dag_id, run_id)   the parent run (tags kind/dag_id/run_id) and its child runs ->
                              a plain dict: stage timeline, loss curves per training stage, the
                              sweep's trials, goodput and its badput buckets, data prep counts
                              and drop reasons, the evaluation table, the gate and the version;
                              for a forked pretraining its parent's curve up to the fork step,
                              and the checkpoint steps the pretraining kept; for each
                              training run MLflow still marks RUNNING, its latest figures and an
                              ETA (`live`)
    headline(summary)         the few figures a reader wants first (`summary/*` metrics)
    publish(dag_id, run_id)   headline metrics + summary.json + summary.md on the parent run
    latest(dag_id)            the newest lifecycle DAG run's id (what `make demo` just ran)
    latest_text(dag_id)       the newest run's plain-text account (`python -m llmops.run_summary
                              [dag_id]`, make demo)

The summary in words (the note line, Markdown, the terminal's text) is llmops.run_summary_text.

MLflow client only (no torch, no Airflow), so it runs in a task, the API server and tests alike.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from typing import Any

from llmops import tracking
from llmops.run_summary_text import markdown, note_line, text

log = logging.getLogger(__name__)
# The XCom the promote task leaves its note line under (llmops.run_note copies it onto the run).
NOTE_XCOM = "run_note"

TRAINING_STAGES = ("pretrain", "finetune", "distill")
# Metrics are being renamed from `val_loss`, `goodput`, `dropped.<reason>`, `<model>.<metric>` to
# `loss/val`, `resilience/goodput`, `dropped/<reason>`, `<model>/<metric>`. Runs logged before and
# after both read through these two maps, under the old (canonical) names.
METRIC_ALIASES: dict[str, tuple[str, ...]] = {
    "train_loss": ("loss/train", "train/loss", "train_loss", "loss"),
    "val_loss": ("loss/val", "val/loss", "val_loss"),
    "goodput": ("resilience/goodput", "goodput"),
    "goodput_excluding_hang_wait": ("resilience/goodput_excluding_hang_wait",
                                    "goodput_excluding_hang_wait"),
    "productive_s": ("resilience/productive_s", "productive_s"),
    "trial_steps_run": ("trial/steps_run", "trial_steps_run"),
    "tokens_per_s": ("perf/tokens_per_s", "tokens_per_s"),
}
# canonical prefix -> the prefixes a family of metrics may be logged under
METRIC_FAMILIES: dict[str, tuple[str, ...]] = {
    "dropped.": ("dropped/", "dropped."),
    "badput.": ("resilience/badput_", "badput."),
    "resilience.": ("resilience/", "resilience."),
}
DATA_COUNTS = ("documents_in", "documents_kept", "documents_dropped", "train_tokens",
               "val_tokens", "train_rows", "val_rows", "vocab_size", "sft_train_examples",
               "sft_eval_examples")
EVAL_COLUMNS = ("params", "val_loss", "perplexity", "bits_per_byte", "task_accuracy")


def metric_key(metrics: dict[str, float], name: str) -> str | None:
    """The key under which `name` (canonical, see METRIC_ALIASES) was logged, if any. A name
    without aliases is also looked for with its first `.` as `/` (`sweep.best_val_loss`)."""
    for key in METRIC_ALIASES.get(name, (name.replace(".", "/", 1), name)):
        if key in metrics:
            return key
    return None


def metric(metrics: dict[str, float], name: str) -> float | None:
    key = metric_key(metrics, name)
    return metrics[key] if key is not None else None


def family(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """{suffix: value} of the metrics logged under any spelling of `prefix` (METRIC_FAMILIES)."""
    out: dict[str, float] = {}
    for logged in METRIC_FAMILIES.get(prefix, (prefix,)):
        for key, value in metrics.items():
            if key.startswith(logged):
                out.setdefault(key[len(logged):], value)
    return out


def split_model_metric(key: str) -> tuple[str, str]:
    """'student/task_accuracy' or 'student.task_accuracy' -> ('student', 'task_accuracy')."""
    sep = "/" if "/" in key else "."
    model, _, name = key.partition(sep)
    return model, name


def find_parent(client: Any, dag_id: str, run_id: str):
    """The DAG run's MLflow parent run, or None (the run has not reached start_run yet)."""
    exp = client.get_experiment_by_name(dag_id)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id],
                              f"tags.kind = '{tracking.PARENT_KIND}' and tags.dag_id = '{dag_id}' "
                              f"and tags.run_id = '{run_id}'",
                              order_by=["attributes.start_time ASC"], max_results=1)
    return runs[0] if runs else None


def _seconds(start_ms: int | None, end_ms: int | None) -> float | None:
    if not start_ms or not end_ms:
        return None
    return max(0.0, (end_ms - start_ms) / 1000.0)


def _history(client: Any, run: Any, name: str) -> list[list[float]]:
    key = metric_key(run.data.metrics, name)
    if key is None:
        return []
    # A reused stage (step cache, from_run) has the curve of the job that computed its outputs.
    source = run.data.tags.get("cached_from") or run.info.run_id
    points = {m.step: m.value for m in client.get_metric_history(source, key)}
    return [[float(step), float(value)] for step, value in sorted(points.items())]


def _source(client: Any, run: Any) -> Any:
    """The run that computed `run`'s outputs: itself, or for a reused stage the job's run
    (`cached_from`), whose tags say what that job did (its fork, the checkpoints it kept)."""
    source = run.data.tags.get("cached_from")
    return client.get_run(source) if source and source != run.info.run_id else run


def _fork(client: Any, run: Any, curve: dict[str, Any]) -> dict[str, Any] | None:
    """A forked training stage (tags fork.parent_run_id, fork.step; tasks/train/fork.py): its
    parent's curves up to the fork step, and its own from there, the parent's point at the fork
    step first where the fork logged none (at that step the fork's state is the parent's)."""
    tags = _source(client, run).data.tags
    parent_id, step = tags.get("fork.parent_run_id"), tags.get("fork.step")
    if not parent_id or step in (None, ""):
        return None
    from mlflow.exceptions import MlflowException

    step_f = float(step)
    try:
        parent = client.get_run(parent_id)
    except MlflowException:  # a parent deleted from MLflow: the fork's own curve only
        log.warning("the fork's parent run %s is not in MLflow", parent_id)
        return {"step": int(step_f), "parent_run_id": parent_id, "parent": parent_id,
                "segments": {}}
    segments: dict[str, dict[str, list[list[float]]]] = {}
    for name in ("train", "val"):
        before = [p for p in _history(client, parent, f"{name}_loss") if p[0] <= step_f]
        after = [p for p in curve[name] if p[0] >= step_f]
        if before and (not after or after[0][0] > step_f):
            after = [before[-1]] + after
        segments[name] = {"parent": before, "fork": after}
    return {"step": int(step_f), "parent_run_id": parent_id,
            "parent": parent.data.tags.get("run_id") or parent_id, "segments": segments}


def _checkpoints(client: Any, run: Any) -> dict[str, Any] | None:
    """The checkpoint steps a training job kept (tag checkpoints.kept, tasks/train/pretraining.py)
    and the retention policy that chose them (its params keep_checkpoints, keep_every)."""
    source = _source(client, run)
    tags, params = source.data.tags, source.data.params
    if "checkpoints.kept" not in tags:
        return None
    kept = [int(s) for s in tags["checkpoints.kept"].split(",") if s.strip()]
    count = tags.get("checkpoints.kept_count", "")

    def number(name: str) -> int | None:
        return int(params[name]) if str(params.get(name, "")).isdigit() else None

    return {"kept": kept, "count": int(count) if count.isdigit() else len(kept),
            "keep_last": number("keep_checkpoints"), "keep_every": number("keep_every"),
            "mlflow_run_id": source.info.run_id}


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _stage_row(run: Any) -> dict[str, Any]:
    tags = run.data.tags
    return {"stage": tags.get("stage", ""), "task_id": tags.get("task_id", run.info.run_name),
            "map_index": int(tags.get("map_index", "-1") or -1), "status": run.info.status,
            "start_ms": run.info.start_time, "end_ms": run.info.end_time,
            "duration_s": _seconds(run.info.start_time, run.info.end_time),
            "try_number": int(tags.get("try_number", "1") or 1),
            "mlflow_run_id": run.info.run_id}


def _trial(run: Any) -> dict[str, Any]:
    tags, metrics, params = run.data.tags, run.data.metrics, run.data.params
    number = tags.get("trial_number", tags.get("trial"))
    lr = params.get("optim.lr")
    return {"number": int(number) if number not in (None, "") else None,
            "lr": float(lr) if lr not in (None, "") else None,
            "state": tags.get("trial_state") or run.info.status.lower(),
            "val_loss": _finite(metric(metrics, "val_loss")),
            "steps": metric(metrics, "trial_steps_run"), "mlflow_run_id": run.info.run_id}


def _goodput(run: Any) -> dict[str, Any] | None:
    metrics = run.data.metrics
    goodput = metric(metrics, "goodput")
    if goodput is None:
        return None
    buckets = {k.removesuffix("_s"): v for k, v in family(metrics, "badput.").items() if k.endswith("_s")}
    counters = {k: v for k, v in family(metrics, "resilience.").items()
                if not k.startswith(("goodput", "badput_", "productive_s"))}
    return {"goodput": goodput,
            "goodput_excluding_hang_wait": metric(metrics, "goodput_excluding_hang_wait"),
            "productive_s": metric(metrics, "productive_s") or 0.0,
            "badput_s": dict(sorted(buckets.items(), key=lambda kv: -kv[1])),
            "resilience": counters}


def _live(client: Any, run: Any, now_ms: int, curve: dict[str, Any] | None) -> dict[str, Any]:
    """A training run MLflow marks RUNNING, as it stands at `now_ms`: its latest logged step of
    `max_steps` (the param its config logged, tasks.common.tracking.stage_run), latest train loss,
    tokens/s, goodput if logged yet, and an ETA at the average step rate since the run started
    (steps from the fork step for a fork; a retry's run keeps its first start, so slower)."""
    train = curve["train"] if curve else _history(client, run, "train_loss")
    metrics, params = run.data.metrics, run.data.params
    step = int(train[-1][0]) if train else None
    max_steps = int(params["max_steps"]) if str(params.get("max_steps", "")).isdigit() else None
    base = int((curve or {}).get("fork", {}).get("step", 0))
    elapsed = _seconds(run.info.start_time, now_ms)
    rate = (step - base) / elapsed if step is not None and step > base and elapsed else None
    eta = max(0.0, (max_steps - step) / rate) if rate and max_steps is not None else None
    return {**_stage_row(run), "step": step, "max_steps": max_steps,
            "train_loss": _finite(train[-1][1]) if train else None,
            "tokens_per_s": metric(metrics, "tokens_per_s"), "goodput": metric(metrics, "goodput"),
            "elapsed_s": elapsed, "steps_per_s": rate, "eta_s": eta,
            "eta_ms": now_ms + int(eta * 1000) if eta is not None else None}


def _evaluation(run: Any) -> dict[str, Any]:
    table: dict[str, dict[str, float]] = {}
    for key, value in run.data.metrics.items():
        model, name = split_model_metric(key)
        if name:
            table.setdefault(model, {})[name] = value
    suites = sorted({n for row in table.values() for n in row
                     if n.startswith("suite.") and n.endswith(".accuracy")})
    columns = [c for c in EVAL_COLUMNS if any(c in row for row in table.values())] + suites
    order = ("pretrained", "teacher", "student", "champion")
    models = sorted(table, key=lambda m: (order.index(m) if m in order else len(order), m))
    return {"models": models, "columns": columns, "table": table,
            "mlflow_run_id": run.info.run_id}


def _gate(client: Any, parent: Any) -> dict[str, Any]:
    tags = parent.data.tags
    gate: dict[str, Any] = {"outcome": tags.get("gate"), "champion": tags.get("champion"),
                            "model_name": None, "version": None, "candidate": None,
                            "reasons": None, "compared_to": None, "aliases": []}
    versions = client.search_model_versions(f"tags.lifecycle_run_id = '{parent.info.run_id}'")
    if not versions:
        return gate
    mv = max(versions, key=lambda v: int(v.version))
    aliases = list(getattr(client.get_model_version(mv.name, mv.version), "aliases", []) or [])
    gate.update(model_name=mv.name, version=str(mv.version), candidate=mv.tags.get("candidate"),
                reasons=mv.tags.get("gate.reasons"), compared_to=mv.tags.get("gate.compared_to"),
                aliases=sorted(aliases),
                paired={k.removeprefix("gate.paired."): v for k, v in sorted(mv.tags.items())
                        if k.startswith("gate.paired.")},
                # lineage of a version whose pretraining forked another's (llmops.promotion)
                fork={k.removeprefix("fork."): v for k, v in sorted(mv.tags.items())
                      if k.startswith("fork.")})
    if gate["outcome"] is None and "gate.passed" in mv.tags:
        gate["outcome"] = "passed" if mv.tags["gate.passed"] == "true" else "refused"
    return gate


def collect(dag_id: str, run_id: str, client: Any = None,
            now_ms: int | None = None) -> dict[str, Any] | None:
    """Everything the run page shows about one DAG run, or None when MLflow has no parent run.
    `now_ms` (default: now) is the time the ETAs of running stages count from (`as_of_ms`)."""
    client = client or tracking.client()
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    parent = find_parent(client, dag_id, run_id)
    if parent is None:
        return None
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
                                  order_by=["attributes.start_time ASC"], max_results=500)
    by_stage: dict[str, list[Any]] = {}
    for run in children:
        by_stage.setdefault(run.data.tags.get("stage", ""), []).append(run)
    stages = sorted((_stage_row(r) for r in children), key=lambda s: (s["start_ms"] or 0, s["map_index"]))
    curves = {}
    for stage in TRAINING_STAGES:
        for run in by_stage.get(stage, [])[-1:]:  # one run per stage task (a retry reuses it)
            curves[stage] = {"train": _history(client, run, "train_loss"),
                             "val": _history(client, run, "val_loss"),
                             "mlflow_run_id": run.info.run_id}
            fork = _fork(client, run, curves[stage])
            if fork:
                curves[stage]["fork"] = fork
    # what is training now: a RUNNING run with a train loss or a step budget (a stage's, a trial's)
    own = {c["mlflow_run_id"]: c for c in curves.values()}  # curves already read
    live = [_live(client, r, now_ms, own.get(r.info.run_id))
            for r in children if r.info.status == "RUNNING"
            and (metric_key(r.data.metrics, "train_loss") or "max_steps" in r.data.params)]
    trials = sorted(({**_trial(r), "curve": _history(client, r, "val_loss")}
                     for r in by_stage.get("sweep", [])),
                    key=lambda t: (t["number"] is None, t["number"] or 0))
    pm = parent.data.metrics
    sweep = {"best_trial": parent.data.tags.get("sweep.best_trial", parent.data.tags.get("sweep/best_trial")),
             "best_val_loss": metric(pm, "sweep.best_val_loss"),
             **{k: metric(pm, f"sweep.trials_{k}") for k in ("complete", "pruned", "failed")}}
    pretrain = by_stage.get("pretrain", [])[-1:]
    data_runs = by_stage.get("data_prep", [])[-1:]
    data = None
    if data_runs:
        m = data_runs[0].data.metrics
        data = {"counts": {k: m[k] for k in DATA_COUNTS if k in m},
                "drop_reasons": dict(sorted(family(m, "dropped.").items(), key=lambda kv: -kv[1])),
                "mlflow_run_id": data_runs[0].info.run_id}
    evaluation = _evaluation(by_stage["evaluate"][-1]) if by_stage.get("evaluate") else None
    summary = {
        "dag_id": dag_id, "run_id": run_id, "mlflow_run_id": parent.info.run_id,
        "experiment_id": parent.info.experiment_id, "status": parent.info.status,
        "recipe": parent.data.tags.get("recipe"),
        "start_ms": parent.info.start_time, "end_ms": parent.info.end_time,
        "duration_s": _seconds(parent.info.start_time, parent.info.end_time),
        "stages": stages, "curves": curves, "trials": trials, "sweep": sweep,
        "goodput": _goodput(pretrain[0]) if pretrain else None, "data": data,
        "checkpoints": _checkpoints(client, pretrain[0]) if pretrain else None,
        "evaluation": evaluation, "gate": _gate(client, parent),
        "live": live, "as_of_ms": now_ms,
    }
    summary["headline"] = headline(summary)
    return summary


def headline(summary: dict[str, Any]) -> dict[str, float]:
    """The run's key figures as flat `summary/*` metrics (what the parent run gets)."""
    out: dict[str, float] = {}
    data = summary.get("data") or {}
    for key in ("documents_in", "documents_kept", "train_tokens"):
        if key in data.get("counts", {}):
            out[f"summary/{key}"] = data["counts"][key]
    if summary["sweep"].get("best_val_loss") is not None:
        out["summary/sweep_best_val_loss"] = summary["sweep"]["best_val_loss"]
    for stage, curve in summary["curves"].items():
        if curve["val"]:
            out[f"summary/{stage}_val_loss"] = curve["val"][-1][1]
    if summary.get("goodput"):
        out["summary/pretrain_goodput"] = summary["goodput"]["goodput"]
    gate, evaluation = summary["gate"], summary.get("evaluation")
    if evaluation and gate.get("candidate") in evaluation["table"]:
        row = evaluation["table"][gate["candidate"]]
        for key in ("task_accuracy", "perplexity"):
            if key in row:
                out[f"summary/candidate_{key}"] = row[key]
    if gate.get("version"):
        out["summary/registered_version"] = float(gate["version"])
    if gate.get("outcome"):
        out["summary/gate_passed"] = 1.0 if gate["outcome"] == "passed" else 0.0
    trained = [s["duration_s"] for s in summary["stages"] if s["duration_s"] is not None]
    if trained:
        out["summary/stage_seconds"] = sum(trained)
    return out


def latest(dag_id: str, client: Any = None) -> str | None:
    """The DAG run id of the newest lifecycle parent run in the DAG's experiment, or None."""
    client = client or tracking.client()
    experiment = client.get_experiment_by_name(dag_id)
    if experiment is None:
        return None
    parents = client.search_runs([experiment.experiment_id], "tags.kind = 'lifecycle'",
                                 order_by=["attributes.start_time DESC"], max_results=1)
    return parents[0].data.tags.get("run_id") if parents else None


def latest_text(dag_id: str) -> str:
    """`text` of the DAG's newest lifecycle run, or a line saying there is none."""
    run_id = latest(dag_id)
    summary = collect(dag_id, run_id) if run_id else None
    return text(summary) if summary else f"No lifecycle run of {dag_id!r} in {tracking.tracking_uri()}."


def publish(dag_id: str, run_id: str, *, recipe: str | None = None) -> dict[str, Any] | None:
    """Mirror the run's headline figures onto its MLflow parent run (metrics, summary.json,
    summary.md, tag `summary`) and return the summary; None when there is no parent run."""
    client = tracking.client()
    parent = find_parent(client, dag_id, run_id)
    if parent is None:
        return None
    if recipe:
        client.set_tag(parent.info.run_id, "recipe", recipe)
    summary = collect(dag_id, run_id, client)
    summary["note"] = note_line(summary)
    for key, value in summary["headline"].items():
        client.log_metric(parent.info.run_id, key, value)
    client.set_tag(parent.info.run_id, "summary", summary["note"])
    with tempfile.TemporaryDirectory() as tmp:
        for name, content in (("summary.json", json.dumps(summary, indent=2, sort_keys=True, default=str)),
                              ("summary.md", markdown(summary))):
            path = os.path.join(tmp, name)
            with open(path, "w") as fh:
                fh.write(content)
            client.log_artifact(parent.info.run_id, path)
    return summary


def record(dag_id: str, run_id: str, *, recipe: str | None = None) -> str | None:
    """The promote task's part: publish the summary of the DAG run and return its note line. A
    report that cannot be written is logged, never fails the promotion it reports."""
    try:
        summary = publish(dag_id, run_id, recipe=recipe)
    except Exception:
        log.exception("could not write the run summary of %s %s", dag_id, run_id)
        return None
    if summary is None:
        return None
    log.info("run summary: %s", summary["note"])
    return summary["note"]


if __name__ == "__main__":
    import sys

    print(latest_text(sys.argv[1] if len(sys.argv) > 1 else "llm_lifecycle"))
