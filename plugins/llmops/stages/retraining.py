"""The scheduled retraining DAG's Airflow side (dags/retrain.py): find the new data and the
champion to start from, build the fine-tuning and evaluation specs from them, branch after the
gate, record how the run ended. The gate itself is plugins/llmops/policy/promotion.py; the specs are
the lifecycle's own (plugins/llmops/stages/specs.py)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from llmops.core.paths import run_root
from llmops.core.run import Run
from llmops.infra import tracking
from llmops.policy import promotion
from llmops.policy.params import RETRAIN_KNOBS, set_path
from llmops.stages import lifecycle, specs
from tasks import configs

log = logging.getLogger(__name__)


def curated_data(params: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where the new data is: the `data_dir` Param, else the newest curated-data asset event's
    extra ({"data_dir", "data_hash"}), else None. Events are given oldest first."""
    if params.get("data_dir"):
        return {"data_dir": params["data_dir"], "data_hash": params.get("data_hash") or ""}
    for extra in reversed(events):
        if extra and extra.get("data_dir"):
            return {"data_dir": extra["data_dir"], "data_hash": extra.get("data_hash") or ""}
    return None


def start_retrain(params: dict[str, Any], *, dag_id: str, run_id: str,
                  events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Resolve the retraining run: recipe settings, the champion to start from (pinned by
    version), the new data; open the MLflow parent run. None when there is nothing to do."""
    name = params.get("registered_model_name") or "llm-lifecycle"
    champion = promotion.current_champion(name)
    data = curated_data(params, events)
    if champion is None or data is None:
        log.info("nothing to retrain: %s", "no champion of %r yet (run llm_lifecycle first)" % name
                 if champion is None else "no curated data (no asset event, no data_dir Param)")
        return None
    manifest = os.path.join(data["data_dir"], "manifest.json")
    if "://" not in data["data_dir"] and not os.path.isfile(manifest):
        raise lifecycle.LifecycleParamError(f"curated data {data['data_dir']} has no manifest.json; "
                                            "point data_dir at a finished data prep output.")
    if not data["data_hash"] and os.path.isfile(manifest):
        with open(manifest) as fh:
            data["data_hash"] = json.load(fh)["content_hash"]
    lifecycle.check_suites(params.get("eval_suites"))
    cfg = lifecycle.resolve({"recipe": params.get("recipe") or "demo"})
    for knob, path in RETRAIN_KNOBS.items():
        if params.get(knob) is not None:
            set_path(cfg, path, params[knob])
    try:
        cfg = configs.from_dict(configs.LifecycleConfig, configs.to_dict(cfg))
    except configs.ConfigError as exc:
        raise lifecycle.LifecycleParamError(f"Invalid retraining parameters: {exc}") from None
    storage_root = lifecycle.check_storage_root(params.get("storage_root"))
    root = run_root(storage_root, dag_id, run_id)
    config = configs.to_dict(cfg)
    backend = params.get("backend") or "local"
    backends = {stage: backend for stage in ("finetune", "evaluate")}
    lifecycle.check_lane(params, cfg, backends, storage_root)  # the default team's lane and budget
    parent = tracking.start_parent_run(
        experiment=dag_id, dag_id=dag_id, run_id=run_id,
        config={**config, "champion": champion["uri"], "data": data, "root": root})
    return {"dag_id": dag_id, "run_id": run_id, "root": root, "config": config,
            "backends": backends, "experiment": dag_id, "parent_run_id": parent,
            "model_name": name, "champion": promotion.pin(champion),
            "data": {"outputs": {"data_dir": data["data_dir"]}, "data_hash": data["data_hash"]}}


def champion_as_base(run: Run | dict[str, Any]) -> dict[str, Any]:
    """The champion, shaped like a stage result, for finetune_spec (evaluate_models_spec adds
    the run's champion itself)."""
    champion = Run.of(run).champion
    return {"outputs": {"model_dir": champion["uri"]}, "mlflow_run_id": champion["run_id"]}


def next_step(run: Run | dict[str, Any], decision: dict[str, Any]) -> str | None:
    """Branch after the gate: 'approve' (a human decides), 'promote', or None (refused)."""
    if not decision.get("passed"):
        return None
    return "approve" if Run.of(run).config["gate"].get("require_approval") else "promote"


def finish(run: Run | dict[str, Any], decision: dict[str, Any] | None,
           approval: dict[str, Any] | None, promoted: dict[str, Any] | None) -> dict[str, Any]:
    """Record how the retraining run ended and close its MLflow parent run."""
    run = Run.of(run)
    client = tracking.client()
    rejected = bool(approval) and "Approve" not in (approval.get("chosen_options") or [])
    if promoted:
        outcome = "promoted"
    elif decision and not decision.get("passed"):
        outcome = "refused"
    else:
        outcome = "rejected" if rejected else "not promoted"
    if decision and decision.get("version") and approval and not promoted:
        client.set_model_version_tag(decision["model_name"], decision["version"], "approval",
                                     promotion.approval_text(approval))
    client.set_tag(run.parent_run_id, "outcome", outcome)
    tracking.end_run(run.parent_run_id, "FINISHED")
    return {"outcome": outcome, "version": (decision or {}).get("version")}


def retrain_finetune_spec(run: Run | dict[str, Any]) -> dict[str, Any]:
    """Fine-tune the pinned champion on the run's curated data (the lifecycle's finetune job)."""
    run = Run.of(run)
    return specs.finetune_spec(run, run.data, champion_as_base(run))


def retrain_evaluate_spec(run: Run | dict[str, Any], challenger: dict[str, Any]) -> dict[str, Any]:
    """Challenger and champion, scored by one evaluation job on the same data."""
    run = Run.of(run)
    return specs.evaluate_models_spec(run, run.data, {"challenger": challenger})
