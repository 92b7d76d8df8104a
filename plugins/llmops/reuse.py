"""Start a lifecycle run from another run's outputs: the Params `from_run` (an earlier DAG run id,
or its MLflow parent run id) and `start_at` (the first stage that runs: sweep, pretrain,
finetune, distill or evaluate).

The stages before `start_at` take the earlier run's outputs instead of running: `start_run`
checks, before any job, that the earlier run exists, that each of those stages finished there
and left its step record (llmops.step_cache, an artifact of the stage's MLflow child run), that
its outputs are all still there with the hashes the record gives and agree with their
manifests, and that this run's config of those stages is the earlier one's (a knob that would
change a stage taken from it is refused, naming the Param). Their tasks then hand on the
earlier results without submitting anything (the JobOperator, like a step-cache hit: child runs
tagged `cached_from`, `reuse` = from_run); the sweep's trials are skipped and `pick_best` hands
on the earlier run's best config. The parent run is tagged `from_run`, `from_parent_run_id` and
`start_at`, and every lineage tag downstream (base_run_id, teacher_run_id, sweep_best_run_id,
data_hash) names the earlier run's MLflow runs, which computed those outputs.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from llmops import provenance, step_cache, tracking
from llmops.params import KNOBS
from llmops.run import Run
from llmops.run_summary import find_parent as by_dag_run
from tasks.configs import flatten

log = logging.getLogger(__name__)

ORDER = ("data_prep", "sweep", "pretrain", "finetune", "distill", "evaluate")
START_AT = ORDER[1:]
# The lifecycle config's section each stage is built from.
SECTION = {"data_prep": "data", "sweep": "sweep", "pretrain": "pretrain", "finetune": "finetune",
           "distill": "distill"}
RUN_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,249}$")  # DAG run ids, MLflow run ids
RUN_CONF_ARTIFACT = "run_conf.json"   # the DAG run's conf as triggered (what a replay reuses)


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


def stage_record(parent: Any, stage: str) -> dict[str, Any]:
    """The step record of `stage` in the earlier run (the artifact of its finished child run)."""
    client = tracking.client()
    runs = client.search_runs([parent.info.experiment_id],
                              f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' and "
                              f"tags.stage = '{stage}' and tags.task_id = '{stage}'",
                              order_by=["attributes.start_time DESC"], max_results=5)
    finished = [r for r in runs if r.info.status == "FINISHED"]
    record = tracking.read_json_artifact(finished[0].info.run_id, step_cache.RECORD_ARTIFACT) \
        if finished else None
    if not record:
        raise FromRunError(
            f"Param 'from_run': run {parent.data.tags.get('run_id')} has no finished {stage} "
            f"stage with a step record ({'it did not finish' if not finished else 'it ran before the step cache'}"
            f"), so start_at cannot take {stage} from it. Start at {stage} or earlier, or pick "
            "another run. Nothing was started.")
    return record


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
        _fork_point(stage_record(parent, "pretrain"), int(params["fork_step"]), earlier_run_id)
    return {"run_id": earlier_run_id, "parent_run_id": parent.info.run_id, "start_at": start_at,
            "stages": stages, "sweep_best": best, "fork": fork}


def _fork_point(record: dict[str, Any], step: int, earlier_run_id: str) -> dict[str, Any]:
    """Where a fork of the earlier run's pretraining starts (tasks/train/fork.py): its
    checkpoints directory, the step (one it kept), that checkpoint's manifest hash (the step
    cache's input), its MLflow run and the config its job ran with."""
    final = ((record.get("result") or {}).get("outputs") or {}).get("checkpoint") or ""
    root = os.path.dirname(final)
    names = os.listdir(root) if os.path.isdir(root) else []
    kept = sorted(int(n[len("step_"):]) for n in names if re.fullmatch(r"step_\d{6,}", n))
    if not kept:
        raise FromRunError(f"Param 'fork_step': run {earlier_run_id}'s pretraining checkpoints "
                           f"({root or 'none recorded'}) are not on a disk this worker reads (a "
                           "fork from S3-only checkpoints is not supported yet). Nothing was started.")
    if step not in kept:
        raise FromRunError(f"Param 'fork_step': step {step} is not a kept checkpoint of run "
                           f"{earlier_run_id}'s pretraining; it keeps steps "
                           f"{', '.join(map(str, kept))}. Fork at one of them. Nothing was started.")
    manifest = os.path.join(root, f"step_{step:06d}", "manifest.json")
    return {"checkpoints": root, "step": step, "hash": step_cache.listing(manifest)[""],
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
