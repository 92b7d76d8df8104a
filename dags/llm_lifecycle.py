"""Raw text to an evaluated, registered model: data prep, sweep, pretrain, fine-tune, distill,
evaluate, promote. Wiring only: what each step does lives in plugins/llmops and tasks/."""

from __future__ import annotations

import pendulum
from airflow.sdk import Asset, dag, get_current_context, task
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from llmops.airflow.operators.job_operator import JobOperator
from llmops.airflow.operators.trial_operator import TrialOperator
from llmops.airflow.sweep_pool import POOL
from llmops.core.run import Run
from llmops.infra import notify
from llmops.policy import promotion
from llmops.policy.params import lifecycle_params
from llmops.stages import lifecycle, run_summary, specs
from llmops.stages import sweep_stage as sweep
from llmops.stages.ladder_stage import LADDER_RECOMMENDATION_URI
from llmops.stages.sweep_stage import SWEEP_BEST_URI

CHAMPION = Asset("llmops://models/champion")
SWEEP_BEST = Asset(SWEEP_BEST_URI.format(dag_id="llm_lifecycle"))
LADDER_RECOMMENDATION = Asset(LADDER_RECOMMENDATION_URI)


@dag(
    dag_id="llm_lifecycle",
    schedule=None,
    # Runs only when triggered, so nothing runs by itself unpaused; paused, a run triggered from
    # the CLI or REST would wait in 'queued' with no word why (the UI form unpauses, they don't).
    is_paused_upon_creation=False,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    params=lifecycle_params(),
    # A stage's final failure (not a retry) alerts the deployment's topic, if it has one.
    default_args={"retries": 1, "retry_delay": pendulum.duration(seconds=5),
                  "on_failure_callback": notify.stage_failed},
    tags=["llm", "lifecycle"],
    doc_md=__doc__,
)
def llm_lifecycle():
    @task
    def start_run() -> dict:
        """Check every input (before any job starts) and open the MLflow parent run. A refusal
        fails the task at once: no retry can fix the run's own Params. Its message (the Param
        and the fix) is left as an XCom for the run's note and its page to quote."""
        ctx = get_current_context()
        try:
            return lifecycle.start_run(ctx["params"], dag_id=ctx["dag"].dag_id, run_id=ctx["run_id"],
                                       conf=ctx["dag_run"].conf,
                                       user=getattr(ctx["dag_run"], "triggering_user_name", None))
        except lifecycle.validation_errors() as exc:
            ctx["ti"].xcom_push(run_summary.REFUSAL_XCOM, str(exc))
            raise AirflowFailException(str(exc)) from None

    @task(trigger_rule="all_done", inlets=[LADDER_RECOMMENDATION], outlets=[SWEEP_BEST])
    def pick_best(run: dict | None) -> dict:
        """The study's best trial once every slot is done: a failed trial does not sink the sweep.
        Skipped when start_run failed, whether it refused the run or its process died before it
        ran (all_done runs it anyway; either way start_run left no XCom, so `run` is None)."""
        if run is None:
            raise AirflowSkipException("start_run did not finish (see its log): no sweep to pick from.")
        run = Run.of(run)
        if run.base_model:
            raise AirflowSkipException(f"base_model {run.base_model} is fine-tuned: no sweep, "
                                       "no pretraining.")
        ctx = get_current_context()
        best = sweep.pick_best(run, sweep.latest_extra(ctx["inlet_events"][LADDER_RECOMMENDATION]))
        ctx["outlet_events"][SWEEP_BEST].extra = {k: v for k, v in best.items() if k != "trials"}
        return best

    @task(outlets=[CHAMPION])
    def promote(run: dict, evaluation: dict, data: dict) -> dict:
        """The gate: the preferred passing model becomes `champion`; a refused one stays
        `challenger` with its reasons, and the task is skipped so CHAMPION gets no event."""
        decision = promotion.promote(run, evaluation, data)
        ctx = get_current_context()
        # The run page's headline figures onto the MLflow parent run, and the DAG run's note line
        # (a task cannot set notes: llmops.airflow.run_note copies this XCom when the run finishes).
        note = run_summary.record(ctx["dag"].dag_id, ctx["run_id"], recipe=ctx["params"].get("recipe"))
        if note:
            ctx["ti"].xcom_push(run_summary.NOTE_XCOM, note)
        if not decision["promoted"]:
            raise AirflowSkipException(promotion.summary(decision))
        return decision

    run = start_run()
    data = JobOperator(task_id="data_prep", build_spec=specs.data_prep_spec,
                       op_kwargs={"run": run})
    # One mapped task per slot of the run's Optuna study; the pool is the accelerator quota.
    trials = TrialOperator.partial(task_id="sweep_trial", build_spec=specs.trial_spec,
                                   pool=POOL).expand(
        op_kwargs=task(specs.sweep_trials, task_id="plan_trials")(run, data.output))
    best = pick_best(run)
    trials >> best
    pretrain = JobOperator(task_id="pretrain", build_spec=specs.pretrain_spec,
                           op_kwargs={"run": run, "data": data.output, "best": best})
    # none_failed: with a base_model Param pretraining is skipped and these start from it
    finetune = JobOperator(task_id="finetune", build_spec=specs.finetune_spec,
                           op_kwargs={"run": run, "data": data.output, "base": pretrain.output},
                           trigger_rule="none_failed")
    distill = JobOperator(task_id="distill", build_spec=specs.distill_spec,
                          op_kwargs={"run": run, "data": data.output, "teacher": finetune.output})
    evaluate = JobOperator(task_id="evaluate", build_spec=specs.evaluate_spec,
                           op_kwargs={"run": run, "data": data.output, "pretrained": pretrain.output,
                                      "teacher": finetune.output, "student": distill.output},
                           trigger_rule="none_failed")
    promote(run, evaluate.output, data.output)


llm_lifecycle()
