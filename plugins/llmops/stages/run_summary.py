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
    latest_text(dag_id)       the newest run's plain-text account (`python -m
    llmops.stages.run_summary
                              [dag_id]`, make demo)

The summary in words (the note line, Markdown, the terminal's text) is
llmops.stages.run_summary_text.

MLflow client only (no torch, no Airflow), so it runs in a task, the API server and tests alike.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import time
from typing import Any

from tasks import configs  # stdlib only: the recipes' gate thresholds
from llmops.infra import tracking
from llmops.policy import promotion
from llmops.stages.run_summary_text import markdown, note_line, text

log = logging.getLogger(__name__)
# The XCom the promote task leaves its note line under (llmops.airflow.run_note copies it onto the
# run).
NOTE_XCOM = "run_note"
# The XCom a task that refuses the run's input leaves its message under before it fails
# (start_run: a misspelled Param, an impossible combination); the note and the page quote it.
REFUSAL_XCOM = "refusal"

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
            "mlflow_run_id": run.info.run_id, "reused": _reused(tags),
            "waiting": _waiting(tags), "attempts": _json_tag(tags, tracking.ATTEMPTS_TAG) or [],
            "paused_at_step": _int(tags.get("paused_at_step"))}


def _int(value: Any) -> int | None:
    return int(value) if str(value or "").strip().lstrip("-").isdigit() else None


def _float(value: Any) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


def _json_tag(tags: dict[str, str], name: str) -> Any:
    try:
        return json.loads(tags[name]) if tags.get(name) else None
    except ValueError:
        return None


def _reused(tags: dict[str, str]) -> dict[str, Any] | None:
    """A stage whose job was not run (llmops.infra.tracking.mark_reused): which run computed its
    outputs."""
    if not tags.get("cached_from") and not tags.get("cached_from_job"):
        return None
    return {"mlflow_run_id": tags.get("cached_from", ""), "run_id": tags.get("cached_from_run", ""),
            "job": tags.get("cached_from_job", ""), "how": tags.get("reuse", "cache"),
            "source_duration_s": None}


def _waiting(tags: dict[str, str]) -> dict[str, Any] | None:
    """The job's wait in the service's queue (llmops.infra.tracking.mark_waiting): the service's
    reason while it waits, how long it waited once it started."""
    since = _float(tags.get(tracking.WAITING_SINCE_TAG))
    if since is None:
        return None
    return {"reason": tags.get(tracking.WAITING_TAG, ""), "since_s": since,
            "queued_s": _float(tags.get(tracking.QUEUED_TAG))}


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
    `max_steps` (the param its config logged, tasks.common.job_tracking.stage_run), latest train
    loss, tokens/s, goodput if logged yet, and an ETA at the average step rate since the run started
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


DEFAULT_MODEL_NAME = "llm-lifecycle"   # the registered model of a run without registered_model_name
ALREADY_REGISTERED = re.compile(r"already registered as version (?P<version>\S+)")
# What the gate's thresholds are called in its config (tasks/configs/gate_config.py; the parent
# run's params `gate.<name>`), in the order the page lists them.
THRESHOLDS = ("min_task_accuracy", "max_perplexity", "max_contaminated_share", "exclude_contaminated",
              "confidence", "power")


def _gate(client: Any, parent: Any) -> dict[str, Any]:
    """The gate's decision: its whole record (`gate/decision.json` on the parent run) when the
    gate wrote one, else what older runs hold (the parent's `gate` tag, the registered version's
    `gate.*` tags); the thresholds and rules it applied (else the run's config, its params
    `gate.*`), and, per threshold, whether it is the recipe's value or the run's own."""
    tags, params = parent.data.tags, parent.data.params
    gate: dict[str, Any] = {"outcome": tags.get("gate"), "champion": tags.get("champion"),
                            "model_name": None, "version": None, "candidate": None,
                            "reasons": None, "compared_to": None, "aliases": [], "paired": {},
                            "comparisons": {}, "contamination": {}, "already_registered": False}
    decision = tracking.read_json_artifact(parent.info.run_id, promotion.DECISION_ARTIFACT) \
        if tags.get("gate") else None
    if decision:
        chosen = decision.get("candidate")
        model = (decision.get("models") or {}).get(chosen) or {}
        gate.update(outcome=decision.get("outcome"), candidate=chosen,
                    model_name=decision.get("model_name"), version=decision.get("version"),
                    compared_to=decision.get("champion_before") or "no champion yet",
                    already_registered=bool(decision.get("already_registered")),
                    already_champion=bool(decision.get("already_champion")),
                    reasons=decision.get("reasons") or "; ".join(model.get("reasons") or []) or "none",
                    comparisons=model.get("comparisons") or {},
                    contamination=decision.get("contamination") or {},
                    rules=decision.get("rules") or {}, decision=True)
    same = ALREADY_REGISTERED.match(str(tags.get("gate") or ""))
    if same:   # an older run whose model was registered before: nothing registered now
        gate.update(outcome="already_registered", version=same["version"], already_registered=True)
    versions = [] if gate["already_registered"] else client.search_model_versions(
        f"tags.lifecycle_run_id = '{parent.info.run_id}'")
    if versions:
        mv = max(versions, key=lambda v: int(v.version))
        aliases = list(getattr(client.get_model_version(mv.name, mv.version), "aliases", []) or [])
        gate.update(model_name=mv.name, version=str(mv.version),
                    candidate=gate["candidate"] or mv.tags.get("candidate"),
                    reasons=gate["reasons"] or mv.tags.get("gate.reasons"),
                    compared_to=gate["compared_to"] or mv.tags.get("gate.compared_to"),
                    aliases=sorted(aliases),
                    paired={k.removeprefix("gate.paired."): v for k, v in sorted(mv.tags.items())
                            if k.startswith("gate.paired.")},
                    # lineage of a version whose pretraining forked another's
                    # (llmops.policy.promotion)
                    fork={k.removeprefix("fork."): v for k, v in sorted(mv.tags.items())
                          if k.startswith("fork.")})
        if gate["outcome"] is None and "gate.passed" in mv.tags:
            gate["outcome"] = "passed" if mv.tags["gate.passed"] == "true" else "refused"
    if gate["already_registered"] and not gate["model_name"]:
        gate["model_name"] = (tags.get("champion") or "").rpartition("/")[0] or \
            params.get("registered_model_name") or DEFAULT_MODEL_NAME
    if gate["already_registered"] and not gate["candidate"] and gate["model_name"]:
        # An older run did not record which model it was: the one holding these weights is.
        from mlflow.exceptions import MlflowException

        try:
            same_version = client.get_model_version(gate["model_name"], gate["version"])
            gate["candidate"] = same_version.tags.get("candidate")
        except MlflowException:   # the version was deleted since
            pass
    gate["thresholds"] = _thresholds(decision, params, tags.get("recipe"))
    if not gate.get("rules"):
        gate["rules"] = _rules(params)
    return gate


def _thresholds(decision: dict[str, Any] | None, params: dict[str, str],
                recipe: str | None) -> dict[str, dict[str, Any]]:
    """{name: {"value", "recipe"}}: each threshold the gate applied and the recipe's own value
    (None when the recipe is unknown), so a page can say where a surprising one comes from."""
    applied = (decision or {}).get("thresholds") or {}
    from_recipe: dict[str, Any] = {}
    if recipe:
        try:
            from_recipe = configs.to_dict(configs.recipe(recipe))["gate"]
        except configs.ConfigError:   # a recipe this code no longer has
            from_recipe = {}
    out = {}
    for name in THRESHOLDS:
        value = applied.get(name, params.get(f"gate.{name}"))
        if value is None:
            continue
        if isinstance(value, str):
            value = value == "True" if value in ("True", "False") else _float(value)
        out[name] = {"value": value, "recipe": from_recipe.get(name)}
    return out


def _rules(params: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The gate's rules against the champion as the run's config had them (params
    `gate.paired.<metric>.policy|margin`, `gate.champion_margins.<metric>`), for runs from before
    the gate recorded its decision."""
    rules: dict[str, dict[str, Any]] = {}
    for key, value in params.items():
        if key.startswith("gate.champion_margins."):
            rules.setdefault(key.removeprefix("gate.champion_margins."),
                             {"policy": "margin", "margin": _float(value), "decides": True})
    for key, value in params.items():
        if key.startswith("gate.paired.") and key.count(".") >= 3:
            metric, _, field = key.removeprefix("gate.paired.").rpartition(".")
            rule = rules.setdefault(metric, {"decides": True})
            rule[field] = _float(value) if field == "margin" else value
    return dict(sorted(rules.items()))


def _reused_sources(client: Any, experiment_id: str, stages: list[dict[str, Any]]) -> None:
    """Each reused stage's `source_duration_s`: how long the job whose outputs it took ran (one
    search for all of them)."""
    ids = sorted({s["reused"]["mlflow_run_id"] for s in stages
                  if s["reused"] and s["reused"]["mlflow_run_id"]})
    if not ids:
        return
    quoted = ", ".join(f"'{i}'" for i in ids)
    sources = {r.info.run_id: r for r in client.search_runs(
        [experiment_id], f"attributes.run_id IN ({quoted})", max_results=len(ids))}
    for s in stages:
        source = sources.get((s["reused"] or {}).get("mlflow_run_id", ""))
        if source is not None:
            s["reused"]["source_duration_s"] = _seconds(source.info.start_time, source.info.end_time)
            s["reused"]["run_id"] = s["reused"]["run_id"] or source.data.tags.get("run_id", "")


def reuse_saving(stages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the reused stages cost here against what their jobs took when they ran."""
    reused = [s for s in stages if s["reused"]]
    if not reused:
        return None
    then = [s["reused"]["source_duration_s"] for s in reused if s["reused"]["source_duration_s"] is not None]
    here = sum(s["duration_s"] or 0.0 for s in reused)
    return {"stages": len(reused), "then_s": sum(then) if then else None, "here_s": here,
            "saved_s": max(0.0, sum(then) - here) if then else None,
            "runs": sorted({s["reused"]["run_id"] for s in reused if s["reused"]["run_id"]})}


def _paused(parent: Any, stages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A pretraining paused on request: its step and how to resume. The parent run's tags
    `paused_at_step` and `resume` when the run has them, else the stage run's `paused_at_step`."""
    tags = parent.data.tags
    step = _int(tags.get("paused_at_step"))
    stage = next((s for s in stages if s["paused_at_step"] is not None), None)
    if step is None and stage is None:
        return None
    if step is None:
        step = stage["paused_at_step"]
    resume = _json_tag(tags, "resume") or {"from_run": tags.get("run_id", ""), "start_at": "pretrain",
                                          "fork_step": step}
    return {"step": step, "task": stage["task_id"] if stage else "pretrain", "resume": resume}


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
    _reused_sources(client, parent.info.experiment_id, stages)
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
        "live": live, "as_of_ms": now_ms, "reuse": reuse_saving(stages),
        "paused": _paused(parent, stages),
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
