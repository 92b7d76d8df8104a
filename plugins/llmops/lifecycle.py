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
from llmops import settings, tracking
from llmops.jobs.spec import JobSpec
from tasks import configs

ENTRYPOINTS = {
    "data_prep": "tasks.data.prep",
    "sweep": "tasks.sweep",
    "pretrain": "tasks.pretrain",
    "finetune": "tasks.finetune",
    "distill": "tasks.distill",
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
    """Validate the Params, fix this run's storage paths, and open the MLflow parent run."""
    cfg = resolve(params)
    backends = {stage: params.get(f"backend_{stage}") or "local" for stage in lifecycle_params.STAGES}
    root = os.path.join(params.get("storage_root") or settings.storage_root(), dag_id,
                        re.sub(r"[^A-Za-z0-9_.-]+", "_", run_id))
    config = configs.to_dict(cfg)
    parent = tracking.start_parent_run(experiment=dag_id, dag_id=dag_id, run_id=run_id,
                                       config={**config, "backends": backends, "root": root})
    return {"dag_id": dag_id, "run_id": run_id, "root": root, "config": config,
            "backends": backends, "experiment": dag_id, "parent_run_id": parent,
            "model_name": params.get("registered_model_name") or "llm-lifecycle"}


def _spec(run: dict[str, Any], stage: str, config: dict[str, Any], *,
          data_hash: str = "", lineage: dict[str, str] | None = None) -> dict[str, Any]:
    return JobSpec(
        stage=stage, entrypoint=ENTRYPOINTS[stage], config=config, backend=run["backends"][stage],
        output_uri=config.get("output_dir", ""), mlflow_experiment=run["experiment"],
        mlflow_parent_run_id=run["parent_run_id"],
        tags={"data_hash": data_hash, **(lineage or {})},
    ).to_dict()


def _out(run: dict[str, Any], *parts: str) -> str:
    return os.path.join(run["root"], *parts)


def data_prep_spec(run: dict[str, Any]) -> dict[str, Any]:
    config = {**run["config"]["data"], "output_dir": _out(run, "data_prep")}
    return _spec(run, "data_prep", config)


def sweep_trials(run: dict[str, Any], data: dict[str, Any]) -> list[dict[str, Any]]:
    """One op_kwargs dict per trial, for `JobOperator.partial(...).expand(op_kwargs=...)`."""
    sweep = configs.from_dict(configs.SweepConfig, run["config"]["sweep"])
    return [{"run": run, "data": data, "trial": i, "lr": lr}
            for i, lr in enumerate(sweep.learning_rates())]


def trial_spec(run: dict[str, Any], data: dict[str, Any], trial: int, lr: float) -> dict[str, Any]:
    steps = run["config"]["sweep"]["steps"]
    config = copy.deepcopy(run["config"]["pretrain"])
    config.update(data_dir=data["outputs"]["data_dir"], output_dir=_out(run, "sweep", f"trial-{trial}"),
                  max_steps=steps, checkpoint_interval=steps,
                  eval_interval=min(config["eval_interval"], steps))
    config["optim"]["lr"] = lr
    config["optim"]["warmup_steps"] = min(config["optim"]["warmup_steps"], steps // 5)
    return _spec(run, "sweep", config, data_hash=data["data_hash"], lineage={"trial": str(trial)})


def best_trial(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The trial with the lowest validation loss; its config seeds pretraining."""
    finished = [r for r in results if r and "val_loss" in r.get("metrics", {})]
    if not finished:
        raise ValueError("No sweep trial reported a validation loss; see the trials' logs.")
    best = min(finished, key=lambda r: r["metrics"]["val_loss"])
    return {"lr": best["metrics"]["lr"], "val_loss": best["metrics"]["val_loss"],
            "mlflow_run_id": best.get("mlflow_run_id", ""),
            "trials": [{"lr": r["metrics"].get("lr"), "val_loss": r["metrics"]["val_loss"]}
                       for r in finished]}


def pretrain_spec(run: dict[str, Any], data: dict[str, Any], best: dict[str, Any]) -> dict[str, Any]:
    config = copy.deepcopy(run["config"]["pretrain"])
    config.update(data_dir=data["outputs"]["data_dir"], output_dir=_out(run, "pretrain"))
    config["optim"]["lr"] = best["lr"]
    return _spec(run, "pretrain", config, data_hash=data["data_hash"],
                 lineage={"sweep_best_run_id": best.get("mlflow_run_id", "")})


def finetune_spec(run: dict[str, Any], data: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    config = {**run["config"]["finetune"], "base_model": base["outputs"]["model_dir"],
              "data_dir": data["outputs"]["data_dir"], "output_dir": _out(run, "finetune")}
    return _spec(run, "finetune", config, data_hash=data["data_hash"],
                 lineage={"base_run_id": base.get("mlflow_run_id", "")})


def distill_spec(run: dict[str, Any], data: dict[str, Any], teacher: dict[str, Any]) -> dict[str, Any]:
    config = {**run["config"]["distill"], "teacher_model": teacher["outputs"]["model_dir"],
              "data_dir": data["outputs"]["data_dir"], "output_dir": _out(run, "distill")}
    return _spec(run, "distill", config, data_hash=data["data_hash"],
                 lineage={"teacher_run_id": teacher.get("mlflow_run_id", "")})


def evaluate_spec(run: dict[str, Any], data: dict[str, Any], pretrained: dict[str, Any],
                  teacher: dict[str, Any], student: dict[str, Any]) -> dict[str, Any]:
    models = {"pretrained": pretrained["outputs"]["model_dir"],
              "teacher": teacher["outputs"]["model_dir"],
              "student": student["outputs"]["model_dir"]}
    config = {**run["config"]["evaluate"], "models": models,
              "data_dir": data["outputs"]["data_dir"], "output_dir": _out(run, "evaluate")}
    lineage = {f"{name}_run_id": r.get("mlflow_run_id", "")
               for name, r in (("pretrained", pretrained), ("teacher", teacher), ("student", student))}
    return _spec(run, "evaluate", config, data_hash=data["data_hash"], lineage=lineage)


# -- the gate -------------------------------------------------------------------------------

def gate_decisions(gate: configs.GateConfig, evaluation: dict[str, Any],
                   candidates: tuple[str, ...] = ("teacher", "student")) -> dict[str, list[str]]:
    """For each candidate, the reasons it may not ship (an empty list means it passes)."""
    metrics = evaluation["metrics"]
    decisions = {}
    for name in candidates:
        reasons = []
        accuracy = metrics.get(f"{name}.task_accuracy")
        perplexity = metrics.get(f"{name}.perplexity")
        if accuracy is None or perplexity is None:
            reasons.append("not evaluated")
        else:
            if accuracy < gate.min_task_accuracy:
                reasons.append(f"task accuracy {accuracy:.3f} < {gate.min_task_accuracy}")
            if perplexity > gate.max_perplexity:
                reasons.append(f"perplexity {perplexity:.2f} > {gate.max_perplexity}")
        decisions[name] = reasons
    return decisions


def promote(run: dict[str, Any], evaluation: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """Register the preferred passing model and point the alias `champion` at it."""
    gate = configs.from_dict(configs.GateConfig, run["config"]["gate"])
    decisions = gate_decisions(gate, evaluation)
    order = [gate.prefer] + [n for n in decisions if n != gate.prefer]
    passing = [n for n in order if not decisions[n]]
    client = tracking.client()
    if not passing:
        tracking.end_run(run["parent_run_id"], "FAILED")
        why = "; ".join(f"{n}: {', '.join(r)}" for n, r in decisions.items())
        raise LifecycleGateError(f"No model passed the gate ({why}). Nothing was registered.")
    chosen = passing[0]
    model = evaluation["models"][chosen]
    name = run["model_name"]
    lineage = {"run_id": run["run_id"], "dag_id": run["dag_id"], "candidate": chosen,
               "data_hash": data["data_hash"], "model_dir": model["model_dir"],
               "training_run_id": model.get("mlflow_run_id", ""),
               "evaluation_run_id": evaluation.get("mlflow_run_id", ""),
               "lifecycle_run_id": run["parent_run_id"]}
    version = _register_once(client, name, model["model_uri"], lineage)
    client.set_registered_model_alias(name, "champion", version)
    metrics = {k: v for k, v in evaluation["metrics"].items() if k.startswith(f"{chosen}.")}
    for key, value in metrics.items():
        client.set_model_version_tag(name, version, key, str(value))
    client.set_tag(run["parent_run_id"], "champion", f"{name}/{version}")
    tracking.end_run(run["parent_run_id"], "FINISHED")
    return {"model_name": name, "version": version, "alias": "champion", "candidate": chosen,
            "metrics": metrics, "gate": decisions}


class LifecycleGateError(RuntimeError):
    """No candidate met the gate's thresholds."""


def _register_once(client: Any, name: str, model_uri: str, lineage: dict[str, str]) -> str:
    """Register `model_uri` as a new version, or return the version this DAG run registered."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description="Champion of the LLM lifecycle DAG.")
    except MlflowException:
        pass  # already exists
    for mv in client.search_model_versions(f"name = '{name}'"):
        if mv.tags.get("run_id") == lineage["run_id"] and mv.tags.get("dag_id") == lineage["dag_id"]:
            return mv.version
    import mlflow

    mlflow.set_tracking_uri(tracking.tracking_uri())
    mlflow.set_registry_uri(tracking.tracking_uri())
    mv = mlflow.register_model(model_uri, name, tags=lineage)
    return mv.version
