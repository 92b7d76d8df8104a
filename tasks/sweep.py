"""One sweep trial (or scaling-ladder rung): a short pretraining run ranked by its validation loss.

    python -m tasks.sweep --config CONFIG.json --result RESULT.json   (a TrainConfig)

In a study (LLMOPS_STUDY_STORAGE, LLMOPS_STUDY_NAME and LLMOPS_TRIAL_NUMBER, set by the Airflow
side, plugins/llmops/policy/sweep_study.py) the trial reports its validation loss to the Optuna
study after every evaluation, and stops as soon as the study's pruner says it cannot win: the result
then says `"state": "pruned"` and the step it stopped at. Without a study it trains to the end.

A tuning service's choice of hyperparameters overrides the config first: SageMaker hands a tuning
job's values to every training job in SM_HPS, named `tune.<config path>` (see
plugins/llmops/stages/sweep_tuning.py).

Trials skip the model directory and the MLflow model: only their numbers are needed.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from tasks.common.entry import run_stage
from tasks.configs import TrainConfig, from_dict, to_dict

log = logging.getLogger("tasks.sweep")

TUNED_PREFIX = "tune."
STUDY_ENV = ("LLMOPS_STUDY_STORAGE", "LLMOPS_STUDY_NAME", "LLMOPS_TRIAL_NUMBER")


def tuned_overrides(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """{config path: value} chosen by a tuning service for this job (SageMaker: SM_HPS)."""
    hps = json.loads((environ if environ is not None else os.environ).get("SM_HPS") or "{}")
    return {k[len(TUNED_PREFIX):]: v for k, v in hps.items() if k.startswith(TUNED_PREFIX)}


def with_overrides(cfg: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """cfg with dotted-path overrides applied and the result validated like any config."""
    data = to_dict(cfg)
    for path, value in overrides.items():
        *parents, leaf = path.split(".")
        node = data
        for name in parents:
            node = node[name]
        if leaf not in node:
            raise ValueError(f"tuned hyperparameter {path!r} is not a TrainConfig field")
        # services hand values over as text: "0.003" for a float, "16" for an int
        current = node[leaf]
        node[leaf] = type(current)(float(value)) if isinstance(current, (int, float)) and \
            not isinstance(current, bool) and isinstance(value, str) else value
    return from_dict(TrainConfig, data)


class StudyReporter:
    """The trial's side of its study: report each validation loss, stop when told.

    Called by the training loop after every evaluation (`on_eval`). Raises `optuna.TrialPruned`
    when the study's pruner (rebuilt from the settings the Airflow side stored on the study)
    decides the trial cannot beat the others; never at the last step, where stopping saves
    nothing."""

    def __init__(self, storage: str, study_name: str, number: int, max_steps: int):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        kwargs = {"connect_args": {"timeout": 60}} if storage.startswith("sqlite:") else {}
        self.study = optuna.load_study(
            study_name=study_name,
            storage=optuna.storages.RDBStorage(storage, engine_kwargs=kwargs))
        self.study.pruner = make_pruner(self.study.user_attrs.get("pruner") or {"kind": "none"})
        trial_id = self.study._storage.get_trial_id_from_study_id_trial_number(
            self.study._study_id, number)
        self.trial = optuna.trial.Trial(self.study, trial_id)
        self.number, self.max_steps = number, max_steps
        self.last: tuple[int, float] | None = None

    @classmethod
    def from_env(cls, max_steps: int) -> "StudyReporter | None":
        storage, name, number = (os.environ.get(k) for k in STUDY_ENV)
        if not (storage and name and number):
            return None
        return cls(storage, name, int(number), max_steps)

    def __call__(self, step: int, val: dict[str, float]) -> None:
        import optuna

        value = float(val["val_loss"])
        self.last = (step, value)
        try:
            self.trial.report(value, step)
        except RuntimeError as exc:  # the Airflow side already closed the trial: keep training
            log.warning("trial %d: could not report step %d: %s", self.number, step, exc)
            return
        if step < self.max_steps and self.trial.should_prune():
            raise optuna.TrialPruned(f"trial {self.number} pruned at step {step}/{self.max_steps}: "
                                     f"val_loss {value:.4f}")


def make_pruner(settings: dict[str, Any]):
    import optuna

    kind = settings.get("kind", "none")
    if kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=settings["n_startup_trials"],
                                           n_warmup_steps=settings["n_warmup_steps"])
    if kind == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=settings["min_resource"],
                                                      reduction_factor=settings["reduction_factor"])
    return optuna.pruners.NopPruner()


def run_trial(cfg: TrainConfig, reporter: StudyReporter | None = None) -> dict[str, Any]:
    """Pretraining (tasks/train/pretraining.py) for cfg.max_steps, or until the study prunes the
    trial; the result says which (`state`) and carries the scaling law's N and D for ladder rungs."""
    import mlflow
    import optuna

    from tasks.train.pretraining import pretrain

    # N of the scaling law: the transformer blocks, without the embedding's vocab x width
    sizes = {"non_embedding_params": 12 * cfg.model.n_layer * cfg.model.n_embd ** 2,
             "max_steps": cfg.max_steps}
    try:
        result = pretrain(cfg, stage="sweep", publish=False, on_eval=reporter)
    except optuna.TrialPruned as pruned:
        log.info("%s", pruned)
        step, val_loss = reporter.last if reporter and reporter.last else (0, float("nan"))
        # MLflow closed the run as failed when the signal left it: it was stopped on purpose
        run_id = os.environ.get("MLFLOW_RUN_ID") or mlflow.last_active_run().info.run_id
        client = mlflow.MlflowClient()
        client.set_tag(run_id, "trial_state", "pruned")
        client.log_metric(run_id, "trial/steps_run", step)
        client.log_metric(run_id, "trial/steps_saved", cfg.max_steps - step)
        client.set_terminated(run_id, "FINISHED")
        return {"state": "pruned", "outputs": {}, "mlflow_run_id": run_id,
                "metrics": {"val_loss": val_loss, "lr": cfg.optim.lr, "step": step,
                            "tokens": step * cfg.batch_size * cfg.model.block_size, **sizes}}
    run_id = result["mlflow_run_id"]
    client = mlflow.MlflowClient()
    client.set_tag(run_id, "trial_state", "complete")
    client.log_metric(run_id, "trial/steps_run", result["metrics"]["step"])
    client.log_metric(run_id, "trial/steps_saved", 0)
    tokens = result["metrics"]["step"] * cfg.batch_size * cfg.model.block_size
    return {"state": "complete", **result,
            "metrics": {**result["metrics"], "tokens": tokens, **sizes}}


def main(cfg: TrainConfig) -> dict[str, Any]:
    overrides = tuned_overrides()
    if overrides:
        log.info("hyperparameters chosen by the tuning service: %s", overrides)
        cfg = with_overrides(cfg, overrides)
    reporter = StudyReporter.from_env(cfg.max_steps)
    if reporter is not None:
        log.info("reporting to trial %d of study %s", reporter.number, reporter.study.study_name)
    return run_trial(cfg, reporter)


if __name__ == "__main__":
    run_stage("sweep", TrainConfig, main)
