"""Replay a recorded llm_lifecycle run from its MLflow record and say whether it reproduced: the
same as `python -m llmops.stages.replay RUN`, from the Airflow UI (see
plugins/llmops/stages/replay.py).

    check (refuses when the code or the data cannot be matched) -> replay (llm_lifecycle with the
    recorded conf, waited for) -> compare (loss curves and weights, on the replay's MLflow run)
"""

from __future__ import annotations

import pendulum
from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import Param, dag, get_current_context, task
from airflow.sdk.exceptions import AirflowFailException

from llmops.stages import replay, reuse

RUN_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,249}$"


@dag(
    dag_id="llm_replay",
    schedule=None,
    # Runs only when triggered, so nothing runs by itself unpaused; paused, a run triggered from
    # the CLI or REST would wait in 'queued' with no word why (the UI form unpauses, they don't).
    is_paused_upon_creation=False,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    params={
        "run": Param("", type="string", pattern=RUN_PATTERN,
                     description="The llm_lifecycle run to replay: its MLflow parent run id or its "
                                 "DAG run id."),
        "start_at": Param("sweep", type="string", enum=list(replay.REPLAY_START_AT),
                          description="The first stage computed again and compared: sweep (all "
                                      "but data prep, whose verified outputs are reused) or "
                                      "pretrain (the recorded sweep outcome too)."),
        "require_identical": Param(True, type="boolean",
                                   description="Fail the compare task unless the curves and "
                                               "weights are bitwise equal (right on CPU; GPU "
                                               "kernels are not bitwise deterministic)."),
    },
    tags=["llm", "replay"],
    doc_md=__doc__,
)
def llm_replay():
    @task
    def check() -> dict:
        """Refuse (no retry can fix it) when the recorded code or data cannot be matched."""
        params = get_current_context()["params"]
        try:
            return replay.plan(params["run"], params["start_at"])
        except replay.ReplayRefused as exc:
            raise AirflowFailException(f"Replay refused: {exc}") from None

    @task
    def compare(planned: dict) -> dict:
        ctx = get_current_context()
        run_id = ctx["ti"].xcom_pull(task_ids="replay", key="trigger_run_id")
        report = replay.compare(planned["original"], reuse.find_parent(run_id, replay.DAG_ID).info.run_id)
        replay.record_report(report)
        for line in replay.describe(report):
            print(line)
        if ctx["params"]["require_identical"] and not report["identical"]:
            raise AirflowFailException("\n".join(replay.describe(report)))
        return report

    planned = check()
    rerun = TriggerDagRunOperator(task_id="replay", trigger_dag_id=replay.DAG_ID,
                                  conf=planned["conf"], wait_for_completion=True, poke_interval=30)
    planned >> rerun >> compare(planned)


llm_replay()
