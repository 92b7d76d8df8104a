"""The daily platform report: the job ledger's last day (or `days` days) as tables and plots in
the MLflow experiment `llmops-platform`: accelerator-hours and cost per team and stage, failure
rates by reason, badput hours, queue times. Wiring only:
plugins/llmops/infra/ledger/platform_report.py."""

from __future__ import annotations

import pendulum
from airflow.sdk import Param, dag, get_current_context, task


@dag(
    dag_id="llm_platform_report",
    schedule="0 1 * * *",  # 01:00 UTC: the day before, once its last jobs have ended
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    params={"days": Param(1, type="integer", minimum=1, maximum=366,
                          description="How many days up to the run's date the report covers.")},
    tags=["llm", "platform"],
    doc_md=__doc__,
)
def llm_platform_report():
    @task
    def report() -> dict:
        """Read the ledger for the period (Parquet on S3 when the storage root is there) and log it."""
        from llmops.infra.ledger import platform_report

        ctx = get_current_context()
        end = ctx.get("logical_date") or pendulum.now("UTC")
        start = end - pendulum.duration(days=int(ctx["params"]["days"]))
        return platform_report.daily(start, end)

    report()


llm_platform_report()
