"""A chain of attempts must make progress (issue 21): an attempt that ran and ended without a
newer committed checkpoint than the one it started from made none, and after
`max_stalled_attempts` of those in a row the task fails at once, without Airflow retries
(AirflowFailException), instead of burning max_attempts x MaxRuntime of instance time.

The checkpoints are real directories (step_NNNNNN/manifest.json, tasks/train/checkpoint.py's
layout) in the storage the handle names, read by the real Backend.checkpoint_step; the backend's
statuses are scripted (tests/test_attempt_chain.py's Attempts), and each attempt "saves" its
steps just before it ends. Backend.checkpoint_step on S3 runs against moto.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

import llmops.airflow.operators.job_operator as job_op
from llmops.infra.aws import s3
from llmops.jobs.backends import JobState, JobStatus
from llmops.jobs.backends.base import NO_CHECKPOINT
from tests.test_attempt_chain import (CAPACITY, MAX_RUNTIME, Attempts, clock,  # noqa: F401
                                      ledger_rows, no_mlflow)
from tests.test_wait_faults import (RUNNING, SUCCEEDED, FakeStore, context, operator,  # noqa: F401
                                    runs_ended, use_backend)

HOST = JobStatus(JobState.FAILED, "Batch job pretrain-1 failed",
                 details={"reason": "Host EC2 (instance i-0fa4e00000000000) terminated."})


def commit(root: Path, step: int, manifest: bool = True) -> None:
    path = root / f"step_{step:06d}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.pt").write_text("weights")
    if manifest:
        (path / "manifest.json").write_text("{}")


class Saving(Attempts):
    """Attempts whose job storage is a local dir: attempt n commits the steps saves[n-1] before
    it ends."""

    def __init__(self, scripts: list[list], saves: list[list[int]], root: Path):
        super().__init__(scripts)
        self.saves, self.root = saves, root

    def submit(self, spec):
        return {**super().submit(spec), "checkpoint_uri": str(self.root)}

    def status(self, handle):
        status = super().status(handle)
        if status.state.terminal:
            for step in self.saves[min(self.submits, len(self.saves)) - 1]:
                commit(self.root, step)
        return status


def test_a_chain_that_saves_nothing_stops_after_two_attempts_not_twenty(use_backend, clock,
                                                                          ledger_rows, tmp_path):
    commit(tmp_path, 1200)   # an earlier try got this far; now every attempt hangs before a save
    # attempt 2 loses its host: the fleet's doing, not judged, and the streak stands
    backend = use_backend(Saving([[RUNNING, MAX_RUNTIME], [RUNNING, HOST], [RUNNING, MAX_RUNTIME]],
                                 [[]], tmp_path))
    op = operator(max_attempts=20)
    with pytest.raises(AirflowFailException) as failed:   # not retried by Airflow
        op.execute(context(store=FakeStore()))
    assert backend.submits == 3
    text = str(failed.value)
    assert "2 attempts in a row made no progress (max_stalled_attempts 2)" in text
    assert "attempt 1 (pretrain-" in text and "-r1, ended by max_runtime) started from checkpoint step 1200" in text
    assert "attempt 3 (pretrain-" in text and "-r3, ended by max_runtime) started from checkpoint step 1200" in text
    assert "attempt 2 (" not in text
    assert str(tmp_path) in text and "before the first checkpoint save" in text
    assert "Last lines of its log" in text
    ended = [row for event, row in ledger_rows if event == "ended"]
    assert [r["attempt"] for r in ended] == [1, 2, 3]
    assert "chain of attempts stopped" not in ended[1]["failure_reason"]
    assert "chain of attempts stopped: 2 attempts in a row made no progress" in ended[2]["failure_reason"]


def test_no_checkpoint_at_all_reads_as_no_checkpoint(use_backend, clock, ledger_rows, tmp_path):
    commit(tmp_path, 5, manifest=False)   # an unfinished save is not a checkpoint
    backend = use_backend(Saving([[RUNNING, MAX_RUNTIME]], [[]], tmp_path))
    with pytest.raises(AirflowFailException, match="started from no checkpoint"):
        operator(max_stalled_attempts=3).execute(context(store=FakeStore()))
    assert backend.submits == 3


def test_progress_resets_the_count_and_the_chain_runs_on(use_backend, clock, ledger_rows, tmp_path):
    # saves: attempt 1 reaches 100, attempt 2 nothing, attempt 3 reaches 200, 4 nothing, 5 ends
    backend = use_backend(Saving([[RUNNING, MAX_RUNTIME]] * 4 + [[RUNNING, SUCCEEDED]],
                                 [[50, 100], [], [200], [], []], tmp_path))
    op = operator()
    assert op.execute(context(store=FakeStore()))["metrics"] == {"answer": 42}
    assert backend.submits == 5
    warnings = op.log.warnings()
    assert any("Attempt 2 goes on from the newest checkpoint (checkpoint step 100)" in w for w in warnings)
    assert any("Attempt 5 goes on from the newest checkpoint (checkpoint step 200)" in w for w in warnings)


def test_capacity_errors_are_not_judged(use_backend, clock, ledger_rows, tmp_path):
    # a capacity error never ran: it neither counts as a stall nor breaks a streak
    backend = use_backend(Saving([[RUNNING, MAX_RUNTIME], [CAPACITY], [CAPACITY],
                                  [RUNNING, MAX_RUNTIME]], [[]], tmp_path))
    with pytest.raises(AirflowFailException) as failed:
        operator().execute(context(store=FakeStore()))
    assert backend.submits == 4
    assert "attempt 1 (" in str(failed.value) and "attempt 4 (" in str(failed.value)
    assert "attempt 2 (" not in str(failed.value)


def test_unknown_progress_keeps_the_old_chain(use_backend, clock, ledger_rows):
    # no checkpoint storage in the handle (a local job, an old handle): only max_attempts stops it
    backend = use_backend(Attempts([[RUNNING, MAX_RUNTIME]]))
    with pytest.raises(job_op.AirflowException) as failed:
        operator(max_attempts=4).execute(context(store=FakeStore()))
    assert backend.submits == 4 and not isinstance(failed.value, AirflowFailException)
    assert "max_attempts 4" in str(failed.value)


def test_an_unreadable_storage_is_not_a_stall(use_backend, clock, ledger_rows, tmp_path):
    class Unreadable(Saving):
        def checkpoint_step(self, handle):
            raise PermissionError("AccessDenied: s3:ListBucket")

    backend = use_backend(Unreadable([[RUNNING, MAX_RUNTIME]], [[]], tmp_path))
    op = operator(max_attempts=3)
    with pytest.raises(job_op.AirflowException) as failed:
        op.execute(context(store=FakeStore()))
    assert backend.submits == 3 and not isinstance(failed.value, AirflowFailException)
    assert any("Could not read the newest checkpoint" in w and "AccessDenied" in w
               for w in op.log.warnings())


def test_a_reattached_first_attempt_is_not_judged(use_backend, clock, ledger_rows, tmp_path):
    # the job an earlier try started may have saved before this try saw it
    class Reattaching(Saving):
        def submit(self, spec):
            handle = super().submit(spec)
            return {**handle, "reattached": self.submits == 1}

    commit(tmp_path, 300)
    backend = use_backend(Reattaching([[RUNNING, MAX_RUNTIME]], [[]], tmp_path))
    with pytest.raises(AirflowFailException) as failed:
        operator().execute(context(store=FakeStore()))
    assert backend.submits == 3   # attempts 2 and 3 stalled; attempt 1 was not judged
    assert "attempt 2 (" in str(failed.value) and "attempt 1 (" not in str(failed.value)


def test_the_parent_run_fails_at_once(use_backend, clock, ledger_rows, tmp_path, runs_ended,
                                      monkeypatch):
    monkeypatch.setattr(job_op.tracking, "start_child_run", lambda **kwargs: "child-1")
    monkeypatch.setattr(job_op.tracking, "tracking_uri", lambda: "http://mlflow")
    use_backend(Saving([[RUNNING, MAX_RUNTIME]], [[]], tmp_path))
    op = operator(retries=3)
    op.spec = {**op.spec, "mlflow_parent_run_id": "parent-1", "mlflow_experiment": "lifecycle"}
    with pytest.raises(AirflowFailException):
        op.execute(context(store=FakeStore()))
    assert ("parent-1", "FAILED") in runs_ended   # try 1 of 4, yet no retry follows


def test_deferred_the_stall_is_found_across_the_trigger(use_backend, clock, ledger_rows, tmp_path):
    backend = use_backend(Saving([[MAX_RUNTIME], [MAX_RUNTIME]], [[]], tmp_path))
    commit(tmp_path, 40)
    op = operator(deferrable=True)
    store = FakeStore()
    with pytest.raises(TaskDeferred) as first:
        op.execute(context(store=store))
    assert first.value.trigger.context["chain"]["from_step"] == 40
    backend.status(op._handle)   # what the trigger saw: attempt 1 ended
    with pytest.raises(TaskDeferred) as second:
        op.execute_complete(context(store=store), {**first.value.trigger.context, "state": "stopped",
                                                   "handle": op._handle, "message": "stopped"})
    chain = second.value.trigger.context["chain"]
    assert chain["attempts"] == 2 and [s["attempt"] for s in chain["stalled"]] == [1]
    with pytest.raises(AirflowFailException, match="2 attempts in a row made no progress"):
        op.execute_complete(context(store=store), {**second.value.trigger.context,
                                                   "state": "stopped", "handle": op._handle})
    assert backend.submits == 2


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "2", None])
def test_max_stalled_attempts_is_checked_and_named(value):
    with pytest.raises(ValueError, match="max_stalled_attempts must be an integer >= 1"):
        operator(max_stalled_attempts=value)


def test_checkpoint_step_reads_local_storage(tmp_path):
    backend = Attempts([[RUNNING]])
    assert backend.checkpoint_step({}) is None
    assert backend.checkpoint_step({"checkpoint_uri": str(tmp_path / "none")}) == NO_CHECKPOINT
    commit(tmp_path, 10)
    commit(tmp_path, 20)
    commit(tmp_path, 30, manifest=False)   # an unfinished save
    (tmp_path / "step_40").mkdir()         # not the layout
    assert backend.checkpoint_step({"checkpoint_uri": str(tmp_path)}) == 20


def test_checkpoint_step_reads_s3(monkeypatch):
    import boto3
    from moto import mock_aws

    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="runs")
        for key in ["r/ck/step_000100/manifest.json", "r/ck/step_000100/model.pt",
                    "r/ck/step_000200/model.pt",            # unfinished: no manifest yet
                    "r/ck/step_000050/manifest.json", "r/ck/other/manifest.json",
                    "r/ck-2/step_000900/manifest.json"]:     # a neighbouring prefix
            client.put_object(Bucket="runs", Key=key, Body=b"{}")
        made: list[tuple] = []
        monkeypatch.setattr(s3, "s3_hook", lambda *args: made.append(args) or
                            SimpleNamespace(get_conn=lambda: client))
        backend = Attempts([[RUNNING]])
        handle = {"checkpoint_uri": "s3://runs/r/ck", "aws_conn_id": "aws_default",
                  "region_name": "us-east-1", "kms_key_id": ""}
        assert backend.checkpoint_step(handle) == 100
        assert made == [("aws_default", "us-east-1", "")]
        assert backend.checkpoint_step({**handle, "checkpoint_uri": "s3://runs/empty/"}) == NO_CHECKPOINT
