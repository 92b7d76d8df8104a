"""A stage's run is longer than any one job: when a job ends for MaxRuntime, a capacity error, a
spot reclaim, a lost host or a service-side internal error, the operator submits the next attempt
inside the same task try (from the newest checkpoint: tests/test_multinode_no_shared_disk.py shows
the restore), with a backoff for capacity errors, until max_attempts or the run deadline; every
other end fails the try as before. Each attempt is a ledger row.

The backend is scripted (tests/test_wait_faults.py's ScriptedBackend: each submit is the next
attempt, status answers from a script); the operator's wait and its deferrals run for real.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
from airflow.sdk.exceptions import TaskDeferred

import llmops.airflow.operators.job_operator as job_op
from llmops.jobs import continuation
from llmops.jobs.backends import JobState, JobStatus
from tests.test_wait_faults import (RUNNING, SUCCEEDED, Clock, FakeStore, FakeTI, ScriptedBackend, context,
                                    operator, use_backend)  # noqa: F401 - fixtures

MAX_RUNTIME = JobStatus(JobState.STOPPED, "SageMaker job pretrain-1 was stopped: MaxRuntimeExceeded: "
                        "Training job exceeded MaxRuntimeInSeconds provided",
                        details={"secondary": "MaxRuntimeExceeded"})
CAPACITY = JobStatus(JobState.FAILED, "SageMaker job pretrain-1-r2 failed: CapacityError: Unable to "
                     "provision requested ML compute capacity. Please retry using a different ML "
                     "instance type.")
HOST = JobStatus(JobState.FAILED, "Batch job pretrain-1 failed",
                 details={"reason": "Host EC2 (instance i-0fa4e00000000000) terminated."})
BUG = JobStatus(JobState.FAILED, "SageMaker job pretrain-1 failed: AlgorithmError: exit code 1: "
                "ZeroDivisionError")
CONSOLE_STOP = JobStatus(JobState.STOPPED, "SageMaker job pretrain-1 was stopped: Stopped",
                         details={"secondary": "Stopped"})


class Attempts(ScriptedBackend):
    """Each submit starts the next attempt; each attempt answers from its own script."""

    def __init__(self, scripts: list[list]):
        super().__init__([RUNNING])
        self.scripts = scripts

    def submit(self, spec):
        handle = super().submit(spec)
        self.statuses = list(self.scripts[min(self.submits, len(self.scripts)) - 1])
        return {**handle, "attempt": self.submits, "job_name": f"{spec.name}-r{self.submits}"}


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr("time.time", c.time)
    monkeypatch.setattr("time.sleep", c.sleep)
    return c


@pytest.fixture
def ledger_rows(monkeypatch):
    rows: list[tuple[str, dict]] = []
    monkeypatch.setattr(job_op.ledger, "record_job",
                        lambda event, job, **fields: rows.append((event, {**job, **fields})) or True)
    return rows


@pytest.fixture(autouse=True)
def no_mlflow(monkeypatch):
    monkeypatch.setattr(job_op.tracking, "end_run", lambda run_id, status: None)


@pytest.mark.parametrize("status, why", [(MAX_RUNTIME, "max_runtime"), (CAPACITY, "capacity"),
                                         (HOST, "host"), (BUG, None), (CONSOLE_STOP, None),
                                         (SUCCEEDED, None)])
def test_only_ends_the_next_attempt_fixes_are_continued(status, why):
    assert continuation.reason(status) == why


def test_max_runtime_three_times_then_capacity_then_done_in_one_try(use_backend, clock, ledger_rows):
    backend = use_backend(Attempts([[RUNNING, MAX_RUNTIME]] * 3 + [[CAPACITY], [RUNNING, SUCCEEDED]]))
    op = operator()
    result = op.execute(context(store=FakeStore()))
    assert result["metrics"] == {"answer": 42}
    assert backend.submits == 5 and backend.stops == []
    # one capacity wait of 60 s, nothing else slept but the polls
    assert [s for s in clock.sleeps if s != 30.0] == [60.0]
    ended = [(row["attempt"], row["state"]) for event, row in ledger_rows if event == "ended"]
    assert ended == [(1, "stopped"), (2, "stopped"), (3, "stopped"), (4, "failed"), (5, "succeeded")]
    started = [event for event, _ in ledger_rows if event != "ended"]
    assert started == ["submitted", "continued", "continued", "continued", "continued"]
    warnings = op.log.warnings()
    assert sum("goes on from the newest checkpoint" in w for w in warnings) == 4
    assert any("Attempt 4" in w and "capacity" in w and "in 60 s" in w for w in warnings)


def test_a_job_that_fails_on_its_own_fails_the_try_without_another_attempt(use_backend, clock,
                                                                          ledger_rows):
    backend = use_backend(Attempts([[RUNNING, BUG]]))
    with pytest.raises(job_op.AirflowException, match="ZeroDivisionError"):
        operator().execute(context(store=FakeStore()))
    assert backend.submits == 1


def test_the_chain_stops_at_max_attempts(use_backend, clock, ledger_rows):
    backend = use_backend(Attempts([[RUNNING, MAX_RUNTIME]]))
    op = operator(max_attempts=3)
    with pytest.raises(job_op.AirflowException, match="MaxRuntimeExceeded"):
        op.execute(context(store=FakeStore()))
    assert backend.submits == 3
    assert any("max_attempts 3" in m for level, m in op.log.records if level == "error")


def test_the_chain_stops_at_the_run_deadline(use_backend, clock, ledger_rows):
    # each attempt runs 30 s of polls then hits MaxRuntime; the run may last 0.02 h = 72 s
    backend = use_backend(Attempts([[RUNNING, MAX_RUNTIME]]))
    op = operator(run_deadline_hours=0.02)
    with pytest.raises(job_op.AirflowException):
        op.execute(context(store=FakeStore()))
    assert backend.submits == 3
    assert any("run deadline" in m for level, m in op.log.records if level == "error")


def test_deferred_the_chain_goes_on_through_the_trigger_and_a_deferred_backoff(use_backend, clock,
                                                                               ledger_rows):
    backend = use_backend(Attempts([[MAX_RUNTIME], [CAPACITY], [SUCCEEDED]]))
    op = operator(deferrable=True)
    store = FakeStore()
    with pytest.raises(TaskDeferred) as first:
        op.execute(context(store=store))
    chain = first.value.trigger.context["chain"]
    assert chain["attempts"] == 1
    # the trigger saw attempt 1 end: the task resumes and submits attempt 2 (deferred again)
    with pytest.raises(TaskDeferred) as second:
        op.execute_complete(context(store=store), {**first.value.trigger.context, "state": "stopped",
                                                   "handle": op._handle, "message": "stopped"})
    assert backend.submits == 2 and second.value.trigger.context["chain"]["attempts"] == 2
    # Airflow opens the try's trigger log part anew at this second deferral, so what attempt 1's
    # trigger showed is gone from the task log: its last lines are quoted in the worker's part.
    quoted = [m for _, m in op.log.records if m.startswith("attempt 1 | ")]
    assert quoted and len(quoted) <= job_op.LOG_TAIL_LINES
    assert quoted[-1] == "attempt 1 | " + backend.all_lines[backend.visible - 1]
    # attempt 2 hits a capacity error: a 60 s backoff, deferred (no worker slot held)
    with pytest.raises(TaskDeferred) as backoff:
        op.execute_complete(context(store=store), {**second.value.trigger.context, "state": "failed",
                                                   "handle": op._handle, "message": "failed"})
    assert backoff.value.method_name == "execute_continue" and backend.submits == 2
    wakes_in = (backoff.value.trigger.moment - datetime.now(timezone.utc)).total_seconds()
    assert 50 < wakes_in <= 60, wakes_in
    with pytest.raises(TaskDeferred) as third:
        op.execute_continue(context(store=store), None, **backoff.value.kwargs)
    assert backend.submits == 3 and third.value.trigger.context["chain"]["attempts"] == 3
    result = op.execute_complete(context(store=store), {**third.value.trigger.context,
                                                        "state": "succeeded", "handle": op._handle})
    assert result["metrics"] == {"answer": 42}


class XComTI(FakeTI):
    def __init__(self):
        super().__init__()
        self.xcoms: dict[str, object] = {}

    def xcom_push(self, key, value):
        self.xcoms[key] = value


def test_the_wait_and_the_attempts_reach_the_run_page_and_the_note(use_backend, clock, ledger_rows):
    """Issue 48: a chain of attempts and a wait for capacity were in the task log only. Each wait
    (the service's words) and each attempt that ended (why) is tagged on the stage's MLflow run,
    which the run page reads, and the attempts are the task's XCom, which the run's note quotes.
    The backend is scripted (each attempt first queued for capacity, the first one's host lost);
    the operator, MLflow, the summary and the page are real."""
    from llmops.airflow import run_note, run_page
    from llmops.infra import tracking
    from llmops.stages import run_summary

    client = tracking.client()
    experiment = tracking.ensure_experiment("llm_lifecycle")
    dag_run = f"manual__chain_{clock.now:.0f}"
    parent = tracking.start_parent_run(experiment="llm_lifecycle", dag_id="llm_lifecycle",
                                       run_id=dag_run, config={}, tags={"recipe": "tiny"})
    child = tracking.start_child_run(experiment="llm_lifecycle", parent_run_id=parent, stage="pretrain",
                                     tags={}, identity={"dag_id": "llm_lifecycle", "run_id": dag_run,
                                                        "task_id": "pretrain", "map_index": "-1"})
    queued = JobStatus(JobState.PENDING, "Starting: Insufficient capacity error from EC2 while "
                                         "launching instances, retrying!")
    use_backend(Attempts([[queued, RUNNING, HOST], [queued, queued, RUNNING, SUCCEEDED]]))
    op = operator()
    op.spec["env"] = {"MLFLOW_RUN_ID": child}
    ti = XComTI()
    assert op.execute(context(ti=ti, store=FakeStore()))["metrics"] == {"answer": 42}

    tags = client.get_run(child).data.tags
    (attempt,) = json.loads(tags[tracking.ATTEMPTS_TAG])
    assert (attempt["attempt"], attempt["why"], attempt["state"]) == (1, "host", "failed")
    assert "Host EC2 (instance i-0fa4e00000000000) terminated" in attempt["message"]
    assert ti.xcoms[tracking.ATTEMPTS_XCOM] == [attempt]
    # attempt 2 waited two polls (60 s of this test's clock) before it started
    assert tags[tracking.WAITING_TAG] == "" and float(tags[tracking.QUEUED_TAG]) == 60.0

    summary = run_summary.collect("llm_lifecycle", dag_run, now_ms=int(clock.now * 1000))
    (stage,) = summary["stages"]
    assert stage["attempts"] == [attempt] and stage["waiting"]["queued_s"] == 60.0
    html = run_page.render(summary, {"state": "running", "note": None, "failure": None, "refusal": None})
    assert "pretrain: a chain of 2 attempts" in html and "ended by <b>host</b>" in html
    assert "queued" in html and 'data-key="stage.pretrain.queued_s" data-value="60.0"' in html
    assert "pretrain: 2 attempts (host, then running)" in run_summary.note_line(summary)
    line = run_note.Failure(task="pretrain", try_number=1, attempts=ti.xcoms[tracking.ATTEMPTS_XCOM]).line()
    assert line.startswith("failed at pretrain after 1 attempt: 1 ended by host (Batch job pretrain-1 "
                           "failed"), line
