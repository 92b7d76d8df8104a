"""Scheduled retraining: fine-tune the current champion on the newest curated data, evaluate the
challenger against the champion on that data, and promote it only through the gate (optionally
after a human approves). Runs weekly and whenever the curated-data Asset gets an event; no
catch-up, one run at a time. Wiring only: what each step does lives in
plugins/llmops/stages/retraining.py, the gate in plugins/llmops/policy/promotion.py, the jobs in
tasks/.

The curated-data Asset's producer sets the event's extra to {"data_dir": <data prep output>,
"data_hash": <manifest content hash>}; the `data_dir` Param overrides it for a manual run.
"""

from __future__ import annotations

import pendulum
from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import (Asset, AssetOrTimeSchedule, CronTriggerTimetable, dag,
                         get_current_context, task)
from airflow.sdk.exceptions import AirflowSkipException

from llmops.airflow.operators.job_operator import JobOperator
from llmops.core.run import Run
from llmops.infra import notify
from llmops.policy import promotion
from llmops.policy.params import retrain_params
from llmops.stages import retraining

CURATED_DATA = Asset("llmops://data/curated")
CHAMPION = Asset("llmops://models/champion")
WEEKLY = CronTriggerTimetable("0 3 * * 1", timezone="UTC")  # Mondays 03:00 UTC


@dag(
    dag_id="llm_retrain",
    schedule=AssetOrTimeSchedule(timetable=WEEKLY, assets=CURATED_DATA),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    params=retrain_params(),
    # A stage's final failure (not a retry) alerts the deployment's topic, if it has one.
    default_args={"retries": 1, "retry_delay": pendulum.duration(seconds=5),
                  "on_failure_callback": notify.stage_failed},
    tags=["llm", "retrain"],
    doc_md=__doc__,
)
def llm_retrain():
    @task(inlets=[CURATED_DATA])
    def start() -> dict:
        """Pin the champion, find the new data, open the MLflow parent run (skip if nothing to do)."""
        ctx = get_current_context()
        newest = ctx["inlet_events"][CURATED_DATA].ascending(False).limit(1)
        triggering = [e for events in (ctx.get("triggering_asset_events") or {}).values()
                      for e in events]
        extras = [e.extra for e in newest] + [e.extra for e in triggering]  # oldest first
        run = retraining.start_retrain(ctx["params"], dag_id=ctx["dag"].dag_id,
                                       run_id=ctx["run_id"], events=extras)
        if run is None:
            raise AirflowSkipException("Nothing to retrain: no `champion` yet (run llm_lifecycle) "
                                       "or no curated data (no asset event, no data_dir Param).")
        return run

    @task
    def gate(run: dict, evaluation: dict) -> dict:
        """Register the challenger with its lineage; it passes or is kept as `challenger`."""
        run = Run.of(run)
        decision = promotion.gate(run, evaluation, run.data, candidates=("challenger",))
        return {**decision, "body": promotion.approval_body(decision)}

    @task.branch
    def route(run: dict, decision: dict) -> str | None:
        return retraining.next_step(run, decision)

    @task(outlets=[CHAMPION], trigger_rule="none_failed_min_one_success")
    def promote(decision: dict) -> dict:
        """Move `champion` (after approve, when the run asks for a human to decide)."""
        # run comes by XCom pull, not as an argument: a setup's direct downstream tasks must
        # use all_success, and this one also follows the optional approval
        ti = get_current_context()["ti"]
        return promotion.crown(ti.xcom_pull(task_ids="start"), decision,
                               ti.xcom_pull(task_ids="approve"))

    @task
    def finish(run: dict) -> dict:
        """Teardown: record the outcome (refused, rejected, promoted) and close the parent run."""
        ti = get_current_context()["ti"]
        return retraining.finish(run, ti.xcom_pull(task_ids="gate"), ti.xcom_pull(task_ids="approve"),
                                 ti.xcom_pull(task_ids="promote"))

    run = start()
    finetune = JobOperator(task_id="finetune", build_spec=retraining.retrain_finetune_spec,
                           op_kwargs={"run": run})
    evaluate = JobOperator(task_id="evaluate", build_spec=retraining.retrain_evaluate_spec,
                           op_kwargs={"run": run, "challenger": finetune.output})
    decision = gate(run, evaluate.output)
    approve = ApprovalOperator(
        task_id="approve", subject="Promote the retrained model to champion?",
        body="{{ ti.xcom_pull(task_ids='gate')['body'] }}",
        response_timeout=pendulum.duration(days=3), defaults="Reject")
    promoted = promote(decision)
    route(run, decision) >> [approve, promoted]
    approve >> promoted
    promoted >> finish(run).as_teardown(setups=run)


llm_retrain()
