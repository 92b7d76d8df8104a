"""A scaling ladder: small models across sizes N and token counts D, the law L(N, D) fitted to
their losses, and the compute-optimal N and D for a FLOP budget. Wiring only: what each step does
lives in plugins/llmops/stages/ladder_stage.py and tasks/ladder.py."""

from __future__ import annotations

import pendulum
from airflow.sdk import Asset, dag, get_current_context, task

from llmops.airflow.operators.job_operator import JobOperator
from llmops.airflow.sweep_pool import POOL
from llmops.policy.params import ladder_params
from llmops.stages import ladder_stage as ladder
from llmops.stages import specs
from llmops.stages.ladder_stage import LADDER_RECOMMENDATION_URI

RECOMMENDATION = Asset(LADDER_RECOMMENDATION_URI)


@dag(
    dag_id="scaling_ladder",
    schedule=None,
    # Runs only when triggered, so nothing runs by itself unpaused; paused, a run triggered from
    # the CLI or REST would wait in 'queued' with no word why (the UI form unpauses, they don't).
    is_paused_upon_creation=False,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    params=ladder_params(),
    default_args={"retries": 1, "retry_delay": pendulum.duration(seconds=5)},
    tags=["llm", "scaling"],
    doc_md=__doc__,
)
def scaling_ladder():
    @task
    def start_ladder() -> dict:
        """Validate the Params, refuse a ladder over budget (before any job starts), open the
        MLflow parent run."""
        ctx = get_current_context()
        return ladder.start_ladder(ctx["params"], dag_id=ctx["dag"].dag_id, run_id=ctx["run_id"])

    @task(outlets=[RECOMMENDATION])
    def publish(run: dict, fit: dict) -> dict:
        recommendation = ladder.publish(run, fit)
        get_current_context()["outlet_events"][RECOMMENDATION].extra = recommendation
        return recommendation

    run = start_ladder()
    data = JobOperator(task_id="data_prep", build_spec=specs.data_prep_spec,
                       op_kwargs={"run": run})
    # One mapped task per rung, in the same accelerator pool as the sweep's trials.
    rungs = JobOperator.partial(task_id="ladder_rung", build_spec=ladder.rung_spec,
                                pool=POOL).expand(
        op_kwargs=task(ladder.plan_rungs, task_id="plan_rungs")(run, data.output))
    fit = JobOperator(task_id="fit_law", build_spec=ladder.fit_spec, trigger_rule="all_done",
                      op_kwargs={"run": run, "data": data.output, "results": rungs.output})
    publish(run, fit.output)


scaling_ladder()
