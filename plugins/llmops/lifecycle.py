"""What the lifecycle DAG's tasks do on the Airflow side: resolve and validate the run's settings,
build each stage's job spec from upstream results, choose the best trial, and promote a model.

Cheap work only (no torch): the heavy lifting happens in the jobs these specs describe.
"""

from __future__ import annotations

import copy
import glob
import os
import re
from typing import Any

from llmops import params as lifecycle_params
from llmops import promotion
from llmops import settings, tracking
from llmops.jobs.spec import JobSpec
from llmops.sweep import budget as sweep_budget
from llmops.sweep import stage as sweep_stage
from tasks import configs

ENTRYPOINTS = {
    "data_prep": "tasks.data.prep",
    "sweep": "tasks.sweep",
    "pretrain": "tasks.pretrain",
    "finetune": "tasks.finetune",
    "distill": "tasks.distill",
    "distill_cache": "tasks.distill_cache",
    "evaluate": "tasks.evaluate",
}


class LifecycleParamError(ValueError):
    """A run's Params are wrong; the message names the Param and the fix."""


def resolve(params: dict[str, Any]) -> configs.LifecycleConfig:
    """Recipe + the run's non-empty knobs -> a validated LifecycleConfig (paths still unset)."""
    try:
        cfg = configs.recipe(params.get("recipe") or "demo")
    except configs.ConfigError as exc:
        raise LifecycleParamError(f"Param 'recipe': {exc}") from None
    for name, path in lifecycle_params.KNOBS.items():
        value = params.get(name)
        if value is not None:
            lifecycle_params.set_path(cfg, path, value)
    # One tokenizer serves every model: keep vocab and context in step with data prep.
    for model in (cfg.pretrain.model, cfg.distill.student):
        model.vocab_size, model.block_size = cfg.data.vocab_size, cfg.data.seq_len
    try:
        cfg = configs.from_dict(configs.LifecycleConfig, configs.to_dict(cfg))
    except configs.ConfigError as exc:
        raise LifecycleParamError(f"Invalid lifecycle parameters: {exc}") from None
    for pattern in cfg.data.inputs + cfg.data.sft_inputs:
        if "://" not in pattern and not glob.glob(pattern):
            raise LifecycleParamError(
                f"Param 'data_inputs'/'sft_inputs': {pattern!r} matches no file. Give existing "
                "local paths or globs (JSONL or .txt), or leave empty for the demo data.")
    return cfg


def start_run(params: dict[str, Any], *, dag_id: str, run_id: str) -> dict[str, Any]:
    """Validate the Params, fix this run's storage paths, open the MLflow parent run, and pin
    the current champion (by version) for the run's evaluation."""
    cfg = resolve(params)
    backends = {stage: params.get(f"backend_{stage}") or "local" for stage in lifecycle_params.STAGES}
    sweep_budget.check_sweep(cfg, backends["sweep"], params)  # refuse before any job starts
    root = os.path.join(params.get("storage_root") or settings.storage_root(), dag_id,
                        re.sub(r"[^A-Za-z0-9_.-]+", "_", run_id))
    config = configs.to_dict(cfg)
    parent = tracking.start_parent_run(experiment=dag_id, dag_id=dag_id, run_id=run_id,
                                       config={**config, "backends": backends, "root": root})
    model_name = params.get("registered_model_name") or "llm-lifecycle"
    # Read once per DAG run: if evaluate read it at execute time, a champion crowned between two
    # tries would change its config, hence its job name, and the retry would start a second job.
    champion = promotion.current_champion(model_name)
    return {"dag_id": dag_id, "run_id": run_id, "root": root, "config": config,
            "champion": {k: champion[k] for k in ("version", "uri", "run_id")} if champion else None,
            "backends": backends, "experiment": dag_id, "parent_run_id": parent,
            "resources": params.get("stage_resources") or {}, "team": params.get("team") or "",
            "priority": params.get("priority"),
            "model_name": model_name}


def _spec(run: dict[str, Any], stage: str, config: dict[str, Any], *,
          data_hash: str = "", lineage: dict[str, str] | None = None) -> dict[str, Any]:
    # Team and priority travel as tags: cost allocation everywhere, and the fair-share identifier
    # and scheduling priority where the backend schedules (Batch, HyperPod).
    scheduling = {"team": run.get("team") or ""}
    if run.get("priority") is not None:
        scheduling["priority"] = str(run["priority"])
    return JobSpec(
        stage=stage, entrypoint=ENTRYPOINTS[stage], config=config, backend=run["backends"][stage],
        output_uri=config.get("output_dir", ""), mlflow_experiment=run["experiment"],
        mlflow_parent_run_id=run["parent_run_id"],
        tags={"data_hash": data_hash, **(lineage or {}), **{k: v for k, v in scheduling.items() if v}},
        **(run.get("resources") or {}).get(stage, {}),
    ).to_dict()


def _out(run: dict[str, Any], *parts: str) -> str:
    return os.path.join(run["root"], *parts)


def data_prep_spec(run: dict[str, Any]) -> dict[str, Any]:
    config = {**run["config"]["data"], "output_dir": _out(run, "data_prep")}
    return _spec(run, "data_prep", config)


def sweep_trials(run: dict[str, Any], data: dict[str, Any]) -> list[dict[str, Any]]:
    """Open the run's Optuna study; one op_kwargs dict per slot, for
    `TrialOperator.partial(...).expand(op_kwargs=...)` (plugins/llmops/sweep)."""
    return sweep_stage.plan_trials(run, data)


def trial_spec(run: dict[str, Any], data: dict[str, Any], study: dict[str, Any], slot: int,
               trial: dict[str, Any]) -> dict[str, Any]:
    """One trial: a short pretraining run with the trial's hyperparameters, evaluated (and
    checkpointed, so a retry resumes) at every point where the study's pruner may stop it."""
    from llmops.sweep import study as studies

    steps, every = study["steps"], study["eval_interval"]
    config = copy.deepcopy(run["config"]["pretrain"])
    config.update(data_dir=data["outputs"]["data_dir"],
                  output_dir=_out(run, "sweep", f"trial-{trial['number']}"),
                  max_steps=steps, checkpoint_interval=every, eval_interval=every)
    config["optim"]["warmup_steps"] = min(config["optim"]["warmup_steps"], steps // 5)
    sweep_stage.apply_best(config, {"params": trial["params"]})
    spec = _spec(run, "sweep", config, data_hash=data["data_hash"],
                 lineage={"trial": str(trial["number"]), "slot": str(slot), "study": study["name"]})
    spec["env"] = {**spec["env"], **studies.job_env(study, trial["number"], spec["backend"])}
    return spec


def pretrain_spec(run: dict[str, Any], data: dict[str, Any], best: dict[str, Any]) -> dict[str, Any]:
    config = copy.deepcopy(run["config"]["pretrain"])
    config.update(data_dir=data["outputs"]["data_dir"], output_dir=_out(run, "pretrain"))
    sweep_stage.apply_best(config, best)  # the best trial's hyperparameters (and ladder size)
    return _spec(run, "pretrain", config, data_hash=data["data_hash"],
                 lineage={"sweep_best_run_id": best.get("mlflow_run_id", "")})


def finetune_spec(run: dict[str, Any], data: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    config = {**run["config"]["finetune"], "base_model": base["outputs"]["model_dir"],
              "data_dir": data["outputs"]["data_dir"], "output_dir": _out(run, "finetune")}
    return _spec(run, "finetune", config, data_hash=data["data_hash"],
                 lineage={"base_run_id": base.get("mlflow_run_id", "")})


def distill_spec(run: dict[str, Any], data: dict[str, Any], teacher: dict[str, Any],
                 cache: dict[str, Any] | None = None) -> dict[str, Any]:
    """The student's job; with `cache` (teacher_cache_spec's result) it reads the teacher's
    cached logits instead of running the teacher."""
    config = {**run["config"]["distill"], "teacher_model": teacher["outputs"]["model_dir"],
              "data_dir": data["outputs"]["data_dir"], "output_dir": _out(run, "distill")}
    if cache:
        config["teacher_cache"] = cache["outputs"]["teacher_cache"]
    return _spec(run, "distill", config, data_hash=data["data_hash"],
                 lineage={"teacher_run_id": teacher.get("mlflow_run_id", "")})


def teacher_cache_spec(run: dict[str, Any], data: dict[str, Any], teacher: dict[str, Any]
                       ) -> dict[str, Any]:
    """The teacher's top-k logits job (tasks.distill_cache), on the distill stage's backend, from
    the same DistillConfig the student's job will get."""
    spec = distill_spec(run, data, teacher)
    spec["config"]["teacher_cache"] = _out(run, "teacher_cache")
    return {**spec, "stage": "distill_cache", "entrypoint": ENTRYPOINTS["distill_cache"]}


def evaluate_spec(run: dict[str, Any], data: dict[str, Any], pretrained: dict[str, Any],
                  teacher: dict[str, Any], student: dict[str, Any]) -> dict[str, Any]:
    return evaluate_models_spec(run, data, {"pretrained": pretrained, "teacher": teacher,
                                            "student": student})


def evaluate_models_spec(run: dict[str, Any], data: dict[str, Any],
                         models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Evaluate the named stage results; the run's `champion` (pinned by version in start_run)
    joins them when there was one, so the gate compares challengers with it on the same data.
    Every try of the task builds the same spec, whatever happened to the alias since."""
    refs = {name: r["outputs"]["model_dir"] for name, r in models.items()}
    runs = {name: r.get("mlflow_run_id", "") for name, r in models.items()}
    if promotion.CHAMPION not in refs:
        # A run dict from before pinning (a run started by an older deployment) reads it now.
        champion = run["champion"] if "champion" in run else promotion.current_champion(run["model_name"])
        if champion:
            refs[promotion.CHAMPION], runs[promotion.CHAMPION] = champion["uri"], champion["run_id"]
    config = {**run["config"]["evaluate"], "models": refs,
              "data_dir": data["outputs"]["data_dir"], "output_dir": _out(run, "evaluate")}
    lineage = {f"{name}_run_id": run_id or "" for name, run_id in runs.items()}
    return _spec(run, "evaluate", config, data_hash=data["data_hash"], lineage=lineage)


# -- the gate (plugins/llmops/promotion.py) -------------------------------------------------

gate_decisions = promotion.gate_decisions
LifecycleGateError = promotion.LifecycleGateError


def promote(run: dict[str, Any], evaluation: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """The gate on teacher and student (and against the current champion, when the evaluation
    scored one): the preferred passing model is registered with its lineage and becomes
    `champion`; otherwise the preferred one is kept as `challenger` with the reasons."""
    return promotion.promote(run, evaluation, data, candidates=("teacher", "student"))
