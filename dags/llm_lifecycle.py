"""Raw text to an evaluated, registered model: data prep, sweep, pretrain, fine-tune, distill,
evaluate, promote. Wiring only: what each step does lives in plugins/llmops and tasks/."""

from __future__ import annotations

import pendulum
from airflow.sdk import Asset, dag, get_current_context, task

from llmops import lifecycle
from llmops.operators.job import JobOperator
from llmops.params import lifecycle_params

CHAMPION = Asset("llmops://models/champion")


@dag(
    dag_id="llm_lifecycle",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    params=lifecycle_params(),
    default_args={"retries": 1, "retry_delay": pendulum.duration(seconds=5)},
    tags=["llm", "lifecycle"],
    doc_md=__doc__,
)
def llm_lifecycle():
    @task
    def start_run() -> dict:
        """Validate the Params (before any job starts) and open the MLflow parent run."""
        ctx = get_current_context()
        return lifecycle.start_run(ctx["params"], dag_id=ctx["dag"].dag_id, run_id=ctx["run_id"])

    @task
    def pick_best(results: list[dict]) -> dict:
        return lifecycle.best_trial(list(results))

    @task(outlets=[CHAMPION])
    def promote(run: dict, evaluation: dict, data: dict) -> dict:
        return lifecycle.promote(run, evaluation, data)

    run = start_run()
    data = JobOperator(task_id="data_prep", build_spec=lifecycle.data_prep_spec,
                       op_kwargs={"run": run})
    trials = JobOperator.partial(task_id="sweep_trial", build_spec=lifecycle.trial_spec).expand(
        op_kwargs=task(lifecycle.sweep_trials, task_id="plan_trials")(run, data.output))
    best = pick_best(trials.output)
    pretrain = JobOperator(task_id="pretrain", build_spec=lifecycle.pretrain_spec,
                           op_kwargs={"run": run, "data": data.output, "best": best})
    finetune = JobOperator(task_id="finetune", build_spec=lifecycle.finetune_spec,
                           op_kwargs={"run": run, "data": data.output, "base": pretrain.output})
    distill = JobOperator(task_id="distill", build_spec=lifecycle.distill_spec,
                          op_kwargs={"run": run, "data": data.output, "teacher": finetune.output})
    evaluate = JobOperator(task_id="evaluate", build_spec=lifecycle.evaluate_spec,
                           op_kwargs={"run": run, "data": data.output, "pretrained": pretrain.output,
                                      "teacher": finetune.output, "student": distill.output})
    promote(run, evaluate.output, data.output)


llm_lifecycle()
