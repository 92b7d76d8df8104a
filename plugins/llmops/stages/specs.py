"""Each lifecycle stage's job spec, built from the run (llmops.core.run.Run, what start_run
resolved) and its upstream stages' results: the config the job gets, where it writes, its lineage
tags and the inputs the step cache keys on. A spec is complete when its builder returns; the
operator (llmops.airflow.operators.job_operator) adds only the job's identity and tracking.

Cheap work only (no torch): the heavy lifting happens in the jobs these specs describe.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

from llmops.core.run import Run
from llmops.infra import step_cache
from llmops.jobs.spec import JobSpec, NothingToRun
from llmops.policy import promotion, teams
from llmops.policy import sweep_study as studies
from llmops.stages import reuse
from llmops.stages import sweep_stage
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


def _spec(run: Run, stage: str, config: dict[str, Any], *,
          data_hash: str = "", lineage: dict[str, str] | None = None,
          inputs: dict[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    """The stage's JobSpec as a dict; `inputs` (name -> (path, content hash)) is what the step
    cache keys on besides the config (llmops.infra.step_cache)."""
    # Team and priority travel as tags: cost allocation everywhere, and the fair-share identifier
    # and scheduling priority where the backend schedules (Batch, HyperPod).
    scheduling = {"team": run.team or ""}
    if run.priority is not None:
        scheduling["priority"] = str(run.priority)
    backend = run.backends[stage]
    return JobSpec(
        stage=stage, entrypoint=ENTRYPOINTS[stage], config=config, backend=backend,
        output_uri=config.get("output_dir", ""), mlflow_experiment=run.experiment,
        mlflow_parent_run_id=run.parent_run_id,
        tags={"data_hash": data_hash, **(lineage or {}), **{k: v for k, v in scheduling.items() if v}},
        cache=step_cache.for_spec(run, stage, inputs),
        # the remote backends submit with the team's role, share, namespace and queue
        settings_overrides={} if backend == "local" else teams.settings_overrides(run.team or ""),
        **(run.resources or {}).get(stage, {}),
    ).to_dict()


def _data_input(data: dict[str, Any]) -> tuple[str, str]:
    """A data prep result as a step-cache input: its directory and its manifest's hash."""
    return data["outputs"]["data_dir"], data.get("data_hash", "")


def _model_input(result: dict[str, Any]) -> tuple[str, str]:
    """A training stage's result as a step-cache input: its model directory and content hash."""
    return result["outputs"]["model_dir"], (result.get("content_hashes") or {}).get("model_dir", "")


def _out(run: Run, *parts: str) -> str:
    return os.path.join(run.root, *parts)


def data_prep_spec(run: Run | dict[str, Any]) -> dict[str, Any]:
    run = Run.of(run)
    config = {**run.config["data"], "output_dir": _out(run, "data_prep")}
    raw = step_cache.raw_inputs_hash(config["inputs"] + config["sft_inputs"]) \
        if run.storage_root and not reuse.taken(run, "data_prep") else ""
    return _spec(run, "data_prep", config, inputs={"raw": ("", raw)})


def sweep_trials(run: Run | dict[str, Any], data: dict[str, Any]) -> list[dict[str, Any]]:
    """Open the run's Optuna study; one op_kwargs dict per slot, for
    `TrialOperator.partial(...).expand(op_kwargs=...)` (llmops.airflow.operators). None with a
    base_model: nothing is pretrained."""
    run = Run.of(run)
    if run.base_model:
        return []
    return sweep_stage.plan_trials(run, data)


# A trial keeps TrainConfig's default retention whatever the run's keep_checkpoints/keep_every.
TRIAL_RETENTION = {f.name: f.default for f in dataclasses.fields(configs.TrainConfig)
                   if f.name in ("keep_checkpoints", "keep_every")}


def trial_spec(run: Run | dict[str, Any], data: dict[str, Any], study: dict[str, Any], slot: int,
               trial: dict[str, Any]) -> dict[str, Any]:
    """One trial: a short pretraining run with the trial's hyperparameters, evaluated (and
    checkpointed, so a retry resumes) at every point where the study's pruner may stop it."""
    run = Run.of(run)
    steps, every = study["steps"], study["eval_interval"]
    config = copy.deepcopy(run.config["pretrain"])
    config.update(data_dir=data["outputs"]["data_dir"],
                  output_dir=_out(run, "sweep", f"trial-{trial['number']}"),
                  max_steps=steps, checkpoint_interval=every, eval_interval=every,
                  # pretraining's retention Params are pretraining's: a trial checkpoints only to
                  # resume, so its identity (and the step cache's reuse of it) ignores them
                  **TRIAL_RETENTION)
    config["optim"]["warmup_steps"] = min(config["optim"]["warmup_steps"], steps // 5)
    sweep_stage.apply_best(config, {"params": trial["params"]})
    spec = _spec(run, "sweep", config, data_hash=data["data_hash"],
                 lineage={"trial": str(trial["number"]), "slot": str(slot), "study": study["name"]},
                 inputs={"data": _data_input(data)})
    spec["env"] = {**spec["env"], **studies.job_env(study, trial["number"], spec["backend"])}
    return spec


def pretrain_config(config: dict[str, Any], best: dict[str, Any]) -> dict[str, Any]:
    """The lifecycle config's pretraining with the best trial's hyperparameters (and ladder size);
    a pretrain_lr the run sets wins over the sweep's."""
    pretrain = copy.deepcopy(config["pretrain"])
    sweep_stage.apply_best(pretrain, best)
    if config.get("pretrain_lr"):
        pretrain["optim"]["lr"] = config["pretrain_lr"]
    return pretrain


def pretrain_spec(run: Run | dict[str, Any], data: dict[str, Any], best: dict[str, Any]
                  ) -> dict[str, Any]:
    """Pretraining's job; with fork_step, a fork of from_run's pretraining at that step
    (tasks/train/fork.py), its checkpoint an input of the step cache."""
    run = Run.of(run)
    config = pretrain_config(run.config, best)
    config.update(data_dir=data["outputs"]["data_dir"], output_dir=_out(run, "pretrain"))
    inputs, lineage = {"data": _data_input(data)}, {"sweep_best_run_id": best.get("mlflow_run_id", "")}
    fork = (run.from_run or {}).get("fork")
    if fork:
        config.update(fork_from=fork["checkpoints"], fork_step=fork["step"],
                      fork_parent_run_id=fork["parent_run_id"])
        inputs["fork"] = (fork["checkpoints"], fork["hash"])
        lineage.update({"fork.parent_run_id": fork["parent_run_id"], "fork.step": str(fork["step"])})
    return _spec(run, "pretrain", config, data_hash=data["data_hash"], lineage=lineage,
                 inputs=inputs)


def finetune_spec(run: Run | dict[str, Any], data: dict[str, Any], base: dict[str, Any] | None
                  ) -> dict[str, Any]:
    """Fine-tune the pretrained model, or the run's base_model (pretraining skipped: base None)."""
    run = Run.of(run)
    base = base or given_base(run)
    config = {**run.config["finetune"], "base_model": base["outputs"]["model_dir"],
              "data_dir": data["outputs"]["data_dir"], "output_dir": _out(run, "finetune")}
    return _spec(run, "finetune", config, data_hash=data["data_hash"],
                 lineage={"base_run_id": base.get("mlflow_run_id", "")},
                 inputs={"data": _data_input(data), "base": _model_input(base)})


def distill_spec(run: Run | dict[str, Any], data: dict[str, Any], teacher: dict[str, Any],
                 cache: dict[str, Any] | None = None) -> dict[str, Any]:
    """The student's job; with `cache` (teacher_cache_spec's result) it reads the teacher's
    cached logits instead of running the teacher."""
    run = Run.of(run)
    config = {**run.config["distill"], "teacher_model": teacher["outputs"]["model_dir"],
              "data_dir": data["outputs"]["data_dir"], "output_dir": _out(run, "distill")}
    if cache:
        config["teacher_cache"] = cache["outputs"]["teacher_cache"]
    return _spec(run, "distill", config, data_hash=data["data_hash"],
                 lineage={"teacher_run_id": teacher.get("mlflow_run_id", "")},
                 inputs={"data": _data_input(data), "teacher": _model_input(teacher)})


def teacher_cache_spec(run: Run | dict[str, Any], data: dict[str, Any], teacher: dict[str, Any]
                       ) -> dict[str, Any]:
    """The teacher's top-k logits job (tasks.distill_cache), on the distill stage's backend, from
    the same DistillConfig the student's job will get."""
    run = Run.of(run)
    spec = distill_spec(run, data, teacher)
    spec["config"]["teacher_cache"] = _out(run, "teacher_cache")
    return {**spec, "stage": "distill_cache", "entrypoint": ENTRYPOINTS["distill_cache"]}


def given_base(run: Run | dict[str, Any]) -> dict[str, Any]:
    """The run's base_model Param, shaped like the pretraining stage's result."""
    run = Run.of(run)
    if not run.base_model:
        # pretraining was skipped or paused on request (its task's log says at which step)
        raise NothingToRun("pretraining produced no model (it was paused or skipped: see the "
                           "pretrain task's log) and the run names no base_model.")
    return {"outputs": {"model_dir": run.base_model}, "mlflow_run_id": "",
            "content_hashes": {"model_dir": run.base_model_hash}}


def evaluate_spec(run: Run | dict[str, Any], data: dict[str, Any], pretrained: dict[str, Any] | None,
                  teacher: dict[str, Any], student: dict[str, Any]) -> dict[str, Any]:
    """Score the pretrained model (or the run's base_model), the teacher and the student."""
    run = Run.of(run)
    return evaluate_models_spec(run, data, {"pretrained": pretrained or given_base(run),
                                            "teacher": teacher, "student": student})


def evaluate_models_spec(run: Run | dict[str, Any], data: dict[str, Any],
                         models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Evaluate the named stage results; the run's `champion` (pinned in start_run) joins them
    when there was one, so the gate compares challengers with it on the same data. Every try of
    the task builds the same spec, whatever happened to the alias since.

    The champion is an input keyed by its content hash (its version's `lineage.content_sha256`),
    not by its version: the same weights evaluated on the same data are the same job (the step
    cache reuses it). A model of this run holding exactly the champion's weights (an identical
    rerun's student, once crowned) is scored once; the gate reads the champion's scores from it
    (promotion.with_champion)."""
    run = Run.of(run)
    # A run from before pinning (started by an older deployment) reads the champion now.
    champion = run.champion if run.champion_pinned else promotion.current_champion(run.model_name)
    contents = {name: r.get("content_sha256", "") for name, r in models.items()}
    if champion and promotion.same_weights(champion, contents) is None:
        models = {**models, promotion.CHAMPION: _champion_result(champion)}
    refs = {name: r["outputs"]["model_dir"] for name, r in models.items()}
    config = {**run.config["evaluate"], "models": refs,
              "data_dir": data["outputs"]["data_dir"], "output_dir": _out(run, "evaluate")}
    lineage = {f"{name}_run_id": r.get("mlflow_run_id") or "" for name, r in models.items()}
    if champion:
        lineage[f"{promotion.CHAMPION}_run_id"] = champion["run_id"] or ""
    inputs = {"data": _data_input(data), **{n: _model_input(r) for n, r in models.items()}}
    return _spec(run, "evaluate", config, data_hash=data["data_hash"], lineage=lineage,
                 inputs=inputs)


def _champion_result(champion: dict[str, Any]) -> dict[str, Any]:
    """A registry version shaped like a stage result: its URI stands for its content in the
    step cache's identity (a version registered without a content hash: the URI itself)."""
    return {"outputs": {"model_dir": champion["uri"]}, "mlflow_run_id": champion["run_id"],
            "content_hashes": {"model_dir": champion.get("content_sha256") or champion["uri"]}}
