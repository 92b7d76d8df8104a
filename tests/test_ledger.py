"""The job ledger: what the JobOperator records for each job (submit, reattach, retry, end, with
times, state and reason), accelerator-hours and cost from the price table, the Parquet layout
Athena reads, and the platform report built from it."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowException

from llmops.airflow.operators.job_operator import JobOperator
from llmops.infra import ledger
from llmops.infra.ledger import platform_report as report, store
from llmops.infra.ledger.events import FIELDS, JobEvent, arrow_schema, price_table, with_usage
from tests.test_wait_faults import FakeStore, FakeTI

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LLMOPS_STORAGE_ROOT", raising=False)
    return tmp_path / "home"


def run_try(op: JobOperator, ti: FakeTI, store_: FakeStore):
    return op.execute({"ti": ti, "params": {}, "task_state_store": store_})


def sample_operator(**config) -> JobOperator:
    return JobOperator(task_id="train", deferrable=False, retries=2,
                       spec={"stage": "pretrain", "entrypoint": "tests.sample_job", "config": config,
                             "tags": {"team": "research"}})


def rows_of(job_name: str) -> list[dict]:
    return [r for r in ledger.read_events(0) if r["job_name"] == job_name]


def test_operator_records_submit_end_and_a_reattach_with_times(home):
    before = time.time()
    op, tasks = sample_operator(seconds=0.3), FakeStore()
    result = run_try(op, FakeTI(try_number=1), tasks)
    name = result["job_name"]
    (submitted, ended) = rows_of(name)
    assert (submitted["event"], ended["event"]) == ("submitted", "ended")
    assert ended["state"] == "succeeded" and ended["failure_reason"] == ""
    assert before <= submitted["submitted_at"] <= ended["started_at"] < ended["ended_at"] <= time.time()
    assert ended["ended_at"] - ended["started_at"] >= 0.3          # the job slept 0.3 s
    assert ended["queue_seconds"] == pytest.approx(ended["started_at"] - submitted["submitted_at"])
    for row in (submitted, ended):
        assert (row["dag_id"], row["run_id"], row["task_id"], row["team"], row["stage"],
                row["backend"]) == ("dag", "manual__1", "pretrain", "research", "pretrain", "local")
        assert len(row["spec_hash"]) == 64 and row["instance_type"] == "local"
    assert ended["accelerator_hours"] == 0.0 and ended["estimated_cost_usd"] == 0.0
    # A second try of the task finds the finished job: a reattach, and no second attempt.
    run_try(op, FakeTI(try_number=2), tasks)
    events = sorted((r["event"], r["attempt"]) for r in rows_of(name))
    assert events == [("ended", 1), ("reattached", 1), ("submitted", 1)], "one end per attempt"
    assert [r["try_number"] for r in rows_of(name) if r["event"] == "reattached"] == [2]
    assert ledger.write_errors == 0


def test_a_failed_job_has_its_reason_and_a_retry_is_a_new_attempt(home):
    op, tasks = sample_operator(exit_code=5), FakeStore()
    for try_number in (1, 2):
        with pytest.raises(AirflowException, match="exited with code 5"):
            run_try(op, FakeTI(try_number=try_number), tasks)
    rows = rows_of(op._ledger_job["job_name"])
    assert [(r["event"], r["attempt"], r["try_number"]) for r in rows] == [
        ("submitted", 1, 1), ("ended", 1, 1), ("retried", 2, 2), ("ended", 2, 2)]
    for end in (rows[1], rows[3]):
        assert end["state"] == "failed" and end["failure_reason"] == "the job exited with code 5"
        assert end["started_at"] <= end["ended_at"]


def test_accelerator_hours_and_cost_come_from_the_price_table():
    table = price_table()
    assert table["source"].startswith("https://aws.amazon.com/sagemaker/pricing/") and table["date"]
    start = 1_780_000_000.0
    event = with_usage(JobEvent(event="ended", job_name="j", instance_type="ml.p4d.24xlarge",
                                instance_count=2, submitted_at=start - 120, started_at=start,
                                ended_at=start + 90 * 60))
    assert event.queue_seconds == 120
    assert event.instance_hours == pytest.approx(3.0)            # 1.5 h x 2 instances
    assert event.accelerator_hours == pytest.approx(24.0)        # x 8 A100s
    assert event.estimated_cost_usd == pytest.approx(3.0 * 37.688)
    # An EC2 name (Batch) takes the ml. row; an unlisted type has no guessed figures.
    assert with_usage(JobEvent(event="ended", job_name="j", instance_type="p4d.24xlarge",
                               started_at=start, ended_at=start + 3600)).accelerator_hours == 8.0
    unknown = with_usage(JobEvent(event="ended", job_name="j", instance_type="ml.x9.huge",
                                  started_at=start, ended_at=start + 3600))
    assert unknown.instance_hours == 1.0 and unknown.accelerator_hours is None
    assert unknown.estimated_cost_usd is None


def test_a_sagemaker_job_on_moto_is_priced_by_its_instance_type(home, moto_server, monkeypatch):
    from tests.aws_fixtures import sagemaker_settings

    moto_server.bucket("llmops-test")
    monkeypatch.setenv("AIRFLOW_VAR_LLMOPS_BACKENDS",
                       json.dumps({"sagemaker": sagemaker_settings("llmops-test")}))
    op = JobOperator(task_id="pretrain", deferrable=False, poll_interval=0.1,
                     spec={"stage": "pretrain", "entrypoint": "tests.sample_job", "backend": "sagemaker",
                           "instance_type": "ml.g5.12xlarge", "instance_count": 2,
                           "tags": {"team": "vision"}})
    # moto completes the job at once and runs no container: SageMaker says Completed, no result.
    with pytest.raises(AirflowException, match="wrote no result"):
        run_try(op, FakeTI(), FakeStore())
    name = op._ledger_job["job_name"]
    described = moto_server.client("sagemaker").describe_training_job(
        TrainingJobName=op._ledger_job["service_job_name"])
    tags = {t["Key"]: t["Value"] for t in moto_server.client("sagemaker").list_tags(
        ResourceArn=described["TrainingJobArn"])["Tags"]}
    assert {k: tags[k] for k in ("dag_id", "run_id", "team", "stage")} == {
        "dag_id": "dag", "run_id": "manual__1", "team": "vision", "stage": "pretrain"}
    end = [r for r in rows_of(name) if r["event"] == "ended"][0]
    assert (end["instance_type"], end["instance_count"], end["accelerators_per_instance"],
            end["usd_per_instance_hour"]) == ("ml.g5.12xlarge", 2, 4, 7.09)
    assert end["image"] == sagemaker_settings("llmops-test")["image"]
    assert end["started_at"] == pytest.approx(described["TrainingStartTime"].timestamp())
    assert end["ended_at"] == pytest.approx(described["TrainingEndTime"].timestamp())
    hours = (end["ended_at"] - end["started_at"]) / 3600 * 2
    assert end["instance_hours"] == pytest.approx(hours)
    assert end["accelerator_hours"] == pytest.approx(hours * 4)
    assert end["estimated_cost_usd"] == pytest.approx(hours * 7.09)
    assert end["state"] == "failed" and "wrote no result" in end["failure_reason"]


def test_parquet_is_written_under_a_dt_partition_with_the_documented_schema(moto_s3, home, monkeypatch):
    import pyarrow.parquet as pq

    moto_s3.create_bucket(Bucket="ledger-bucket")
    monkeypatch.setenv("LLMOPS_STORAGE_ROOT", "s3://ledger-bucket/platform")
    monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", json.dumps({"conn_type": "aws", "extra": {
        "endpoint_url": moto_s3.meta.endpoint_url, "region_name": "us-east-1"}}))
    day = dt.datetime(2026, 11, 30, 12, tzinfo=dt.timezone.utc).timestamp()
    event = JobEvent(event="ended", job_name="pretrain-abc", recorded_at=day, team="research",
                     stage="pretrain", instance_type="ml.p5.48xlarge", started_at=day - 3600,
                     ended_at=day, state="succeeded", goodput=0.9)
    assert ledger.record(event)
    keys = [o["Key"] for o in moto_s3.list_objects_v2(Bucket="ledger-bucket")["Contents"]]
    assert keys == [f"platform/ledger/dt=2026-11-30/{event.event_id}.parquet"]
    body = moto_s3.get_object(Bucket="ledger-bucket", Key=keys[0])["Body"].read()
    import io

    table = pq.read_table(io.BytesIO(body))
    assert table.schema.equals(arrow_schema()) and tuple(table.schema.names) == FIELDS
    assert str(table.schema.field("ended_at").type) == "timestamp[ms, tz=UTC]"
    row = ledger.read_events(day - 10, day + 10)[0]   # read back from S3: the storage root is there
    assert row["accelerator_hours"] == pytest.approx(8.0) and row["ended_at"] == pytest.approx(day)
    assert ledger.spend_hours("research", day - 60) == pytest.approx(8.0)
    assert ledger.spend_hours("research", day + 60) == 0.0 and ledger.spend_hours("other", 0) == 0.0
    # The docstring's Athena table lists the same columns, in order.
    ddl = ledger.__doc__.split("CREATE EXTERNAL TABLE llmops_job_events (")[1].split(")")[0]
    assert tuple(c.split()[0] for c in ddl.replace("\n", " ").split(",")) == FIELDS


def test_a_ledger_that_cannot_be_written_never_fails_the_task(home, monkeypatch):
    monkeypatch.setattr(store, "sqlite_path", lambda: Path("/proc/no/such/ledger.db"))
    errors = ledger.write_errors
    result = run_try(sample_operator(), FakeTI(), FakeStore())
    assert result["metrics"] == {"answer": 42.0}
    assert ledger.write_errors == errors + 2    # submitted and ended, counted


def ended(job, team, stage, state="succeeded", hours=1.0, instance="ml.g5.2xlarge", count=1,
          reason="", queue=60.0, goodput=None, backend="sagemaker"):
    start = 1_780_000_000.0
    return with_usage(JobEvent(event="ended", job_name=job, team=team, stage=stage, state=state,
                               failure_reason=reason, instance_type=instance, instance_count=count,
                               backend=backend, service_job_name=f"{job}-a1",
                               submitted_at=start - queue, started_at=start,
                               ended_at=start + hours * 3600, goodput=goodput,
                               recorded_at=start + hours * 3600)).to_dict()


def test_the_report_builds_its_tables_and_plots_from_several_teams_and_states(home):
    events = [
        ended("pt-1", "research", "pretrain", hours=2, instance="ml.p4d.24xlarge", count=2, goodput=0.75),
        ended("pt-2", "research", "pretrain", state="failed", hours=0.5, instance="ml.p4d.24xlarge",
              count=2, reason="SageMaker job pt-2-a1 failed: AlgorithmError: NCCL timeout"),
        ended("pt-3", "research", "pretrain", state="failed", hours=0.25, instance="ml.p4d.24xlarge",
              count=2, reason="SageMaker job pt-3-a1 failed: AlgorithmError: NCCL timeout"),
        ended("ft-1", "vision", "finetune", hours=1, queue=300),
        ended("ft-2", "vision", "finetune", state="stopped", hours=0.5, queue=100,
              reason="stopped: the task was set to failed"),
        ended("dp-1", "vision", "data_prep", hours=0.1, instance="local", backend="local", queue=0),
    ]
    result = report.log_report(events, period_start="2026-11-29", period_end="2026-11-30")
    tables = result["tables"]
    usage = {(g["team"], g["stage"]): g for g in tables["usage_by_team_stage"]}
    assert usage[("research", "pretrain")]["accelerator_hours"] == pytest.approx((2 + 0.5 + 0.25) * 2 * 8)
    assert usage[("research", "pretrain")]["estimated_cost_usd"] == pytest.approx(2.75 * 2 * 37.688)
    assert usage[("vision", "finetune")]["accelerator_hours"] == pytest.approx(1.5)
    assert usage[("vision", "data_prep")]["estimated_cost_usd"] == 0.0
    failures = {(f["stage"], f["reason"]): f for f in tables["failures_by_reason"]}
    nccl = failures[("pretrain", "SageMaker job <job> failed: AlgorithmError: NCCL timeout")]
    assert nccl["attempts"] == 2 and nccl["rate"] == pytest.approx(2 / 3)
    assert failures[("finetune", "stopped: the task was set to failed")]["rate"] == 0.5
    (badput,) = tables["badput_by_team_stage"]
    assert (badput["team"], badput["badput_hours"]) == ("research", pytest.approx(0.5))
    queue = {(q["backend"], q["stage"]): q for q in tables["queue_by_backend_stage"]}
    assert queue[("sagemaker", "finetune")]["mean_s"] == 200 and queue[("sagemaker", "finetune")]["max_s"] == 300
    assert result["metrics"]["platform/failure_rate"] == pytest.approx(3 / 6)
    from llmops.infra import tracking

    client = tracking.client()
    run = client.get_run(result["run_id"])
    assert client.get_experiment(run.info.experiment_id).name == "llmops-platform"
    assert run.data.metrics["platform/accelerator_hours"] == pytest.approx(44 + 1.5)
    plots = {a.path for a in client.list_artifacts(result["run_id"], "plots")}
    assert plots == {f"plots/{p[0]}" for p in report.PLOTS.values()}
    local = Path(client.download_artifacts(result["run_id"], "plots/accelerator_hours_and_cost.png"))
    assert local.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and local.stat().st_size > 5000
    csv_text = Path(client.download_artifacts(result["run_id"], "tables/usage_by_team_stage.csv")).read_text()
    assert csv_text.splitlines()[1].startswith("research,pretrain,3,")


def test_the_report_dag_parses_and_reads_the_local_ledger(home):
    proc = subprocess.run([sys.executable, "-c", (
        "from airflow.dag_processing.dagbag import DagBag; import sys; "
        "bag = DagBag(dag_folder=sys.argv[1]); "
        "print(sorted(bag.dag_ids), bag.import_errors, bag.dags['llm_platform_report'].timetable.expression)"),
        str(ROOT / "dags" / "llm_platform_report.py")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "['llm_platform_report'] {} 0 1 * * *", proc.stdout
    ledger.record(JobEvent(**{k: v for k, v in ended("x-1", "research", "sweep").items()
                              if k not in ("recorded_at", "event_id")}))
    day = dt.datetime(2026, 5, 28, tzinfo=dt.timezone.utc)      # the day ended() jobs end
    out = report.daily(day, day + dt.timedelta(days=1))
    assert out["events"] == 1 and out["metrics"]["platform/attempts"] == 1.0


def test_an_attempt_that_never_started_records_all_its_time_as_queued():
    """Issue 21.3: a job stopped at max_queue_seconds (or cancelled while queued) waited too."""
    start = 1_780_000_000.0
    event = with_usage(JobEvent(event="ended", job_name="j", instance_type="ml.p4d.24xlarge",
                                submitted_at=start, started_at=None, ended_at=start + 3600,
                                state="stopped"))
    assert event.queue_seconds == 3600 and event.instance_hours == 0.0
    # A pending event knows no queue time yet.
    assert with_usage(JobEvent(event="submitted", job_name="j", submitted_at=start)).queue_seconds is None


def test_the_cost_is_the_services_billed_time_and_the_named_hosts_are_kept(home):
    """Issue 21.2: SageMaker's BillableTimeInSeconds (download and upload included, a managed spot
    discount applied) is what an attempt costs; issue 24.5: the hosts a job named stragglers or
    caught computing wrong results are on its `ended` row, for a platform to query."""
    from llmops.jobs.backends import JobState, JobStatus

    start = 1_780_000_000.0
    status = JobStatus(JobState.SUCCEEDED, details={"started_at": start, "ended_at": start + 3600,
                                                    "billed_seconds": 1200.0},
                       result={"metrics": {"goodput": 0.9}, "health": {
                           "stragglers": [{"step": 40, "rank": 3, "host": "ip-10-0-0-7"},
                                          {"step": 80, "rank": 3, "host": "ip-10-0-0-7"}],
                           "sdc_mismatches": [{"step": 60, "ranks": [1, 2], "hosts": ["ip-a", "ip-b"]}]}})
    fields = ledger.end_fields(status, None)
    assert fields["straggler_hosts"] == "ip-10-0-0-7 (rank 3)"   # named twice, listed once
    assert fields["sdc_hosts"] == "ip-a (rank 1), ip-b (rank 2)"
    ledger.record_job("ended", {"job_name": "spot-job", "instance_type": "ml.p4d.24xlarge",
                                "instance_count": 2}, **fields)
    row = rows_of("spot-job")[0]
    assert row["instance_hours"] == pytest.approx(2.0)              # it ran an hour on 2 instances
    assert row["billed_seconds"] == 1200.0
    assert row["estimated_cost_usd"] == pytest.approx(1200 / 3600 * 2 * 37.688)   # billed, not run
    assert row["straggler_hosts"] == "ip-10-0-0-7 (rank 3)"
    # Without a billed time from the service, the running time is charged.
    plain = with_usage(JobEvent(event="ended", job_name="j", instance_type="ml.p4d.24xlarge",
                                started_at=start, ended_at=start + 3600))
    assert plain.billed_seconds is None and plain.estimated_cost_usd == pytest.approx(37.688)


def test_a_ledger_from_an_earlier_release_gets_the_new_columns_and_keeps_its_rows(home):
    import sqlite3

    path = store.sqlite_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    old = [f for f in FIELDS if f not in ("billed_seconds", "straggler_hosts", "sdc_hosts")]
    with sqlite3.connect(path) as conn:
        conn.execute(f"CREATE TABLE job_events ({', '.join(old)})")
        conn.execute("INSERT INTO job_events (event, job_name, event_id, recorded_at) VALUES "
                     "('submitted', 'old-job', 'e1', 1780000000.0)")
    ledger.record_job("ended", {"job_name": "new-job"}, state="succeeded", billed_seconds=5.0)
    assert [r["event"] for r in rows_of("old-job")] == ["submitted"]
    assert rows_of("new-job")[0]["billed_seconds"] == 5.0
