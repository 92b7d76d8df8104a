"""The lifecycle DAG's sweep, on the Airflow side: plan the slots of the run's study, pick the best
trial once every slot is done (whatever happened to the others), hand its config to pretraining.

    plan_trials ─► sweep_trial ×slots (TrialOperator, pool llmops_sweep) ─► pick_best ─► pretrain

MLflow: every trial is a child run of the DAG run's parent run (params, loss and val_loss curves,
tag `trial_state` = complete / pruned / failed); the parent gets the study's outcome: the best
config (`sweep/best_config.json`), every trial (`sweep/trials.json`), counts and the steps pruning
saved. The best config also goes downstream as XCom and as an event of the Asset
`llmops://sweeps/<dag_id>/best`, so later runs and other DAGs can reuse it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from llmops.core.run import Run
from llmops.infra import tracking
from llmops.policy import sweep_study as studies
from llmops.stages import reuse
from tasks import configs
from tasks.scaling.rungs import recommend

# The Asset of a DAG's sweep: its event's `extra` holds the best trial's config.
SWEEP_BEST_URI = "llmops://sweeps/{dag_id}/best"

log = logging.getLogger(__name__)


def study_for(run: Run | dict[str, Any]) -> dict[str, Any]:
    """The run's study reference: the same on every retry and rerun of the DAG run."""
    run = Run.of(run)
    return studies.study_ref(dag_id=run.dag_id, run_id=run.run_id, sweep=run.config["sweep"])


def plan_trials(run: Run | dict[str, Any], data: dict[str, Any]) -> list[dict[str, Any]]:
    """Create (or reopen) the study; one op_kwargs per slot for the mapped TrialOperator. None
    when the run takes the sweep from an earlier run (from_run): the trial task is skipped."""
    run = Run.of(run)
    if reuse.taken(run, "sweep"):
        log.info("from_run: the sweep is run %s's (its best trial goes to pretraining); no trial "
                 "runs here.", run.from_run["run_id"])
        return []
    ref = study_for(run)
    study = studies.open_study(ref, create=True)
    kept = [t for t in studies.summary(study) if t["state"] in ("complete", "pruned")]
    log.info("Study %s in %s: %d slots, sampler %s, pruner %s; %d trials already finished%s",
             ref["name"], studies.redact(ref["storage"]), ref["slots"], ref["sampler"], ref["pruner"],
             len(kept), " (kept: this is a rerun)" if kept else "")
    client = tracking.client()
    for key, value in {"sweep.study": ref["name"], "sweep.storage": studies.redact(ref["storage"]),
                       "sweep.sampler": ref["sampler"], "sweep.pruner": ref["pruner"]}.items():
        client.set_tag(run.parent_run_id, key, value)
    # op_kwargs are XCom: the run goes on as its dict
    return [{"run": run.to_dict(), "data": data, "study": ref, "slot": slot}
            for slot in range(ref["slots"])]


def pick_best(run: Run | dict[str, Any], recommendation: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """The best complete trial of the run's study, after every slot's task is done (failed and
    pruned trials are reported, never chosen). With `size_from_ladder`, also the pretraining size
    from the scaling ladder's `recommendation`."""
    run = Run.of(run)
    if reuse.taken(run, "sweep"):
        best = run.from_run["sweep_best"]
        log.info("from_run: the best trial of run %s: trial %s, val_loss %.4f, %s", run.from_run["run_id"],
                 best.get("trial"), best.get("val_loss", float("nan")), best.get("params"))
        tracking.client().set_tag(run.parent_run_id, "sweep.best_run_id", best.get("mlflow_run_id", ""))
        return best
    sweep = configs.from_dict(configs.SweepConfig, run.config["sweep"])
    size = _size_from(recommendation, run.config) if sweep.size_from_ladder else None
    ref = study_for(run)
    study = studies.open_study(ref)
    orphans = studies.fail_orphans(study)
    if orphans:
        log.warning("Trials %s lost their task without an outcome: marked failed.", orphans)
    trials = studies.summary(study)
    counts = {state: sum(t["state"] == state for t in trials) for state in ("complete", "pruned", "fail")}
    complete = [t for t in trials if t["state"] == "complete"]
    if not complete:
        raise ValueError(f"No trial of study {ref['name']} completed ({counts['pruned']} pruned, "
                         f"{counts['fail']} failed): see the sweep_trial logs. Clear the failed "
                         "sweep_trial tasks to run them again; finished trials are kept.")
    best = min(complete, key=lambda t: t["value"])
    max_steps = ref["steps"]
    saved = sum(max_steps - (t["steps_run"] or t["last_step"] or max_steps)
                for t in trials if t["state"] == "pruned")
    out = {"lr": best["params"]["optim.lr"], "val_loss": best["value"], "params": best["params"],
           "trial": best["number"], "mlflow_run_id": best["mlflow_run_id"], "study": ref["name"],
           "counts": counts, "steps_saved_by_pruning": saved,
           "trials": [{k: t[k] for k in ("number", "state", "params", "value", "steps_run")}
                      for t in trials]}
    if size:
        out["size"] = size
    _log_outcome(run, ref, out, trials, saved, len(trials) * max_steps)
    log.info("Best of %d trials: trial %d, val_loss %.4f, %s; %d pruned (%d steps saved), %d failed",
             len(trials), best["number"], best["value"], best["params"], counts["pruned"], saved,
             counts["fail"])
    return out


def apply_best(config: dict[str, Any], best: dict[str, Any]) -> None:
    """Pretraining's config (a TrainConfig dict) with the best trial's hyperparameters and, when
    chosen, the ladder's size."""
    for path, value in (best.get("params") or {"optim.lr": best["lr"]}).items():
        *parents, leaf = path.split(".")
        node = config
        for name in parents:
            node = node[name]
        node[leaf] = value
    size = best.get("size")
    if size:
        config["model"]["n_embd"] = size["n_embd"]
        config["max_steps"] = size["max_steps"]


def _size_from(recommendation: dict[str, Any] | None, config: dict[str, Any]) -> dict[str, Any]:
    """The pretraining size the ladder recommends for the run's `config` (its pretraining's
    model and tokens per step)."""
    if not recommendation or "compute_optimal" not in recommendation:
        raise ValueError("Param 'pretrain_size_from_ladder' is set but no scaling_ladder run has "
                         "published a recommendation yet: run the scaling_ladder DAG first, or "
                         "leave the Param off.")
    pretrain = configs.from_dict(configs.TrainConfig, config["pretrain"])
    per_step = pretrain.batch_size * config["data"]["seq_len"]
    best = recommendation["compute_optimal"]
    size = recommend(best["n_params"], best["tokens"], pretrain.model, per_step)
    return {**size, "from_ladder_run": recommendation.get("mlflow_run_id", ""),
            "target_flops": recommendation.get("target_flops")}


def _log_outcome(run: Run, ref: dict[str, Any], best: dict[str, Any],
                 trials: list[dict[str, Any]], saved: int, total_steps: int) -> None:
    client = tracking.client()
    parent = run.parent_run_id
    metrics = {"sweep.best_val_loss": best["val_loss"],
               "sweep.trials_complete": best["counts"]["complete"],
               "sweep.trials_pruned": best["counts"]["pruned"],
               "sweep.trials_failed": best["counts"]["fail"],
               "sweep.steps_saved_by_pruning": saved,
               "sweep.share_of_steps_saved": saved / total_steps if total_steps else 0.0}
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and math.isfinite(value):
            client.log_metric(parent, key, value)
    client.set_tag(parent, "sweep.best_trial", str(best["trial"]))
    client.set_tag(parent, "sweep.best_run_id", best["mlflow_run_id"])
    tracking.log_json(parent, {k: v for k, v in best.items() if k != "trials"}, "sweep/best_config.json")
    tracking.log_json(parent, trials, "sweep/trials.json")


def latest_extra(events: Any) -> dict[str, Any] | None:
    """The `extra` of an asset's newest event (from a task's inlet_events), or None."""
    newest = events.ascending(False).limit(1)
    return dict(newest[0].extra or {}) if len(newest) else None
