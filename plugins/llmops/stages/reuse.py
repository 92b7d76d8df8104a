"""Start a lifecycle run from another run's outputs: the Params `from_run` (an earlier DAG run id,
or its MLflow parent run id) and `start_at` (the first stage that runs: sweep, pretrain,
finetune, distill or evaluate).

The stages before `start_at` take the earlier run's outputs instead of running: `start_run`
checks, before any job, that the earlier run exists, that each of those stages finished there
and left its step record (llmops.infra.step_cache, an artifact of the stage's MLflow child run),
that its outputs are all still there with the hashes the record gives and agree with their
manifests, and that this run's config of those stages is the earlier one's (a knob that would
change a stage taken from it is refused, naming the Param). Their tasks then hand on the
earlier results without submitting anything (the JobOperator, like a step-cache hit: child runs
tagged `cached_from`, `reuse` = from_run); the sweep's trials are skipped and `pick_best` hands
on the earlier run's best config. The parent run is tagged `from_run`, `from_parent_run_id` and
`start_at`, and every lineage tag downstream (base_run_id, teacher_run_id, sweep_best_run_id,
data_hash) names the earlier run's MLflow runs, which computed those outputs.

With `fork_step` (and start_at pretrain) the pretraining is a fork of the earlier run's at that
step: of a pretraining that finished (its step record), or of one paused on request, which is
how a pause is resumed. A paused job leaves no step record (it did not succeed) but a pause
record (`pause_record`, an artifact of its MLflow child run): the config it ran with, its
checkpoints directory, the step it paused at and the manifest hash of every step it kept. The
step forked from must be kept, its checkpoint must agree with its manifest, and for a paused run
the manifest must be the one recorded at the pause.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any

from llmops.core import provenance
from llmops.core.run import Run
from llmops.infra import step_cache, tracking
from llmops.policy.params import KNOBS
from llmops.stages.run_summary import find_parent as by_dag_run
from tasks.configs import flatten

log = logging.getLogger(__name__)

ORDER = ("data_prep", "sweep", "pretrain", "finetune", "distill", "evaluate")
START_AT = ORDER[1:]
# The lifecycle config's section each stage is built from.
SECTION = {"data_prep": "data", "sweep": "sweep", "pretrain": "pretrain", "finetune": "finetune",
           "distill": "distill"}
RUN_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,249}$")  # DAG run ids, MLflow run ids
RUN_CONF_ARTIFACT = "run_conf.json"   # the DAG run's conf as triggered (what a replay reuses)
PAUSE_ARTIFACT = "pause_record.json"  # a paused pretraining's record, on its MLflow child run
PAUSED_TAG = "paused_at_step"         # on a paused job's child run and on its DAG run's parent run
RESUME_TAG = "resume"                 # on the parent run: the resume Params, as JSON
RESUME_KEYS = ("from_run", "start_at", "fork_step")
STEP_DIR = re.compile(r"step_(\d{6,})")   # a checkpoint's directory (tasks/train/checkpoint.py)


class FromRunError(ValueError):
    """`from_run` / `start_at` cannot be honoured; the message names the Param and the fix."""


def find_parent(ref: str, dag_id: str) -> Any:
    """The MLflow parent run of an earlier run of `dag_id`, by DAG run id or MLflow run id."""
    if not isinstance(ref, str) or not RUN_REF.match(ref):
        raise FromRunError(f"Param 'from_run': {ref!r} is neither a DAG run id (e.g. "
                           "manual__2026-01-01T00:00:00+00:00) nor an MLflow run id.")
    client = tracking.client()
    parent = by_dag_run(client, dag_id, ref)
    if parent is None and re.fullmatch(r"[0-9a-f]{32}", ref):
        try:
            run = client.get_run(ref)
        except Exception:  # noqa: BLE001 - MLflow's RESOURCE_DOES_NOT_EXIST
            run = None
        if run is not None and run.data.tags.get("kind") == tracking.PARENT_KIND \
                and run.data.tags.get("dag_id") == dag_id:
            parent = run
    if parent is None:
        raise FromRunError(f"Param 'from_run': MLflow has no {dag_id} run {ref!r} (looked for a "
                           "DAG run id and an MLflow parent run id). Give the run id shown on the "
                           "DAG run's page, or its MLflow parent run's id. Nothing was started.")
    return parent


def _stage_runs(parent: Any, stage: str) -> list[Any]:
    """The earlier run's child runs of `stage`'s task, newest first."""
    return tracking.client().search_runs(
        [parent.info.experiment_id],
        f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' and tags.stage = '{stage}' and "
        f"tags.task_id = '{stage}'", order_by=["attributes.start_time DESC"], max_results=5)


def _paused(runs: list[Any]) -> Any | None:
    """The newest of `runs` that paused on request (ended KILLED, tagged paused_at_step)."""
    return next((r for r in runs if r.info.status == "KILLED" and PAUSED_TAG in r.data.tags), None)


def resume_params(run_id: str, step: int) -> dict[str, Any]:
    """The Params that resume DAG run `run_id`'s pretraining, paused at `step`."""
    return {"from_run": run_id, "start_at": "pretrain", "fork_step": int(step)}


def resume_conf(conf: dict[str, Any] | None, run_id: str, step: int) -> dict[str, Any]:
    """The conf that resumes a paused run: its own conf as triggered (nothing else changed), its
    from_run / start_at / fork_step replaced by the resume's."""
    return {**{k: v for k, v in (conf or {}).items() if k not in RESUME_KEYS},
            **resume_params(run_id, step)}


def _how_to_resume(parent: Any, paused: Any) -> str:
    run_id = parent.data.tags.get("run_id", "")
    step = paused.data.tags[PAUSED_TAG]
    conf = tracking.read_json_artifact(parent.info.run_id, RUN_CONF_ARTIFACT)
    resume = resume_conf(conf, run_id, int(step)) if step.isdigit() else None
    return (f"run {run_id}'s pretraining was paused at step {step} on request. To resume it, "
            f"trigger llm_lifecycle with from_run={run_id}, start_at=pretrain, fork_step={step} "
            "and nothing else changed" + (f" ({json.dumps(resume)})" if resume else "") +
            ": that run goes on from the paused step and runs the later stages")


def stage_record(parent: Any, stage: str) -> dict[str, Any]:
    """The step record of `stage` in the earlier run (the artifact of its finished child run)."""
    runs = _stage_runs(parent, stage)
    finished = [r for r in runs if r.info.status == "FINISHED"]
    record = tracking.read_json_artifact(finished[0].info.run_id, step_cache.RECORD_ARTIFACT) \
        if finished else None
    if not record:
        paused = _paused(runs) if not finished else None
        if paused is not None:   # starting later would throw the pause away: say how to resume
            raise FromRunError(f"Param 'from_run': {_how_to_resume(parent, paused)}. It has no "
                               f"finished {stage} stage, so start_at cannot take {stage} from it. "
                               "Nothing was started.")
        raise FromRunError(
            f"Param 'from_run': run {parent.data.tags.get('run_id')} has no finished {stage} "
            f"stage with a step record ({'it did not finish' if not finished else 'it ran before the step cache'}"
            f"), so start_at cannot take {stage} from it. Start at {stage} or earlier, or pick "
            "another run. Nothing was started.")
    return record


def pretraining_to_fork(parent: Any) -> dict[str, Any]:
    """The record a fork (fork_step) of the earlier run's pretraining starts from: its step
    record when it finished, else the pause record of one paused on request (a resume)."""
    runs = _stage_runs(parent, "pretrain")
    if any(r.info.status == "FINISHED" for r in runs):
        return stage_record(parent, "pretrain")
    paused = _paused(runs)
    run_id = parent.data.tags.get("run_id", "")
    if paused is None:
        raise FromRunError(
            f"Param 'fork_step': run {run_id}'s pretraining neither finished nor paused on request "
            f"({'it never ran' if not runs else 'it ' + runs[0].info.status.lower()}), so there is "
            "no kept checkpoint to fork. Pick a run whose pretraining finished or paused, or leave "
            "fork_step empty to pretrain from the start. Nothing was started.")
    record = tracking.read_json_artifact(paused.info.run_id, PAUSE_ARTIFACT)
    if not record:
        raise FromRunError(
            f"Param 'from_run': run {run_id}'s pretraining paused at step "
            f"{paused.data.tags[PAUSED_TAG]} but left no {PAUSE_ARTIFACT} on its MLflow run "
            f"{paused.info.run_id} (see its pretrain task's log), so what it kept cannot be "
            "checked. Clear that run's pretrain task to resume it in place. Nothing was started.")
    return record


def pause_record(result: dict[str, Any], *, identity: dict[str, Any], key: str,
                 where: dict[str, Any]) -> dict[str, Any]:
    """What a pretraining job that paused on request leaves for its resume (see the module
    doc), from its result (tasks/train/pretraining.py): `identity` is the step cache's identity
    of the job (its config), `where` its job_name, mlflow_run_id, dag_id, run_id, task_id. Only
    the manifests are hashed here: a checkpoint's manifest holds its files' sha256."""
    outputs = result.get("outputs") or {}
    checkpoints = outputs.get("checkpoints") or os.path.dirname(outputs.get("checkpoint") or "")
    steps = result.get("kept_steps") or []
    if not os.path.isdir(checkpoints):  # a remote job's disk: only its S3 mirror outlives the job
        checkpoints, steps = outputs.get("checkpoint_uri") or checkpoints, []
    kept = {}
    for step in steps:
        manifest = step_cache.listing(os.path.join(checkpoints, f"step_{int(step):06d}", "manifest.json"))
        if manifest is None:
            raise step_cache.StepCacheError(f"the kept checkpoint of step {step} under "
                                            f"{checkpoints} has no manifest.json")
        kept[str(step)] = manifest[""]
    return {"schema": step_cache.SCHEMA, "kind": "paused", "stage": "pretrain", "key": key,
            "identity": identity, "result": result, "checkpoints": checkpoints,
            "paused_at_step": result["paused_at_step"], "max_steps": result.get("max_steps"),
            "kept": kept, "recorded_at": time.time(), **where}


def check(params: dict[str, Any], config: dict[str, Any], dag_id: str) -> dict[str, Any] | None:
    """None without `from_run`; else what the run takes from the earlier one, checked (see the
    module doc): {run_id, parent_run_id, start_at, stages: {stage: record summary},
    sweep_best}. Raises FromRunError naming the Param and the fix."""
    ref, start_at = params.get("from_run"), params.get("start_at")
    if params.get("fork_step") is not None and not (ref and start_at == "pretrain"):
        raise FromRunError("Param 'fork_step' forks from_run's pretraining at that step: set "
                           "from_run and start_at = pretrain with it, or leave it empty. Nothing "
                           "was started.")
    if not ref and not start_at:
        return None
    if not ref or not start_at:
        raise FromRunError("Params 'from_run' and 'start_at' go together: from_run names the run "
                           "whose outputs the stages before start_at take. Set both, or neither.")
    if start_at not in START_AT:
        raise FromRunError(f"Param 'start_at': {start_at!r} is not one of {', '.join(START_AT)}.")
    parent = find_parent(ref, dag_id)
    earlier_run_id = parent.data.tags.get("run_id", "")
    taken = ORDER[:ORDER.index(start_at)]
    earlier = (tracking.read_json_artifact(parent.info.run_id, "lifecycle_config.json") or {})
    _same_config(config, earlier, taken, earlier_run_id, start_at,
                 tracking.read_json_artifact(parent.info.run_id, RUN_CONF_ARTIFACT))
    stages: dict[str, Any] = {}
    for stage in taken:
        if stage == "sweep":
            continue
        record = stage_record(parent, stage)
        problem = step_cache.verify(record)
        if problem:
            raise FromRunError(f"Param 'from_run': the {stage} outputs of run {earlier_run_id} "
                               f"cannot be used: {problem}. Start at {stage} (it runs again), or "
                               "pick another run. Nothing was started.")
        stages[stage] = step_cache.summary(record)
    best = None
    if "sweep" in taken:
        best = tracking.read_json_artifact(parent.info.run_id, "sweep/best_config.json")
        if not best:
            raise FromRunError(f"Param 'from_run': run {earlier_run_id} has no sweep outcome "
                               "(sweep/best_config.json), so start_at cannot take the sweep from "
                               "it. Start at sweep, or pick another run. Nothing was started.")
    log.info("from_run %s (MLflow %s): %s taken from it, checked; the run starts at %s",
             earlier_run_id, parent.info.run_id, ", ".join(taken), start_at)
    fork = None if params.get("fork_step") is None else \
        _fork_point(pretraining_to_fork(parent), int(params["fork_step"]), earlier_run_id)
    return {"run_id": earlier_run_id, "parent_run_id": parent.info.run_id, "start_at": start_at,
            "stages": stages, "sweep_best": best, "fork": fork}


def _fork_point(record: dict[str, Any], step: int, earlier_run_id: str) -> dict[str, Any]:
    """Where a fork of the earlier run's pretraining starts (tasks/train/fork.py): its
    checkpoints directory, the step (one it kept, its checkpoint agreeing with its manifest and,
    for a paused run, with the manifest recorded at the pause), that checkpoint's manifest hash
    (the step cache's input), its MLflow run and the config its job ran with."""
    paused = record.get("kind") == "paused"
    final = ((record.get("result") or {}).get("outputs") or {}).get("checkpoint") or ""
    root = record.get("checkpoints") or os.path.dirname(final)
    what = f"run {earlier_run_id}'s {'paused ' if paused else ''}pretraining"
    if not root or "://" in root:
        raise FromRunError(f"Param 'fork_step': {what} keeps its checkpoints at "
                           f"{root or 'no recorded place'}, not on a disk this worker reads (a "
                           "fork from S3-only checkpoints is not supported yet). Nothing was started.")
    if not os.path.isdir(root):
        raise FromRunError(f"Param 'fork_step': {what} cannot be {'resumed' if paused else 'forked'}: "
                           f"its checkpoints directory {root} is gone. Nothing was started.")
    kept = sorted(int(m.group(1)) for m in map(STEP_DIR.fullmatch, os.listdir(root)) if m)
    if step not in kept:
        raise FromRunError(f"Param 'fork_step': step {step} is not a kept checkpoint of "
                           f"{what}; it keeps steps {', '.join(map(str, kept)) or 'none'}. Fork at "
                           "one of them. Nothing was started.")
    checkpoint = os.path.join(root, f"step_{step:06d}")
    files = step_cache.listing(checkpoint) or {}
    manifest = files.get("manifest.json")
    recorded = (record.get("kept") or {}).get(str(step)) if paused else None
    problem = ("it has no manifest.json (never committed)" if manifest is None else
               "its manifest changed since the pause" if recorded and manifest != recorded else
               step_cache.manifest_problem(files, lambda rel: step_cache.read_json(
                   os.path.join(checkpoint, rel))))
    if problem:
        raise FromRunError(f"Param 'fork_step': the checkpoint of step {step} of {what} "
                           f"({checkpoint}) cannot be used: {problem}. Fork at another kept step. "
                           "Nothing was started.")
    return {"checkpoints": root, "step": step, "hash": manifest,
            "parent_run_id": record.get("mlflow_run_id", ""),
            "config": (record.get("identity") or {}).get("config") or {}}


def _same_config(config: dict[str, Any], earlier: dict[str, Any], taken: tuple[str, ...],
                 earlier_run_id: str, start_at: str, earlier_conf: dict | None) -> None:
    """Refuse a run whose config of a stage it takes differs from the earlier run's: the knob
    would be silently ignored."""
    changed = []
    for stage in taken:
        section = SECTION[stage]
        now = flatten(config.get(section) or {}, f"{section}.")
        was = flatten(earlier.get(section) or {}, f"{section}.")
        changed += [changed_setting(path, was.get(path), now.get(path))
                    for path in sorted(set(now) | set(was)) if now.get(path) != was.get(path)]
    if changed:
        hint = f" Its conf was {earlier_conf}." if earlier_conf is not None else ""
        raise FromRunError(
            f"start_at={start_at} takes {', '.join(taken)} from run {earlier_run_id}, but this run's "
            f"config of them differs: {'; '.join(changed[:6])}{' ...' if len(changed) > 6 else ''}. "
            f"Trigger with the same recipe and knobs for those stages, or start earlier.{hint} "
            "Nothing was started.")


def changed_setting(path: str, was: Any, now: Any) -> str:
    """'pretrain.max_steps (Param 'pretrain_steps', 20 there, 30 here)': a lifecycle config
    path that differs from the earlier run's, with the Param that sets it, if one does."""
    knob = next((name for name, p in KNOBS.items() if p == path), None)
    return f"{path} ({f'Param {knob!r}, ' if knob else ''}{was!r} there, {now!r} here)"


def tag_parent(parent_run_id: str, earlier: dict[str, Any] | None, conf: dict[str, Any] | None) -> None:
    """On the new run's parent: the conf as triggered (for replays), the code version, and where
    it started from."""
    c = tracking.client()
    tracking.log_json(parent_run_id, conf or {}, RUN_CONF_ARTIFACT)
    c.set_tag(parent_run_id, "code_version", provenance.code_version())
    if earlier:
        fork = {"fork_step": earlier["fork"]["step"]} if earlier.get("fork") else {}
        for key, value in {"from_run": earlier["run_id"], "from_parent_run_id": earlier["parent_run_id"],
                           "start_at": earlier["start_at"], **fork}.items():
            c.set_tag(parent_run_id, key, value)


def taken(run: Run | dict[str, Any], stage: str) -> bool:
    """Does this run take `stage` from an earlier run (the sweep: its trials are skipped)?"""
    earlier = Run.of(run).from_run or {}
    return bool(earlier) and stage in ORDER[:ORDER.index(earlier["start_at"])]
