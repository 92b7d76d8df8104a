"""The scaling_ladder DAG's steps on the Airflow side.

    start_ladder ─► data_prep ─► plan_rungs ─► ladder_rung ×rungs (pool llmops_sweep) ─► fit_law ─► publish

Each rung is a sweep trial without a study (`python -m tasks.sweep`): the recipe's pretraining model
at one width, trained on tokens_per_param x N tokens to the end of its schedule. `fit_law`
(`python -m tasks.ladder`) fits L(N, D) to the rungs that finished (trigger rule all_done: a failed
rung costs a point, not the ladder) and `publish` logs the law, its held-out error and the
compute-optimal N and D to the ladder's MLflow parent run and emits them as an event of the Asset
`llmops://scaling/recommendation`, which llm_lifecycle reads when `pretrain_size_from_ladder` is on.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from typing import Any

from llmops.core import paths
from llmops.core.run import Run
from llmops.infra import tracking
from llmops.jobs.spec import JobSpec
from llmops.policy import budget, teams
from llmops.policy import params as knobs
from llmops.stages import lifecycle
from tasks import configs
from tasks.scaling.rungs import rungs

# The Asset of the scaling ladder's latest recommendation: its event's `extra` holds the law and
# the compute-optimal N and D.
LADDER_RECOMMENDATION_URI = "llmops://scaling/recommendation"

log = logging.getLogger(__name__)

PARENT_KIND = "ladder"


def resolve(params: dict[str, Any]) -> configs.LifecycleConfig:
    """Recipe + the run's non-empty knobs -> a validated config; refuses what cannot work."""
    shared = {name: value for name, value in params.items()
              if name in knobs.KNOBS and knobs.KNOBS[name] == knobs.LADDER_KNOBS.get(name)}
    cfg = lifecycle.resolve({**shared, "recipe": params.get("recipe")})
    for name, path in knobs.LADDER_KNOBS.items():
        if params.get(name) is not None and name not in shared:
            knobs.set_path(cfg, path, params[name])
    try:
        cfg = configs.from_dict(configs.LifecycleConfig, configs.to_dict(cfg))
        rungs(cfg.ladder, cfg.pretrain.model, _tokens_per_step(cfg))
    except (configs.ConfigError, ValueError) as exc:
        raise lifecycle.LifecycleParamError(f"Invalid ladder parameters: {exc}") from None
    return cfg


def _tokens_per_step(cfg: configs.LifecycleConfig) -> int:
    return cfg.pretrain.batch_size * cfg.data.seq_len


def start_ladder(params: dict[str, Any], *, dag_id: str, run_id: str) -> dict[str, Any]:
    """Validate, check the budget (before any job starts), open the ladder's MLflow parent run."""
    cfg = resolve(params)
    backends = {stage: params.get(f"backend_{stage}") or "local" for stage in knobs.LADDER_STAGES}
    estimate = budget.check_ladder(cfg, backends["ladder"], params)
    log.info("Ladder estimate: %.3g accelerator-hours (%s), budget %s", estimate.hours,
             estimate.detail, cfg.ladder.budget_hours or "unlimited")
    storage_root = paths.check_storage_root(params.get("storage_root"))
    lifecycle.check_lane(params, cfg, backends, storage_root)  # the default team's lane and budget
    root = paths.run_root(storage_root, dag_id, run_id)
    config = configs.to_dict(cfg)
    parent = _parent_run(dag_id, run_id, {"data": config["data"], "ladder": config["ladder"],
                                          "pretrain": config["pretrain"], "backends": backends,
                                          "estimated_accelerator_hours": estimate.hours})
    return {"dag_id": dag_id, "run_id": run_id, "root": root, "config": config,
            "backends": backends, "experiment": dag_id, "parent_run_id": parent}


def _parent_run(dag_id: str, run_id: str, config: dict[str, Any]) -> str:
    """The ladder's parent run (the same one when the DAG run is cleared and runs again)."""
    client = tracking.client()
    exp_id = tracking.ensure_experiment(dag_id)
    key = {"kind": PARENT_KIND, "dag_id": dag_id, "run_id": run_id}
    query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in key.items())
    found = client.search_runs([exp_id], filter_string=query, max_results=1)
    if found:
        return found[0].info.run_id
    run = client.create_run(exp_id, run_name=f"{dag_id} {run_id}", tags=key)
    for name, value in sorted(configs.flatten(config).items()):
        client.log_param(run.info.run_id, name, str(value)[:6000])
    tracking.log_json(run.info.run_id, config, "ladder_config.json")
    client.set_tag(run.info.run_id, "mlflow.note.content",
                   f"Scaling ladder {run_id}: one child run per rung and one for the fit.")
    return run.info.run_id


def _spec(run: Run, entrypoint: str, config: dict[str, Any], *, stage: str,
          data_hash: str, tags: dict[str, str]) -> dict[str, Any]:
    return JobSpec(stage=stage, entrypoint=entrypoint, config=config,
                   backend=run.backends["ladder"], output_uri=config.get("output_dir", ""),
                   mlflow_experiment=run.experiment, mlflow_parent_run_id=run.parent_run_id,
                   tags={"data_hash": data_hash, **tags},
                   # the remote backends submit with the (default) team's role, share, namespace, queue
                   settings_overrides={} if run.backends["ladder"] == "local"
                   else teams.settings_overrides(run.team or "")).to_dict()


def plan_rungs(run: Run | dict[str, Any], data: dict[str, Any]) -> list[dict[str, Any]]:
    """One op_kwargs per rung, for `JobOperator.partial(...).expand(op_kwargs=...)`."""
    run = Run.of(run)
    cfg = configs.from_dict(configs.LifecycleConfig, run.config)
    plan = rungs(cfg.ladder, cfg.pretrain.model, _tokens_per_step(cfg))
    log.info("%d rungs: %s", len(plan), "; ".join(
        f"width {r.width} x {r.tokens_per_param:g} tok/param = {r.steps} steps" for r in plan))
    # op_kwargs are XCom: the run goes on as its dict
    return [{"run": run.to_dict(), "data": data,
             "rung": {"index": r.index, "width": r.width, "tokens_per_param": r.tokens_per_param,
                      "n_params": r.n_params, "steps": r.steps, "tokens": r.tokens}}
            for r in plan]


def rung_spec(run: Run | dict[str, Any], data: dict[str, Any], rung: dict[str, Any]) -> dict[str, Any]:
    """One rung: the pretraining model at the rung's width, trained `steps` steps to the end of
    its own schedule (approach 3 fits final losses), evaluated once at the end."""
    run = Run.of(run)
    steps = rung["steps"]
    config = copy.deepcopy(run.config["pretrain"])
    config["model"]["n_embd"] = rung["width"]
    config.update(data_dir=data["outputs"]["data_dir"], max_steps=steps, eval_interval=steps,
                  checkpoint_interval=max(1, steps // 4),  # a retried rung resumes
                  log_interval=max(1, min(config["log_interval"], steps // 10 or 1)),
                  output_dir=os.path.join(run.root, "ladder",
                                          f"rung-{rung['index']}-w{rung['width']}-"
                                          f"t{rung['tokens_per_param']:g}"))
    config["optim"]["warmup_steps"] = min(config["optim"]["warmup_steps"], steps // 5)
    return _spec(run, "tasks.sweep", config, stage="ladder", data_hash=data["data_hash"],
                 tags={"rung": str(rung["index"]), "width": str(rung["width"]),
                       "tokens_per_param": f"{rung['tokens_per_param']:g}"})


def fit_spec(run: Run | dict[str, Any], data: dict[str, Any], results: Any) -> dict[str, Any]:
    """The fit job over every rung that finished (a failed rung has no result)."""
    run = Run.of(run)
    cfg = configs.from_dict(configs.LifecycleConfig, run.config)
    points = [{"n_params": r["metrics"]["non_embedding_params"], "tokens": r["metrics"]["tokens"],
               "loss": r["metrics"]["val_loss"], "mlflow_run_id": r.get("mlflow_run_id", ""),
               "job_name": r.get("job_name", "")}
              for r in list(results or []) if r and r.get("state", "complete") == "complete"]
    config = {"points": points, "ladder": run.config["ladder"],
              "model": run.config["pretrain"]["model"],
              "tokens_per_step": _tokens_per_step(cfg),
              "output_dir": os.path.join(run.root, "ladder", "fit")}
    return _spec(run, "tasks.ladder", config, stage="ladder_fit", data_hash=data["data_hash"],
                 tags={"rungs": str(len(points))})


def publish(run: Run | dict[str, Any], fit: dict[str, Any]) -> dict[str, Any]:
    """Put the fit on the ladder's parent run and return the recommendation (the Asset event)."""
    run = Run.of(run)
    report = fit["fit"]
    client = tracking.client()
    parent = run.parent_run_id
    for key, value in fit["metrics"].items():
        client.log_metric(parent, key, float(value))
    client.set_tag(parent, "fit_run_id", fit.get("mlflow_run_id", ""))
    tracking.log_json(parent, report, "fit.json")
    recommendation = {
        "law": report["law"], "compute_optimal": report["compute_optimal"],
        "target_flops": report["target_flops"], "recommendation": report["recommendation"],
        "held_out_relative_error": report["held_out_relative_error"],
        "warnings": report.get("warnings", []), "rungs_fitted": len(report["train_points"]),
        "mlflow_run_id": fit.get("mlflow_run_id", ""),
        "parent_run_id": parent, "dag_id": run.dag_id, "run_id": run.run_id}
    tracking.log_json(parent, recommendation, "recommendation.json")
    if fit.get("mlflow_run_id"):
        with tempfile.TemporaryDirectory() as tmp:  # the plot on the parent too: one place to look
            try:
                path = client.download_artifacts(fit["mlflow_run_id"], "scaling_law.png", tmp)
                client.log_artifact(parent, path)
            except Exception as exc:  # the numbers matter more than the picture
                log.warning("could not copy the plot to the parent run: %s", exc)
    tracking.end_run(parent, "FINISHED")
    log.info("Law %s; held-out relative error %s; compute-optimal at C=%.3g: N=%.4g, D=%.4g",
             report["law"], report["held_out_relative_error"], report["target_flops"],
             report["compute_optimal"]["n_params"], report["compute_optimal"]["tokens"])
    return recommendation
