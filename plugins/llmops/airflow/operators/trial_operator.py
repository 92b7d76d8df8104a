"""`TrialOperator`: one slot of a sweep, run as a job on the stage's backend.

(Not `operator.py`: Airflow imports every file of the plugins folder as a top-level module by its
name, and one named `operator` would replace the standard library's.)
"""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowException

from llmops.airflow.operators.job_operator import JobOperator
from llmops.infra import tracking
from llmops.policy import sweep_study as studies


class TrialOperator(JobOperator):
    """A JobOperator for one slot of an Optuna study (op_kwargs carry `study` and `slot`).

    Before the job: asks the study for the slot's trial, or finds it again (see sweep_study). A
    trial that already finished (a rerun of the DAG run) is reported as it was, without a job. The
    trial's number and parameters reach `build_spec` as `trial`.

    After the job: tells the study how the trial ended (its val_loss, or pruned) and tags the
    trial's MLflow run with `trial_state`. A job that fails is retried like any task (same trial,
    same job name: the backend resumes it); on the last try the trial is marked failed in the
    study and the task fails, which the sweep's `pick_best` (trigger rule all_done) survives.

    Step cache: a trial is a stage like the others. A slot whose trial has the same config as a
    finished earlier trial (same sampled point, data, code) reuses its outcome: the study is told
    its validation losses along the way and its final one, as if it had run. Only complete
    trials are recorded: where a pruned one stopped depended on the other trials of its study.
    """

    def execute(self, context: Any) -> dict[str, Any]:
        study, trial = self._trial()
        if trial.state.name in studies.FINISHED:
            kept = dict(trial.user_attrs.get(studies.RESULT_ATTR) or {})
            self.log.info("Trial %d (slot %s) already %s in study %s: kept, not run again.",
                          trial.number, self.op_kwargs["slot"], trial.state.name.lower(),
                          study.study_name)
            return {**kept, "trial": trial.number, "params": dict(trial.params), "kept": True}
        self.log.info("Slot %s runs trial %d of study %s with %s", self.op_kwargs["slot"],
                      trial.number, study.study_name, trial.params)
        self.op_kwargs = {**self.op_kwargs,
                          "trial": {"number": trial.number, "params": dict(trial.params)}}
        try:
            result = super().execute(context)
        except Exception as exc:  # not TaskDeferred (a BaseException): deferring is no failure
            self._failed(context, study, trial.number, exc)
            raise
        return self._record(study, trial, result)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        study, trial = self._trial()
        try:
            result = super().execute_complete(context, event)
        except Exception as exc:
            self._failed(context, study, trial.number, exc)
            raise
        return self._record(study, trial, result)

    # -- helpers -----------------------------------------------------------------------------
    def _trial(self):
        ref, slot = self.op_kwargs["study"], int(self.op_kwargs["slot"])
        study = studies.open_study(ref)
        return study, studies.trial_for_slot(study, ref, slot)

    def _prepare(self, context: Any):
        spec = super()._prepare(context)
        self._mlflow_run_id = spec.env.get("MLFLOW_RUN_ID", "")
        trial = self.op_kwargs.get("trial")
        if self._mlflow_run_id and trial:
            tracking.rename_run(self._mlflow_run_id, trial_run_name(trial))
        return spec

    def cache_entry(self, result: dict[str, Any]) -> dict[str, Any] | None:
        if result.get("state", "complete") != "complete":
            return None
        study, trial = self._trial()
        return {**result, "intermediate": studies.intermediate_values(study, trial.number)}

    def _record(self, study: Any, trial: Any, result: dict[str, Any]) -> dict[str, Any]:
        if result.get("cached_from"):   # its validation losses, as the pruner would have seen them
            studies.report_intermediate(study, trial.number, result.get("intermediate") or {})
        state = studies.record(study, trial.number, result)
        # The task's own child run (a reused trial's result names the earlier trial's run).
        self._tag(getattr(self, "_mlflow_run_id", "") or result.get("mlflow_run_id", ""), state,
                  study.study_name, trial.number)
        self.log.info("Trial %d %s: val_loss %.4f after %s of %s steps", trial.number, state,
                      result["metrics"]["val_loss"], result["metrics"].get("step"),
                      result["metrics"].get("max_steps"))
        return {**result, "trial": trial.number, "params": dict(trial.params)}

    def _failed(self, context: Any, study: Any, number: int, exc: Exception) -> None:
        ti = context["ti"]
        if ti.try_number <= getattr(ti, "max_tries", self.retries):
            self.log.info("Trial %d failed on try %d; the retry resumes the same trial.",
                          number, ti.try_number)
            return
        why = str(exc) if isinstance(exc, AirflowException) else f"{type(exc).__name__}: {exc}"
        studies.fail(study, number, why)
        self._tag(getattr(self, "_mlflow_run_id", ""), "failed", study.study_name, number)
        self.log.error("Trial %d failed on its last try: marked failed in study %s. The sweep "
                       "goes on with the other trials.", number, study.study_name)

    @staticmethod
    def _tag(run_id: str, state: str, study_name: str, number: int) -> None:
        if not run_id:
            return
        client = tracking.client()
        for key, value in {"trial_state": state, "trial_number": str(number),
                           "study": study_name}.items():
            client.set_tag(run_id, key, value)


def trial_run_name(trial: dict[str, Any]) -> str:
    """`trial-3 lr=2.5e-03`: the trial's number and, when it is searched, its learning rate."""
    params = trial.get("params") or {}
    lr = params.get("optim.lr", params.get("lr"))
    return f"trial-{trial['number']}" + (f" lr={float(lr):.2e}" if lr is not None else "")
