"""The wait for a remote job against everything AWS and Airflow do around it: throttled and failed
API calls, queueing, deadlines, SIGTERM, task timeouts, triggerer restarts, clears and reruns.

A scripted in-test backend raises the errors botocore lets through after its own retries; the
operator's wait and the trigger run for real on it, with sleeps recorded instead of slept.
"""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

import llmops.airflow.operators.job_operator as job_op
import llmops.airflow.triggers.job_trigger as job_trigger
from llmops.airflow.operators.job_operator import JobOperator, job_identity
from llmops.jobs.backends import Backend, JobState, JobStatus
from llmops.jobs.errors import Backoff, is_transient
from llmops.jobs.spec import JobSpec
from llmops.jobs.watch import JobWatch

RUNNING, PENDING = JobStatus(JobState.RUNNING), JobStatus(JobState.PENDING)
SUCCEEDED = JobStatus(JobState.SUCCEEDED, result={"metrics": {"answer": 42}})
FAILED = JobStatus(JobState.FAILED, "the job exited with code 5")


def client_error(code: str, status: int = 400, op: str = "DescribeTrainingJob") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, op)


def throttled() -> ClientError:
    return client_error("ThrottlingException")


def unavailable() -> ClientError:
    return client_error("ServiceUnavailable", 503)


class ScriptedBackend(Backend):
    """status() answers from a script (a JobStatus, or an exception to raise), repeating the last
    entry; every status call makes two more log lines visible. read_logs raises from its own
    script of errors (None = answer)."""

    name = "fake"
    poll_interval = 30.0

    def __init__(self, statuses: list, log_errors: list | None = None, lines: int = 20):
        self.statuses = list(statuses)
        self.log_errors = list(log_errors or [])
        self.all_lines = [f"line-{i}" for i in range(lines)]
        self.visible = 0
        self.status_calls = self.submits = 0
        self.stops: list[str] = []
        self.log_cursors: list[Any] = []
        self.tails: list[int] = []
        self.stop_errors: list = []

    def submit(self, spec: JobSpec) -> dict[str, Any]:
        self.submits += 1
        return {"backend": self.name, "name": spec.name, "reattached": False}

    def status(self, handle: dict[str, Any]) -> JobStatus:
        self.status_calls += 1
        self.visible = min(len(self.all_lines), self.visible + 2)
        if self.stops:
            return JobStatus(JobState.STOPPED, "stopped")
        item = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        if isinstance(item, BaseException):
            raise item
        return item

    def read_logs(self, handle: dict[str, Any], cursor: Any = None) -> tuple[list[str], Any]:
        self.log_cursors.append(cursor)
        if self.log_errors:
            error = self.log_errors.pop(0)
            if error is not None:
                raise error
        start = int(cursor or 0)
        end = max(start, self.visible)
        return self.all_lines[start:end], end

    def stop(self, handle: dict[str, Any]) -> None:
        if self.stop_errors:
            raise self.stop_errors.pop(0)
        self.stops.append(handle["name"])

    def log_tail(self, handle: dict[str, Any], lines: int = 40) -> list[str]:
        self.tails.append(lines)
        return self.all_lines[:self.visible][-lines:]


class FakeTI:
    def __init__(self, try_number: int = 1, max_tries: int = 0, map_index: int = -1):
        self.dag_id, self.run_id, self.task_id = "dag", "manual__1", "pretrain"
        self.map_index, self.try_number, self.max_tries = map_index, try_number, max_tries


class FakeStore:
    """Airflow 3.3's task state store, as the task sees it (a dict per task instance)."""

    def __init__(self):
        self.data: dict[str, Any] = {}

    def get(self, key, default=None):
        return self.data.get(key, default)

    def set(self, key, value, *, retention=None):
        assert value is not None
        self.data[key] = value


class Clock:
    """time.time, time.sleep and asyncio.sleep in one: sleeping moves the clock on."""

    def __init__(self, now: float = 1_000_000.0):
        self.now = now
        self.sleeps: list[float] = []

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr("time.time", c.time)
    monkeypatch.setattr("time.sleep", c.sleep)
    monkeypatch.setattr(job_trigger.asyncio, "sleep", c.asleep)
    return c


@pytest.fixture
def use_backend(monkeypatch):
    def install(backend: Backend) -> Backend:
        monkeypatch.setattr(job_op, "get_backend", lambda name: backend)
        monkeypatch.setattr(job_trigger, "get_backend", lambda name: backend)
        return backend
    return install


@pytest.fixture
def runs_ended(monkeypatch):
    ended: list[tuple[str, str]] = []
    monkeypatch.setattr(job_op.tracking, "end_run", lambda run_id, status: ended.append((run_id, status)))
    return ended


def operator(backend: str = "sagemaker", max_run: int = 3600, **kwargs) -> JobOperator:
    kwargs.setdefault("deferrable", False)
    op = JobOperator(task_id="pretrain", spec={"stage": "pretrain", "entrypoint": "tasks.pretrain",
                                              "backend": backend, "image": "img:1",
                                              "instance_type": "ml.p5.48xlarge",
                                              "max_run_seconds": max_run}, **kwargs)
    op._cached_logger = Recorder()
    return op


def context(ti: FakeTI | None = None, store: FakeStore | None = None, **params) -> dict[str, Any]:
    return {"ti": ti or FakeTI(), "params": params, "task_state_store": store}


class Recorder:
    """Stands in for the structlog logger of an operator or trigger: keeps (level, message)."""

    def __init__(self):
        self.records: list[tuple[str, str]] = []

    def _add(self, level: str, msg: str, *args: Any, **_: Any) -> None:
        self.records.append((level, msg % args if args else msg))

    def debug(self, *a, **k): self._add("debug", *a, **k)  # noqa: E704
    def info(self, *a, **k): self._add("info", *a, **k)  # noqa: E704
    def warning(self, *a, **k): self._add("warning", *a, **k)  # noqa: E704
    def error(self, *a, **k): self._add("error", *a, **k)  # noqa: E704
    def exception(self, *a, **k): self._add("error", *a, **k)  # noqa: E704

    def warnings(self) -> list[str]:
        return [m for level, m in self.records if level == "warning"]


def job_lines(log: Recorder) -> list[str]:
    """The job's log lines as they reached the task log."""
    return [m.split("] ", 1)[1] for _, m in log.records if "] line-" in m]


# -- what is transient ----------------------------------------------------------------------------

@pytest.mark.parametrize("exc", [
    throttled(), client_error("Throttling"), client_error("TooManyRequestsException"),
    client_error("RequestLimitExceeded"), client_error("SlowDown", 503),
    client_error("LimitExceededException"), client_error("ProvisionedThroughputExceededException"),
    unavailable(), client_error("InternalFailure", 500), client_error("Whatever", 429),
    EndpointConnectionError(endpoint_url="https://api.sagemaker.us-east-1.amazonaws.com"),
    ReadTimeoutError(endpoint_url="https://logs"), ConnectionResetError(errno.ECONNRESET, "reset"),
    TimeoutError("timed out"), OSError(errno.EHOSTUNREACH, "no route"),
], ids=lambda e: type(e).__name__ + ":" + (e.response["Error"]["Code"] if isinstance(e, ClientError) else ""))
def test_throttling_5xx_and_dropped_connections_are_transient(exc):
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [
    client_error("AccessDeniedException", 403), client_error("ValidationException"),
    client_error("ResourceNotFound", 404), PermissionError("denied"), ValueError("bug"),
    KeyError("TrainingJobStatus"),
])
def test_real_answers_are_not_transient(exc):
    assert not is_transient(exc)


def test_kubernetes_and_requests_errors_are_classified_by_status():
    from kubernetes.client.exceptions import ApiException
    import requests

    assert is_transient(ApiException(status=429)) and is_transient(ApiException(status=0))
    assert is_transient(ApiException(status=503)) and not is_transient(ApiException(status=403))
    # client 36 raises a subclass per status: a 5xx is ServiceException, and is as transient
    from kubernetes.client.exceptions import ForbiddenException, NotFoundException, ServiceException

    assert is_transient(ServiceException(status=503)) and is_transient(ServiceException(status=500))
    assert not is_transient(NotFoundException(status=404)) and not is_transient(ForbiddenException(status=403))
    assert is_transient(requests.exceptions.ConnectionError("refused"))
    response = requests.Response()
    response.status_code = 404
    assert not is_transient(requests.exceptions.HTTPError(response=response))


def test_backoff_is_exponential_full_jitter_and_capped():
    assert [Backoff(rand=lambda: 1.0, attempt=n).next_delay() for n in range(10)] == \
        [2, 4, 8, 16, 32, 64, 128, 256, 300, 300]
    assert Backoff(rand=lambda: 0.0).next_delay() == 0


# -- the worker wait ------------------------------------------------------------------------------

def test_api_hiccups_neither_stop_the_job_nor_fail_the_wait(use_backend, clock):
    """Issue 10.1: one throttled DescribeTrainingJob stopped a healthy multi-day job."""
    backend = use_backend(ScriptedBackend(
        [RUNNING, throttled(), unavailable(), EndpointConnectionError(endpoint_url="https://x"),
         ConnectionResetError("reset"), RUNNING, SUCCEEDED],
        log_errors=[None, client_error("ThrottlingException", op="GetLogEvents"), None,
                    ReadTimeoutError(endpoint_url="https://logs")]))
    op = operator(poll_interval=30)
    result = op.execute(context())
    assert result["metrics"] == {"answer": 42}
    assert backend.stops == [] and backend.submits == 1
    # Four retries: each waits the poll interval plus a jittered backoff, never beyond the cap.
    assert len(clock.sleeps) == 6 and all(30 <= s <= 30 + 300 for s in clock.sleeps)
    warnings = op.log.warnings()
    assert sum("could not read the job's status" in w for w in warnings) == 4
    assert any("ThrottlingException" in w for w in warnings)
    assert any("could not read the job's log" in w for w in warnings)
    # A failed log read keeps its cursor: every line is shown, once, in order.
    assert job_lines(op.log) == backend.all_lines[:backend.visible]


def test_an_outage_while_a_retried_try_finds_its_job_is_waited_out_not_a_failed_try(use_backend, clock):
    """The fault matrix's 10-minute read outage: a try whose earlier try died before recording
    its job finds it through submit (a reattach by name), whose reads answered 503; that try
    failed, the task ran out of tries and the job it had started succeeded unseen."""
    backend = use_backend(ScriptedBackend([RUNNING, SUCCEEDED]))
    outage = [unavailable(), unavailable(), throttled()]
    plain_submit = backend.submit

    def submit(spec: JobSpec) -> dict[str, Any]:
        if outage:
            backend.submits += 1
            raise outage.pop(0)
        return plain_submit(spec)

    backend.submit = submit
    op = operator(poll_interval=30)
    assert op.execute(context(FakeTI(try_number=2, max_tries=2)))["metrics"] == {"answer": 42}
    assert backend.submits == 4 and backend.stops == []
    assert sum("submit or find job" in w for w in op.log.warnings()) == 3


def test_a_non_transient_status_error_fails_the_task_but_leaves_the_job_running(use_backend, clock,
                                                                               runs_ended):
    backend = use_backend(ScriptedBackend([RUNNING, client_error("AccessDeniedException", 403)]))
    op = operator()
    with pytest.raises(job_op.AirflowException, match="AccessDenied.*was not stopped"):
        op.execute(context())
    assert backend.stops == [] and runs_ended == []
    op.on_kill()  # Airflow does not call it for a plain failure; even so nothing is stopped
    assert backend.stops == []


def test_the_deadline_counts_from_the_start_not_from_submission(use_backend, clock):
    """Issue 10.3: queued for longer than max_run_seconds is no reason to stop a job."""
    max_run, grace = 600, 120
    started = clock.now + 5000  # queued 5000 s > max_run + grace
    statuses = [PENDING] * 100 + [JobStatus(JobState.RUNNING, details={"started_at": started})]
    backend = use_backend(ScriptedBackend(statuses))
    real_status = backend.status

    def status(handle):  # the service reports the start once the clock gets there
        s = real_status(handle)
        return s if s.state is not JobState.PENDING or clock.now < started else statuses[-1]
    backend.status = status
    op = operator(max_run=max_run, poll_interval=60, deadline_grace_seconds=grace)
    with pytest.raises(job_op.AirflowException, match=r"max_run_seconds \(600s\) plus a grace of 120s"):
        op.execute(context())
    assert backend.stops == [op._handle["name"]]  # once, and only after the grace
    assert started + max_run + grace < clock.now <= started + max_run + grace + 60


def test_grace_comes_from_the_operator_then_the_handle_then_the_default():
    op = operator()
    op._handle = {"backend": "sagemaker", "name": "j"}
    assert op._grace_seconds() == job_op.DEFAULT_GRACE_SECONDS == 1800
    op._handle["deadline_grace_seconds"] = 900           # the backend's settings
    assert op._grace_seconds() == 900
    assert operator(deadline_grace_seconds=60)._grace_seconds() == 60
    local = operator(backend="local")
    local._handle = {"backend": "local", "name": "j"}
    assert local._grace_seconds() == 0                   # local jobs have no other limit


def test_a_backend_that_reports_no_start_gets_the_first_running_poll_as_its_start(clock):
    backend = ScriptedBackend([PENDING, PENDING, RUNNING])
    watch = JobWatch(backend, {"backend": "fake", "name": "j"}, poll_interval=10,
                     max_run_seconds=100, grace_seconds=0)
    assert [watch.poll().started for _ in range(3)] == [False, False, True]
    assert watch.started_at == clock.now and watch.deadline == clock.now + 100


def test_poll_interval_comes_from_the_operator_then_the_handle_then_the_backend():
    from llmops.jobs.backends.local.local_backend import LocalBackend

    backend = ScriptedBackend([RUNNING])
    op = operator()
    op._handle = {"backend": "fake", "name": "j"}
    assert op._poll_interval(backend) == 30.0
    op._handle["poll_interval"] = 45
    assert op._poll_interval(backend) == 45.0
    assert operator(poll_interval=5)._poll_interval(backend) == 5.0
    assert LocalBackend.poll_interval == 2.0 and Backend.poll_interval == 30.0


def test_the_failure_message_shows_the_log_tail(use_backend, clock):
    backend = use_backend(ScriptedBackend([RUNNING, RUNNING, FAILED], lines=100))
    with pytest.raises(job_op.AirflowException, match="exited with code 5") as err:
        operator().execute(context())
    assert backend.tails == [40]  # not a read of the whole log from its start
    assert backend.log_cursors[1:] == sorted(backend.log_cursors[1:])
    assert str(err.value).endswith("line-5")


def test_log_tail_default_reads_the_last_lines():
    backend = ScriptedBackend([RUNNING], lines=50)
    backend.visible = 50
    assert Backend.log_tail(backend, {"name": "j"}, lines=3) == ["line-47", "line-48", "line-49"]
    assert Backend.fingerprint(backend, JobSpec(stage="s", entrypoint="m")) == ""


# -- SIGTERM, mark failed, task timeout -----------------------------------------------------------

def sigterm_case(monkeypatch, backend_name: str, state: Any) -> tuple[JobOperator, ScriptedBackend]:
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    def get_task_states(**query):
        if isinstance(state, Exception):
            raise state
        assert query == {"dag_id": "dag", "task_ids": ["pretrain"], "run_ids": ["manual__1"],
                         "map_index": -1}
        return {"manual__1": {"pretrain": state}}

    monkeypatch.setattr(RuntimeTaskInstance, "get_task_states", staticmethod(get_task_states))
    backend = ScriptedBackend([RUNNING])
    monkeypatch.setattr(job_op, "get_backend", lambda name: backend)
    op = operator(backend=backend_name)
    op._handle, op._ti, op._run_id = {"backend": backend_name, "name": "job-1"}, FakeTI(), "run-1"
    return op, backend


@pytest.mark.parametrize("state", ["running", "up_for_retry", RuntimeError("API server down")])
def test_sigterm_while_the_task_still_runs_in_airflow_leaves_the_remote_job_running(
        monkeypatch, runs_ended, state):
    """Worker replacement or a lost heartbeat: the next try reattaches, nothing is lost."""
    op, backend = sigterm_case(monkeypatch, "sagemaker", state)
    op.on_kill()
    assert backend.stops == [] and runs_ended == []


@pytest.mark.parametrize("state", ["failed", "success"])
def test_a_user_ending_the_task_stops_the_job(monkeypatch, runs_ended, state):
    op, backend = sigterm_case(monkeypatch, "sagemaker", state)
    op.on_kill()
    op.on_kill()  # Airflow may call it twice (SIGTERM, then after the exception)
    assert backend.stops == ["job-1"] and runs_ended == [("run-1", "KILLED")]


@pytest.mark.parametrize("state", ["restarting", None])
def test_a_clear_leaves_the_job_running_for_the_next_try_unless_force_rerun(monkeypatch, runs_ended,
                                                                           state):
    """A cleared task's next try reattaches to the running job; stopping it (and submitting
    `-r2`) would throw away its progress. With force_rerun the next try starts a fresh job, so
    the old one is stopped rather than left unwatched."""
    op, backend = sigterm_case(monkeypatch, "sagemaker", state)
    op.on_kill()
    assert backend.stops == [] and runs_ended == []
    op._forced = True
    op.on_kill()
    assert backend.stops == ["job-1"] and runs_ended == [("run-1", "KILLED")]


def test_local_jobs_stop_with_the_task_they_run_beside(monkeypatch, runs_ended):
    op, backend = sigterm_case(monkeypatch, "local", "running")
    op.on_kill()
    assert backend.stops == ["job-1"]


def test_the_task_execution_timeout_stops_the_job(use_backend, clock, runs_ended):
    backend = use_backend(ScriptedBackend([RUNNING, RUNNING, job_op.AirflowTaskTimeout()]))
    backend.stop_errors = [throttled()]  # even a throttled stop is retried
    op = operator()
    with pytest.raises(job_op.AirflowTaskTimeout):
        op.execute(context())
    op.on_kill()  # the task runner calls it after the timeout: the job is not stopped twice
    assert backend.stops == [op._handle["name"]]


# -- deferral -------------------------------------------------------------------------------------

def test_remote_jobs_defer_by_default_and_local_ones_wait_in_the_worker(monkeypatch):
    spec = lambda backend: JobSpec(stage="s", entrypoint="m", backend=backend)  # noqa: E731
    op = operator(deferrable=None)
    assert op._defers(spec("sagemaker")) and op._defers(spec("batch")) and op._defers(spec("hyperpod"))
    assert not op._defers(spec("local"))
    assert operator(deferrable=True)._defers(spec("local"))
    assert not operator(deferrable=False)._defers(spec("sagemaker"))
    monkeypatch.setenv("AIRFLOW__LLMOPS__DEFER_REMOTE_JOBS", "False")
    assert not op._defers(spec("sagemaker"))


def test_execute_defers_with_the_watch_settings_and_records_the_job(use_backend, clock):
    from airflow.sdk.exceptions import TaskDeferred

    backend = use_backend(ScriptedBackend([RUNNING]))
    store = FakeStore()
    op = operator(deferrable=None, execution_timeout=timedelta(hours=2))
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context(store=store))
    trigger = deferred.value.trigger
    _, kwargs = trigger.serialize()
    assert kwargs["max_run_seconds"] == 3600 and kwargs["grace_seconds"] == 1800
    assert kwargs["poll_interval"] == 30.0 and kwargs["task_deadline"] == clock.now + 7200
    assert store.data["llmops_job"]["handle"] == kwargs["handle"] == op._handle
    assert backend.status_calls == 0


# -- the trigger ----------------------------------------------------------------------------------

def run_trigger(trigger, max_events: int = 1) -> list[dict]:
    async def collect():
        events = []
        async for event in trigger.run():
            events.append(event.payload)
            if len(events) >= max_events:
                break
        return events
    return asyncio.run(collect())


def trigger(**kwargs) -> job_trigger.JobTrigger:
    kwargs.setdefault("handle", {"backend": "fake", "name": "job-1"})
    kwargs.setdefault("context", {"stage": "pretrain", "mlflow_run_id": "run-1", "parent_run_id": ""})
    return job_trigger.JobTrigger(**{"poll_interval": 30.0, "max_run_seconds": 3600,
                                     "grace_seconds": 1800, **kwargs})


def task_trigger(**kwargs) -> job_trigger.JobTrigger:
    """A trigger as the triggerer runs it: the triggerer sets its task instance (whose state it
    asks) on every trigger; and a log to read back."""
    running = trigger(**kwargs)
    running.task_instance = FakeTI()
    running._log = Recorder()
    return running


def test_the_trigger_survives_api_hiccups(use_backend, clock):
    backend = use_backend(ScriptedBackend([PENDING, throttled(), unavailable(),
                                           ConnectionResetError("reset"), SUCCEEDED],
                                          log_errors=[throttled()]))
    [event] = run_trigger(trigger())
    assert event["state"] == "succeeded" and backend.stops == []
    assert len(clock.sleeps) == 4 and all(30 <= s <= 330 for s in clock.sleeps)


def test_the_trigger_reports_a_non_transient_error_without_stopping(use_backend, clock):
    backend = use_backend(ScriptedBackend([PENDING, client_error("AccessDeniedException", 403)]))
    [event] = run_trigger(trigger())
    assert event["state"] == "error" and "AccessDenied" in event["message"]
    assert backend.stops == []


def test_the_trigger_deadline_counts_from_the_start_it_carries(use_backend, clock):
    started = clock.now - 3600 - 1700  # 100 s of grace left
    backend = use_backend(ScriptedBackend([RUNNING]))
    [event] = run_trigger(trigger(started_at=started))
    assert event["state"] == "timeout" and backend.stops == ["job-1"]
    assert clock.now - (started + 3600 + 1800) <= 30


def test_a_queued_job_has_no_deadline_in_the_trigger(use_backend, clock):
    backend = use_backend(ScriptedBackend([PENDING] * 500 + [SUCCEEDED]))
    [event] = run_trigger(trigger(max_run_seconds=60, grace_seconds=0))
    assert event["state"] == "succeeded" and backend.stops == [] and clock.sleeps.count(30.0) >= 499


def test_the_trigger_checkpoints_and_a_restart_does_not_repeat_lines(use_backend, clock, monkeypatch):
    """Issue 10.4: a triggerer restart replayed the whole log."""
    started = clock.now + 60
    backend = use_backend(ScriptedBackend(
        [PENDING, PENDING] + [JobStatus(JobState.RUNNING, details={"started_at": started})] * 30
        + [SUCCEEDED], lines=200))
    monkeypatch.setattr(job_trigger, "CHECKPOINT_SECONDS", 0)  # checkpoint whenever lines came in
    log = Recorder()
    payload, cursors, starts = {"state": "progress", "trigger": trigger()._kwargs()}, [], []
    while payload["state"] == "progress":
        # What the triggerer keeps, and a restarted one rebuilds the trigger from: the kwargs of
        # the last checkpoint, which the task deferred again with.
        classpath, kwargs = job_trigger.JobTrigger(**payload["trigger"]).serialize()
        assert classpath == "llmops.airflow.triggers.job_trigger.JobTrigger"
        cursors.append(kwargs["log_cursor"])
        starts.append(kwargs["started_at"])
        resumed = job_trigger.JobTrigger(**kwargs)
        resumed._log = log
        [payload] = run_trigger(resumed)
        if payload["state"] == "progress":
            assert payload["trigger"]["log_cursor"] == payload["log_cursor"]
    assert payload["state"] == "succeeded"
    shown = job_lines(log)
    assert shown == backend.all_lines[:len(shown)] and len(shown) > 40  # in order, none twice
    assert len(cursors) > 3 and [c or 0 for c in cursors] == sorted(c or 0 for c in cursors)
    # The start is checkpointed the poll it is first seen, and kept from then on.
    first = starts.index(started)
    assert set(starts[first:]) == {started} and set(starts[:first]) == {None}


class TriggererDied(BaseException):
    """The triggerer process going away mid-poll (not an error the trigger could catch)."""


def test_a_restart_between_checkpoints_replays_only_the_lines_since_the_last_one(use_backend, clock):
    running = JobStatus(JobState.RUNNING, details={"started_at": clock.now})
    backend = use_backend(ScriptedBackend([running] * 3 + [TriggererDied()], lines=60))
    backend.visible = 10  # the job had written 10 lines by the checkpoint
    checkpoint = trigger(started_at=clock.now, log_cursor=10)
    before, after = Recorder(), Recorder()
    checkpoint._log = before
    with pytest.raises(TriggererDied):
        run_trigger(checkpoint)
    backend.statuses = [running] * 3 + [SUCCEEDED]
    restarted = job_trigger.JobTrigger(**checkpoint.serialize()[1])  # as the triggerer rebuilds it
    restarted._log = after
    [payload] = run_trigger(restarted)
    assert payload["state"] == "succeeded" and backend.stops == []
    # Only the lines shown since the checkpoint (cursor 10) are shown again, never the whole log.
    assert job_lines(before)[0] == "line-10" and job_lines(after)[0] == "line-10"


def test_a_saved_cursor_means_a_triggerer_killed_at_any_poll_shows_no_line_twice(use_backend, clock,
                                                                                 tmp_path):
    """The cursor is saved beside the job's result before its lines are shown: a restarted trigger
    rebuilt from an old checkpoint resumes from the saved cursor, not from the checkpoint."""
    running = JobStatus(JobState.RUNNING, details={"started_at": clock.now})
    backend = use_backend(ScriptedBackend([running] * 3 + [TriggererDied()], lines=60))
    backend.visible = 10
    handle = {"backend": "fake", "name": "job-1", "result_uri": str(tmp_path / "job-1" / "result.json")}
    checkpoint = trigger(handle=handle, started_at=clock.now, log_cursor=10)
    before, after = Recorder(), Recorder()
    checkpoint._log = before
    with pytest.raises(TriggererDied):
        run_trigger(checkpoint)
    assert (tmp_path / "job-1" / "log-cursor.json").exists()
    backend.statuses = [running] * 3 + [SUCCEEDED]
    restarted = job_trigger.JobTrigger(**checkpoint.serialize()[1])  # still holds cursor 10
    restarted._log = after
    [payload] = run_trigger(restarted)
    assert payload["state"] == "succeeded" and backend.stops == []
    shown = job_lines(before) + job_lines(after)
    assert shown == backend.all_lines[10:10 + len(shown)], "every line once, in order"
    assert len(job_lines(after)) > 0


def test_a_trigger_recreated_on_another_triggerer_keeps_its_attempt_counts_and_its_clock(
        use_backend, clock):
    """Airflow stores a trigger as its classpath and kwargs (the Trigger row) and another
    triggerer rebuilds it from them when the first one stops heartbeating. Everything the wait
    counts rides in those kwargs: the job's attempt (its `-r<N>` name) in the handle, the chain of
    attempts so far in the context, when the job was submitted and started (its queue bound and
    deadline), its waiting state and log cursor, so nothing restarts from zero (the amazon
    provider's triggers counted their attempts in memory and began them again)."""
    from airflow.models.trigger import Trigger

    handle = {"backend": "fake", "name": "job-1", "job_name": "job-1-r3", "attempt": 3}
    chain = {"attempts": 3, "since": clock.now - 7200, "capacity_waits": 2}
    start = clock.now - 600
    original = trigger(handle=handle, context={"stage": "pretrain", "chain": chain}, started_at=start,
                       submitted_at=clock.now - 900, max_queue_seconds=1800, log_cursor={"s": "t-42"},
                       waiting="RUNNABLE CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY")
    row = Trigger.from_object(original)        # what the deferring task writes
    moved = job_trigger.JobTrigger(**row.kwargs)  # what the next triggerer runs
    assert row.classpath == "llmops.airflow.triggers.job_trigger.JobTrigger"
    assert moved.serialize() == original.serialize()
    assert moved.handle["attempt"] == 3 and moved.context["chain"] == chain
    use_backend(ScriptedBackend([JobStatus(JobState.RUNNING), SUCCEEDED]))   # reports no start itself
    [payload] = run_trigger(moved)
    assert payload["state"] == "succeeded" and payload["chain"] == chain and payload["handle"]["attempt"] == 3
    assert payload["started_at"] == start   # the deadline still counts from the real start


def test_checkpoints_are_rare_when_nothing_is_logged(use_backend, clock):
    backend = use_backend(ScriptedBackend([RUNNING] * 100 + [SUCCEEDED], lines=0))
    [event] = run_trigger(trigger(started_at=clock.now))
    assert event["state"] == "succeeded"  # no progress event: the cursor never moved


def test_the_trigger_stops_the_job_at_the_task_execution_timeout(use_backend, clock):
    backend = use_backend(ScriptedBackend([RUNNING]))
    [event] = run_trigger(trigger(started_at=clock.now, task_deadline=clock.now + 100))
    assert event["state"] == "task_timeout" and backend.stops == ["job-1"]


def test_a_trigger_deferred_by_the_previous_version_still_runs(use_backend, clock):
    backend = use_backend(ScriptedBackend([RUNNING]))
    old = job_trigger.JobTrigger(handle={"backend": "fake", "name": "job-1"}, poll_interval=5.0,
                                 deadline=clock.now + 50, log_cursor=None, context={"stage": "s"})
    [event] = run_trigger(old)
    while event["state"] == "progress":  # the start first seen: checkpointed, the deadline kept
        assert event["trigger"]["deadline"] == old.deadline
        [event] = run_trigger(job_trigger.JobTrigger(**event["trigger"]))
    assert event["state"] == "timeout" and backend.stops == ["job-1"]


@pytest.mark.parametrize("state, force, stopped", [
    ("failed", False, True), ("success", False, True),
    ("deferred", False, False),  # the trigger was handed to another triggerer: the task still waits
    (RuntimeError("no API"), False, False),  # unknown: never stop a job on a guess
    (None, False, False), ("scheduled", False, False),  # cleared: the next try reattaches
    ("running", False, False),  # cleared, and the next try already runs before Airflow answers
    ("running", True, True),
    (None, True, True),  # cleared with force_rerun: the next try starts a fresh job
])
def test_trigger_on_kill_stops_the_job_when_the_user_ended_the_task(use_backend, monkeypatch,
                                                                     state, force, stopped):
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    def get_task_states(**query):
        if isinstance(state, Exception):
            raise state
        return {"manual__1": {"pretrain": state}}

    monkeypatch.setattr(RuntimeTaskInstance, "get_task_states", staticmethod(get_task_states))
    backend = use_backend(ScriptedBackend([RUNNING]))
    killed = task_trigger(stop_on_clear=force)
    asyncio.run(killed.on_kill())
    assert backend.stops == (["job-1"] if stopped else [])


@pytest.mark.parametrize("answers,stopped", [
    (["failed"], True),                        # marked failed: stopped once Airflow answers
    (["scheduled"], False),                    # cleared: the next try reattaches
    ([], False),                               # never answered: left running, with an error
])
def test_on_kill_that_cannot_read_the_state_asks_again_and_acts_on_the_answer(use_backend, monkeypatch,
                                                                              answers, stopped):
    """on_kill has 30 s; under load Airflow's answer can take longer (seen once in the fault
    matrix: a marked-failed task's job ran on). The triggerer asks again after on_kill returns."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    replies = iter([TimeoutError("slow"), TimeoutError("slow")] + answers)

    def get_task_states(**query):
        reply = next(replies, TimeoutError("still slow"))
        if isinstance(reply, Exception):
            raise reply
        return {"manual__1": {"pretrain": reply}}

    monkeypatch.setattr(RuntimeTaskInstance, "get_task_states", staticmethod(get_task_states))
    monkeypatch.setattr(job_trigger, "FOLLOW_UP_EVERY", 0.01)
    monkeypatch.setattr(job_trigger, "FOLLOW_UP_SECONDS", 0.3)
    backend = use_backend(ScriptedBackend([RUNNING]))
    killed = task_trigger()

    async def cancelled_by_a_user() -> None:
        await killed.on_kill()
        assert backend.stops == []             # on_kill itself never stops on an unknown state
        await asyncio.gather(*job_trigger._FOLLOW_UPS)   # the triggerer's loop runs on

    asyncio.run(cancelled_by_a_user())
    assert backend.stops == (["job-1"] if stopped else [])
    if not answers:
        assert any("stop the job by hand" in m for level, m in killed._log.records if level == "error")


def test_a_trigger_whose_task_was_ended_without_on_kill_stops_the_job(use_backend, monkeypatch, clock):
    """Airflow does not always call on_kill when a user marks a deferred task failed (seen in the
    fault matrix): the running trigger asks the task's state itself and stops the job."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    answers = iter(["deferred", "deferred", "failed"])
    monkeypatch.setattr(RuntimeTaskInstance, "get_task_states",
                        staticmethod(lambda **query: {"manual__1": {"pretrain": next(answers)}}))
    monkeypatch.setattr(job_trigger, "TASK_CHECK_SECONDS", 0.0)
    backend = use_backend(ScriptedBackend([RUNNING]))
    running = task_trigger(started_at=clock.now)
    [event] = run_trigger(running)
    assert event["state"] == "stopped" and backend.stops == ["job-1"]
    assert next(answers, "asked no more") == "asked no more"   # stopped at the first "failed"


@pytest.mark.parametrize("held_in", ["backoff", "poll"])
def test_a_task_ended_without_on_kill_stops_the_job_while_the_poll_still_waits(use_backend, monkeypatch,
                                                                               held_in):
    """The fault matrix's read outage beside a user's mark-failed: after a failed read the next
    poll is poll_interval plus a backoff of up to Backoff.cap away (330 s), and a read stuck in
    its retries holds its poll as long. The task check runs beside the polls (real time here, not
    the test clock): the job is stopped within a check of the mark, not at the next poll."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    monkeypatch.setattr(RuntimeTaskInstance, "get_task_states",
                        staticmethod(lambda **query: {"manual__1": {"pretrain": "failed"}}))
    monkeypatch.setattr(job_trigger, "TASK_CHECK_SECONDS", 0.2)
    stopped = threading.Event()

    class Outage(ScriptedBackend):
        def status(self, handle):
            if held_in == "poll":
                stopped.wait(60)   # a status read still retrying through the outage's 503s
            return super().status(handle)

        def stop(self, handle):
            super().stop(handle)
            stopped.set()

    backend = use_backend(Outage([unavailable()]))
    running = task_trigger(started_at=time.time())
    started = time.monotonic()
    [event] = run_trigger(running)
    assert event["state"] == "stopped" and backend.stops == ["job-1"]
    assert time.monotonic() - started < 10, "the stop waited for the next poll"


def test_a_trigger_cancelled_mid_wait_leaves_nothing_pending_on_the_loop(use_backend, monkeypatch):
    """The triggerer cancels a trigger (a clear, a mark, a move) while it sleeps between polls:
    its sleep and its task check end with it, not minutes later on the triggerer's loop."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    monkeypatch.setattr(RuntimeTaskInstance, "get_task_states",
                        staticmethod(lambda **query: {"manual__1": {"pretrain": "deferred"}}))
    use_backend(ScriptedBackend([RUNNING]))
    running = task_trigger(started_at=time.time())   # its start known: no checkpoint at the first poll

    async def cancel_mid_sleep():
        waiting = asyncio.ensure_future(running.run().__anext__())
        await asyncio.sleep(0.5)   # the first poll is done; it sleeps its 30 s poll interval
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0)     # a cancelled task ends at the loop's next turn
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]

    assert asyncio.run(cancel_mid_sleep()) == []


# -- execute_complete -----------------------------------------------------------------------------

def event(state: str, **extra) -> dict[str, Any]:
    return {"state": state, "message": extra.pop("message", state),
            "handle": {"backend": "fake", "name": "job-1"}, "log_cursor": 8,
            "started_at": 123.0, "stage": "pretrain", "mlflow_run_id": "run-1",
            "parent_run_id": "", **extra}


def test_a_progress_event_defers_again_from_the_checkpoint_without_any_api_call(use_backend):
    from airflow.sdk.exceptions import TaskDeferred

    backend = use_backend(ScriptedBackend([RUNNING]))
    store = FakeStore()
    store.data["llmops_job"] = {"name": "job-1", "handle": {"backend": "fake", "name": "job-1"}}
    kwargs = trigger(log_cursor=8, started_at=123.0)._kwargs()
    with pytest.raises(TaskDeferred) as deferred:
        operator().execute_complete(context(store=store), event("progress", trigger=kwargs))
    assert deferred.value.trigger.serialize()[1] == kwargs
    assert backend.status_calls == 0 and backend.log_cursors == [] and backend.submits == 0
    assert store.data["llmops_job"]["log_cursor"] == 8 and store.data["llmops_job"]["started_at"] == 123.0


def test_execute_complete_on_timeout_ends_the_run_killed_and_shows_the_tail(use_backend, runs_ended):
    backend = use_backend(ScriptedBackend([JobStatus(JobState.STOPPED, "stopped")]))
    op = operator()
    with pytest.raises(job_op.AirflowException, match="ran past its max_run_seconds"):
        op.execute_complete(context(), event("timeout", message="the job ran past its max_run_seconds"))
    assert runs_ended == [("run-1", "KILLED")] and backend.tails == [40]
    op.on_kill()
    assert backend.stops == []  # the trigger stopped it already


def test_execute_complete_on_error_leaves_the_job_and_its_run(use_backend, runs_ended):
    backend = use_backend(ScriptedBackend([RUNNING]))
    with pytest.raises(job_op.AirflowException, match="AccessDenied"):
        operator().execute_complete(context(), event("error", message="AccessDenied"))
    assert backend.stops == [] and runs_ended == []


def test_execute_complete_on_task_timeout_fails_as_a_timeout(use_backend, runs_ended):
    use_backend(ScriptedBackend([RUNNING]))
    with pytest.raises(job_op.AirflowTaskTimeout):
        operator().execute_complete(context(), event("task_timeout"))
    assert runs_ended == [("run-1", "KILLED")]


def test_execute_complete_retries_the_final_status_read(use_backend, clock, runs_ended):
    use_backend(ScriptedBackend([throttled(), unavailable(), SUCCEEDED]))
    result = operator().execute_complete(context(), event("succeeded"))
    assert result["metrics"] == {"answer": 42} and runs_ended == [("run-1", "FINISHED")]
    assert len(clock.sleeps) == 2


# -- which job: identity, the task state store, force_rerun ---------------------------------------

BASE = JobSpec(stage="pretrain", entrypoint="tasks.pretrain", backend="sagemaker", image="img:1",
               instance_type="ml.p5.48xlarge", config={"lr": 0.1})


@pytest.mark.parametrize("change", [
    {"image": "img:2"}, {"instance_type": "ml.p4d.24xlarge"}, {"instance_count": 2},
    {"nproc_per_node": 8}, {"env": {"NCCL_DEBUG": "INFO"}}, {"max_run_seconds": 7200},
    {"inputs": {"train": "s3://b/other"}}, {"output_uri": "s3://b/out2"},
    {"checkpoint_uri": "s3://b/ck2"}, {"config": {"lr": 0.2}}, {"argv": ("--x",)},
])
def test_anything_that_changes_the_job_changes_its_identity(change):
    assert job_identity(BASE.replace(**change)) != job_identity(BASE)


def test_the_identity_ignores_per_try_mlflow_env_and_tags_but_not_backend_settings():
    same = BASE.replace(env={"MLFLOW_RUN_ID": "abc", "MLFLOW_TRACKING_URI": "http://x"},
                        tags={"team": "a"}, mlflow_parent_run_id="p")
    assert job_identity(same) == job_identity(BASE)
    assert job_identity(BASE, "settings-v1") != job_identity(BASE, "settings-v2")


class FingerprintBackend(ScriptedBackend):
    fp = "v1"

    def fingerprint(self, spec: JobSpec) -> str:
        return self.fp


def name_for(op: JobOperator, ti: FakeTI, **params) -> str:
    return op._prepare(context(ti, **params)).name


def test_the_name_is_the_same_across_tries_and_changes_with_the_backend_settings(use_backend):
    backend = use_backend(FingerprintBackend([RUNNING]))
    op = operator(retries=2)
    first = name_for(op, FakeTI(try_number=1, max_tries=2))
    assert name_for(op, FakeTI(try_number=3, max_tries=2)) == first
    assert name_for(op, FakeTI(try_number=4, max_tries=5)) == first  # a clear reattaches...
    backend.fp = "v2"                                                # ...unless an admin changed
    assert name_for(op, FakeTI(try_number=4, max_tries=5)) != first  # the backend's settings


def test_force_rerun_starts_a_fresh_job_per_clear_and_retries_reattach_to_it(use_backend):
    use_backend(ScriptedBackend([RUNNING]))
    op = operator(retries=2)
    plain = name_for(op, FakeTI(1, max_tries=2))
    forced = [name_for(op, FakeTI(t, max_tries=2), force_rerun=True) for t in (1, 2, 3)]
    assert forced[0] != plain and len(set(forced)) == 1             # retries share the job
    after_clear = name_for(op, FakeTI(4, max_tries=5), force_rerun=True)
    assert after_clear not in (plain, forced[0])                    # a clear gets a fresh one
    # Templated ("{{ params.force_rerun }}") it renders as text.
    assert name_for(operator(retries=2, force_rerun="True"), FakeTI(1, max_tries=2)) == forced[0]
    assert name_for(operator(retries=2, force_rerun=False), FakeTI(1, max_tries=2),
                    force_rerun=True) == plain                      # the argument wins


def test_a_later_try_reattaches_through_the_task_state_store(use_backend, clock):
    backend = use_backend(ScriptedBackend([RUNNING]))
    store = FakeStore()
    op = operator()
    name = name_for(op, FakeTI())
    store.data["llmops_job"] = {"name": name, "try_number": 1, "log_cursor": 6,
                                "started_at": clock.now - 10,
                                "handle": {"backend": "fake", "name": name, "attempt": 3}}
    backend.statuses = [RUNNING, RUNNING, SUCCEEDED]
    retry = operator()
    result = retry.execute(context(FakeTI(try_number=2), store))
    assert backend.submits == 0 and result["job_name"] == name
    assert backend.log_cursors[0] == 6  # the log goes on from the earlier try's checkpoint
    assert "line-0" not in job_lines(retry.log)


@pytest.mark.parametrize("recorded_status, defers", [(SUCCEEDED, False), (RUNNING, True)])
def test_a_deferrable_retry_finishes_a_job_that_already_succeeded_in_the_worker(use_backend, clock,
                                                                                recorded_status, defers):
    """A retry that reattaches to a job already ended does not defer: its trigger would fire at
    once, and Airflow's scheduler can take the deferring try's late exit for an external kill of
    the resumed task (apache/airflow#67287; the fault matrix's killed-worker row lost a
    succeeded job's result to it). A job still running defers as before."""
    from airflow.sdk.exceptions import TaskDeferred

    backend = use_backend(ScriptedBackend([recorded_status]))
    store = FakeStore()
    name = name_for(operator(), FakeTI())
    store.data["llmops_job"] = {"name": name, "try_number": 1,
                                "handle": {"backend": "fake", "name": name}}
    retry = operator(deferrable=True)
    if defers:
        with pytest.raises(TaskDeferred):
            retry.execute(context(FakeTI(try_number=2), store))
    else:
        result = retry.execute(context(FakeTI(try_number=2), store))
        assert result["job_name"] == name and result["metrics"] == {"answer": 42}
    assert backend.submits == 0


@pytest.mark.parametrize("recorded_status, recorded_name_matches, submits", [
    (FAILED, True, 1),          # the recorded job failed: a new attempt is submitted
    (RUNNING, False, 1),        # the spec changed since: a new job
    (client_error("ValidationException"), True, 1),  # the job is gone: submit by name
])
def test_the_recorded_job_is_not_reused_when_it_should_not_be(use_backend, clock, recorded_status,
                                                              recorded_name_matches, submits):
    backend = use_backend(ScriptedBackend([recorded_status, SUCCEEDED]))
    store = FakeStore()
    name = name_for(operator(), FakeTI())
    recorded = name if recorded_name_matches else "pretrain-0123456789ab"
    store.data["llmops_job"] = {"name": recorded, "handle": {"backend": "fake", "name": recorded}}
    operator().execute(context(FakeTI(try_number=2), store))
    assert backend.submits == submits
    assert store.data["llmops_job"]["name"] == name and store.data["llmops_job"]["try_number"] == 2


def test_without_a_task_state_store_the_name_alone_finds_the_job(use_backend, clock):
    backend = use_backend(ScriptedBackend([SUCCEEDED]))
    assert operator().execute(context(store=None))["metrics"] == {"answer": 42}
    assert backend.submits == 1


def test_force_rerun_is_a_boolean_lifecycle_param_defaulting_to_false():
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    from llmops.policy.params import lifecycle_params

    params = ParamsDict(lifecycle_params())
    assert params["force_rerun"] is False and params.get_param("force_rerun").schema["type"] == "boolean"
    params["force_rerun"] = True
    with pytest.raises(ParamValidationError):
        params["force_rerun"] = "sometimes"


# -- waiting is visible and bounded (issue 21, point 3) -------------------------------------------

CAPACITY = JobStatus(JobState.PENDING, "RUNNABLE CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY - Service "
                     "cannot fulfill the capacity requested for instance type p5.48xlarge")


def info_lines(log: Recorder) -> list[str]:
    return [m for level, m in log.records if level == "info"]


def test_each_change_of_the_waiting_state_is_logged_once_with_the_time_queued(use_backend, clock):
    runnable = JobStatus(JobState.PENDING, "RUNNABLE")
    started = JobStatus(JobState.RUNNING, details={"started_at": clock.now + 720})
    use_backend(ScriptedBackend([runnable] * 3 + [CAPACITY] * 20 + [started, SUCCEEDED]))
    op = operator(poll_interval=30)
    op.execute(context())
    waiting = [m for m in info_lines(op.log) if m.startswith("[job] waiting") or m == "[job] running"]
    assert waiting == ["[job] waiting: RUNNABLE (queued 0 s)",
                       "[job] waiting: " + CAPACITY.message + " (queued 90 s)",
                       "[job] running"]


def test_a_job_queued_past_max_queue_seconds_is_stopped_and_fails_with_the_reason(use_backend, clock,
                                                                                runs_ended):
    backend = use_backend(ScriptedBackend([CAPACITY]))
    submit = backend.submit
    backend.submit = lambda spec: {**submit(spec), "max_queue_seconds": 600}   # the settings' value
    store = FakeStore()
    op = operator(poll_interval=60)
    with pytest.raises(job_op.AirflowException) as failed:
        op.execute(context(store=store))
    message = str(failed.value)
    assert "max_queue_seconds (600s)" in message and "INSUFFICIENT_INSTANCE_CAPACITY" in message
    assert backend.stops == [op._handle["name"]] and backend.submits == 1   # no further attempt
    submitted = store.data["llmops_job"]["submitted_at"]
    assert submitted + 600 < clock.now <= submitted + 660


def test_without_max_queue_seconds_a_queued_job_waits(use_backend, clock):
    backend = use_backend(ScriptedBackend([CAPACITY] * 300 + [SUCCEEDED]))
    operator(poll_interval=60).execute(context())
    assert backend.stops == []


def test_the_queue_bound_counts_from_the_services_submission_time(clock):
    """A reattached job was queued before this watch began: the service's time counts."""
    submitted = clock.now - 590
    backend = ScriptedBackend([JobStatus(JobState.PENDING, "Suspended: queue full",
                                         details={"submitted_at": submitted})])
    watch = JobWatch(backend, {"backend": "fake", "name": "j"}, poll_interval=30,
                     max_run_seconds=100, max_queue_seconds=600)
    assert not watch.poll().done
    clock.now += 30
    step = watch.poll()
    assert step.stopped and "queued" not in step.status.message
    assert "waited 10 min" in step.status.message and "Suspended: queue full" in step.status.message


def test_a_job_that_started_is_not_under_the_queue_bound_when_queued_again(clock):
    interrupted = JobStatus(JobState.PENDING, "InProgress (Interrupted)",
                            details={"started_at": clock.now - 10, "submitted_at": clock.now - 4000})
    watch = JobWatch(ScriptedBackend([interrupted]), {"backend": "fake", "name": "j"},
                     poll_interval=30, max_run_seconds=86400, max_queue_seconds=600)
    step = watch.poll()
    assert not step.done and step.waiting == "waiting: InProgress (Interrupted) (after it had started)"


def test_the_trigger_logs_waiting_changes_and_a_restart_repeats_at_most_one(use_backend, clock):
    use_backend(ScriptedBackend([PENDING, CAPACITY, CAPACITY, SUCCEEDED]))
    first = trigger()
    first._log = log = Recorder()
    run_trigger(first)
    said = [m for m in info_lines(log) if "waiting" in m]
    assert said == ["[job-1] waiting: pending (queued 0 s)",
                    f"[job-1] waiting: {CAPACITY.message} (queued 30 s)"]
    # A restart from kwargs that carry the last reported state says nothing new for it.
    use_backend(ScriptedBackend([CAPACITY, CAPACITY, SUCCEEDED]))
    again = trigger(waiting=CAPACITY.message)
    again._log = log = Recorder()
    run_trigger(again)
    assert [m for m in info_lines(log) if "waiting" in m] == []


def test_the_trigger_stops_a_job_queued_past_max_queue_seconds(use_backend, clock):
    backend = use_backend(ScriptedBackend([CAPACITY]))
    [event] = run_trigger(trigger(max_queue_seconds=300, submitted_at=clock.now - 290))
    assert event["state"] == "timeout" and backend.stops == ["job-1"]
    assert "max_queue_seconds (300s)" in event["message"]
    assert "INSUFFICIENT_INSTANCE_CAPACITY" in event["message"]


def test_the_trigger_checkpoint_carries_the_waiting_state_and_submission(use_backend, clock):
    use_backend(ScriptedBackend([CAPACITY, RUNNING]))
    [event] = run_trigger(trigger(max_queue_seconds=3600, submitted_at=clock.now - 5))
    assert event["state"] == "progress"   # the first sight of a start without started_at
    kwargs = event["trigger"]
    assert kwargs["waiting"] == "" and kwargs["submitted_at"] == clock.now - 30 - 5
    assert kwargs["max_queue_seconds"] == 3600


def test_execute_defers_with_the_queue_bound_of_the_handle(use_backend, clock):
    from airflow.sdk.exceptions import TaskDeferred

    backend = use_backend(ScriptedBackend([RUNNING]))
    submit = backend.submit
    backend.submit = lambda spec: {**submit(spec), "max_queue_seconds": 900}
    with pytest.raises(TaskDeferred) as deferred:
        operator(deferrable=True).execute(context(store=FakeStore()))
    _, kwargs = deferred.value.trigger.serialize()
    assert kwargs["max_queue_seconds"] == 900 and kwargs["submitted_at"] == clock.now
