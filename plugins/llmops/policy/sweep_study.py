"""The Optuna study behind a sweep, in a database the Airflow tasks and the trial jobs share.

Where it lives: `$LLMOPS_STUDY_STORAGE` (on MWAA the Airflow Variable `llmops_study_storage`), any
SQLAlchemy URL Optuna accepts, e.g. `postgresql+psycopg2://optuna@my-db.xxxx.rds.amazonaws.com/optuna`
for RDS; else SQLite at `$LLMOPS_HOME/optuna.db`. The URL carries no password: remote jobs refuse
credentials in their environment, so give the database user IAM authentication or a `.pgpass`.

Its name is a function of the DAG run and the search (`<dag_id>/<run_id>/sweep-<hash>`), so
clearing or re-running the DAG run opens the same study and keeps its finished trials.

Slots: the DAG maps one task per slot. A slot's task asks the study for a trial once and tags it
with the slot. A retry or a rerun finds that trial again (same parameters, hence the same job name:
the backend reattaches to the job or resumes it from its checkpoint), a finished one is reported
without running again, and one that failed for good is replaced by a fresh trial.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

from llmops.core import settings
from tasks import configs

log = logging.getLogger(__name__)

STORAGE_ENV = "LLMOPS_STUDY_STORAGE"
STORAGE_VARIABLE = "llmops_study_storage"
# What a trial job reads to find its trial (set by `job_env`, read by tasks/sweep.py).
JOB_ENV = ("LLMOPS_STUDY_STORAGE", "LLMOPS_STUDY_NAME", "LLMOPS_TRIAL_NUMBER")
SLOT_ATTR = "slot"
RESULT_ATTR = "result"


# -- where and what ---------------------------------------------------------------------------

def storage_url() -> str:
    """The study database's URL: the environment, the Airflow Variable, else SQLite locally."""
    url = os.environ.get(STORAGE_ENV)
    if not url:
        try:
            from airflow.sdk import Variable

            url = Variable.get(STORAGE_VARIABLE, default=None)
        except Exception:  # outside a task: the environment only
            url = None
    return url or f"sqlite:///{settings.home() / 'optuna.db'}"


def redact(url: str) -> str:
    """A database URL fit for a log line or a tag: any password replaced."""
    return re.sub(r"^([a-z][a-z0-9+.-]*://[^/@:\s]*):[^/@\s]*@", r"\1:***@", url, flags=re.I)


def is_local(url: str) -> bool:
    """A SQLite file is only reachable from this machine: remote jobs cannot report to it."""
    return url.startswith("sqlite:")


def study_ref(*, dag_id: str, run_id: str, sweep: dict[str, Any], storage: str | None = None
              ) -> dict[str, Any]:
    """Everything needed to open a run's study again, as plain JSON (it travels in XCom)."""
    cfg = configs.from_dict(configs.SweepConfig, sweep)
    search = {"space": cfg.space(), "sampler": cfg.sampler, "pruner": cfg.pruner, "steps": cfg.steps,
              "evals": cfg.evals, "seed": cfg.seed, "trials": cfg.trials}
    digest = hashlib.sha256(json.dumps(search, sort_keys=True).encode()).hexdigest()[:8]
    eval_interval = trial_eval_interval(cfg)
    return {
        "storage": storage or storage_url(),
        "name": cfg.study or f"{dag_id}/{run_id}/sweep-{digest}",
        **search,
        "grid": grid(cfg) if cfg.sampler == "grid" else None,
        "slots": slot_count(cfg),
        "eval_interval": eval_interval,
        # Read back by the trial job (tasks/sweep.py) to build the same pruner.
        "pruner_settings": pruner_settings(cfg.pruner, eval_interval),
    }


def trial_eval_interval(cfg: configs.SweepConfig) -> int:
    """Steps between a trial's validation evals: the points where the pruner may stop it."""
    return max(1, cfg.steps // cfg.evals)


def pruner_settings(kind: str, eval_interval: int) -> dict[str, Any]:
    if kind == "median":
        # Never prune before two trials have finished: a median of one is noise.
        return {"kind": "median", "n_startup_trials": 2, "n_warmup_steps": 0}
    if kind == "asha":
        # Rungs at 1, 3, 9, ... evals; a trial continues past a rung only in its top third.
        return {"kind": "asha", "min_resource": eval_interval, "reduction_factor": 3}
    return {"kind": "none"}


def grid(cfg: configs.SweepConfig) -> dict[str, list]:
    """The grid sampler's points: `trials` log-spaced learning rates x every listed choice."""
    rates = [min(max(lr, cfg.lr_min), cfg.lr_max) for lr in cfg.learning_rates()]
    points: dict[str, list] = {"optim.lr": sorted(set(rates))}
    for path, spec in cfg.search_space.items():
        points[path] = list(spec["choices"])
    return points


def grid_point(ref: dict[str, Any], slot: int) -> dict[str, Any]:
    """The grid sampler's point for a slot: the slot-th combination, in a fixed order."""
    names = list(ref["grid"])
    return dict(zip(names, list(itertools.product(*ref["grid"].values()))[slot]))


def slot_count(cfg: configs.SweepConfig) -> int:
    if cfg.sampler != "grid":
        return cfg.trials
    size = 1
    for values in grid(cfg).values():
        size *= len(values)
    return size


# -- open ------------------------------------------------------------------------------------

STORAGE_ATTEMPTS = 5


def open_storage(url: str):
    """The study store at `url`, created on first use. Processes that open a new store at once
    (two sweeps planned on a fresh one, a reader during the first plan) race inside Optuna: each
    sees no tables, and all but the first fail creating them ("table studies already exists") or
    writing the schema version (a UNIQUE constraint). Four threads opening one new SQLite store
    failed so in 20 rounds of 20; the next attempt finds the tables and the version there."""
    import time

    import optuna
    from sqlalchemy.exc import IntegrityError, OperationalError

    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        # Trial jobs and Airflow tasks write at once: wait for the lock instead of failing.
        kwargs: dict[str, Any] = {"connect_args": {"timeout": 60}}
    else:
        kwargs = {"pool_pre_ping": True}
    for attempt in range(1, STORAGE_ATTEMPTS + 1):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
        except (IntegrityError, OperationalError):
            if attempt == STORAGE_ATTEMPTS:
                raise
            time.sleep(0.2 * attempt)


def make_sampler(ref: dict[str, Any], slot: int = 0, attempt: int = 0):
    """The sampler a slot asks with. Every slot asks from its own task, in its own process, with
    a fresh sampler: the seed varies with the slot (and with how many trials the slot had), or
    every slot would draw the same first point."""
    import optuna

    seed = ref["seed"] * 1_000_003 + slot * 1009 + attempt
    if ref["sampler"] == "grid":
        # slot i runs grid point i: a replaced slot retries its own point, and slots asking at
        # once cannot pick the same one (Optuna's GridSampler would do both)
        with warnings.catch_warnings():  # "experimental" since Optuna 2.4, unchanged since
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.PartialFixedSampler(grid_point(ref, slot),
                                                       optuna.samplers.RandomSampler(seed=seed))
    if ref["sampler"] == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # TPE needs a few random trials before its model means anything; constant_liar keeps
    # trials asked while others run from piling onto the same point.
    startup = min(10, max(2, ref["trials"] // 3))
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, constant_liar=True)


def open_study(ref: dict[str, Any], *, create: bool = False):
    """The run's study (created on the first call with create=True, found again afterwards)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = open_storage(ref["storage"])
    if create:
        study = optuna.create_study(storage=storage, study_name=ref["name"], direction="minimize",
                                    sampler=make_sampler(ref), load_if_exists=True)
        if "pruner" not in study.user_attrs:
            study.set_user_attr("pruner", ref["pruner_settings"])
            study.set_user_attr("space", ref["space"])
        elif study.user_attrs.get("space") != ref["space"]:
            raise ValueError(f"Study {ref['name']!r} searches {study.user_attrs.get('space')}, this "
                             f"run {ref['space']}: a study's trials are comparable only within one "
                             "search space. Name another study (Param sweep_study) or match it.")
        return study
    try:
        return optuna.load_study(study_name=ref["name"], storage=storage, sampler=make_sampler(ref))
    except KeyError:  # Optuna's "Record does not exist"
        raise ValueError(f"Study {ref['name']!r} does not exist in {redact(ref['storage'])}: "
                         "the sweep was never planned (see the plan_trials task).") from None


# -- slots -----------------------------------------------------------------------------------

FINISHED = ("COMPLETE", "PRUNED")


def trial_for_slot(study: Any, ref: dict[str, Any], slot: int):
    """The slot's trial: the one it asked for before unless that one failed; else a new one."""
    mine = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(SLOT_ATTR) == slot]
    if mine and mine[-1].state.name != "FAIL":
        return mine[-1]
    # this process's own draws: seeded by slot and by how many trials the slot had before
    study.sampler = make_sampler(ref, slot, attempt=len(mine))
    trial = study.ask()
    for path, spec in ref["space"].items():
        _suggest(trial, path, spec)
    trial.set_user_attr(SLOT_ATTR, slot)
    if mine:
        trial.set_user_attr("replaces", mine[-1].number)
    return study.trials[trial.number]


def _suggest(trial: Any, path: str, spec: dict[str, Any]) -> Any:
    if "choices" in spec:
        return trial.suggest_categorical(path, spec["choices"])
    if configs.field_type(configs.TrainConfig, path) is int:
        return trial.suggest_int(path, int(spec["low"]), int(spec["high"]), log=bool(spec.get("log")))
    return trial.suggest_float(path, float(spec["low"]), float(spec["high"]), log=bool(spec.get("log")))


def job_env(ref: dict[str, Any], number: int, backend: str) -> dict[str, str]:
    """What the trial job needs to report to its trial; nothing when it could not reach the
    database (a local SQLite file from a remote job): then it trains without early stopping and
    the Airflow side records its final loss."""
    if backend != "local" and is_local(ref["storage"]):
        return {}
    return dict(zip(JOB_ENV, (ref["storage"], ref["name"], str(number))))


# -- outcomes --------------------------------------------------------------------------------

def record(study: Any, number: int, result: dict[str, Any]) -> str:
    """Tell the study how the trial's job ended; returns the trial's state (complete, pruned)."""
    from optuna.trial import TrialState

    state = result.get("state", "complete")
    metrics = result.get("metrics", {})
    kept = {k: result.get(k) for k in ("state", "metrics", "mlflow_run_id", "job_name", "backend")}
    study._storage.set_trial_user_attr(_trial_id(study, number), RESULT_ATTR, kept)
    if state == "pruned":
        study.tell(number, state=TrialState.PRUNED, skip_if_finished=True)
    else:
        study.tell(number, float(metrics["val_loss"]), skip_if_finished=True)
    return state


def intermediate_values(study: Any, number: int) -> dict[str, float]:
    """The validation losses the trial reported, by step (JSON keys are strings)."""
    trial = study._storage.get_trial(_trial_id(study, number))
    return {str(step): value for step, value in sorted(trial.intermediate_values.items())}


def report_intermediate(study: Any, number: int, values: dict[str, float]) -> None:
    """Report a reused trial's validation losses into this study's trial, as its job would have."""
    trial_id = _trial_id(study, number)
    for step, value in sorted(values.items(), key=lambda kv: int(kv[0])):
        study._storage.set_trial_intermediate_value(trial_id, int(step), float(value))


def fail(study: Any, number: int, why: str) -> None:
    from optuna.trial import TrialState

    study._storage.set_trial_user_attr(_trial_id(study, number), "error", why[-1000:])
    study.tell(number, state=TrialState.FAIL, skip_if_finished=True)


def fail_orphans(study: Any) -> list[int]:
    """Trials still RUNNING once every slot's task is done lost their task (a killed worker,
    a cleared run left half-done): mark them failed so the study says what happened."""
    orphans = [t.number for t in study.get_trials(deepcopy=False) if t.state.name == "RUNNING"]
    for number in orphans:
        fail(study, number, "its task ended without recording an outcome")
    return orphans


def _trial_id(study: Any, number: int) -> int:
    # Optuna addresses storage rows by trial id; the DAG knows trials by their number.
    return study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)


def summary(study: Any) -> list[dict[str, Any]]:
    """Every trial of the study as plain JSON, in trial order."""
    out = []
    for t in study.get_trials(deepcopy=False):
        result = t.user_attrs.get(RESULT_ATTR) or {}
        steps = sorted(t.intermediate_values)
        out.append({"number": t.number, "slot": t.user_attrs.get(SLOT_ATTR),
                    "state": t.state.name.lower(), "params": dict(t.params), "value": t.value,
                    "last_step": steps[-1] if steps else None,
                    "steps_run": (result.get("metrics") or {}).get("step"),
                    "intermediate": {str(s): t.intermediate_values[s] for s in steps},
                    "mlflow_run_id": result.get("mlflow_run_id", ""),
                    "error": t.user_attrs.get("error", "")})
    return out
