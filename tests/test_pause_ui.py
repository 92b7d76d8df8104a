"""Pause a running pretraining from the Airflow UI (issue 24, point 2), the Airflow side: the
pretrain task's "Pause pretraining" page writes the job's PAUSE marker (llmops.airflow.pause_api,
only for a running pretrain task, only where the operator recorded it, only for a caller Airflow
lets edit the DAG's task instances); the job checkpoints and exits, and JobOperator ends the task
skipped, its log saying "paused at step N" and how to resume, with no further attempt and no later
stage. The job itself (checkpoint, exit code, bitwise resume) is tests/test_pause.py's."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowSkipException

import llmops.airflow.operators.job_operator as job_op
from llmops.airflow import pause_api
from llmops.airflow.operators import job_pause, links
from llmops.airflow.operators.job_operator import JobOperator
from llmops.jobs.backends import JobState, JobStatus
from llmops.jobs.spec import NothingToRun
from llmops.stages import specs
from tests.test_wait_faults import (RUNNING, FakeStore, FakeTI, ScriptedBackend, context,  # noqa: F401
                                    operator, runs_ended, use_backend)

PAUSED_LOCAL = JobStatus(JobState.FAILED, "the job exited with code 77",
                         result={"paused": True, "paused_at_step": 6, "metrics": {"step": 6}},
                         details={"exit_code": 77})
PAUSED_BATCH = JobStatus(JobState.FAILED, "Batch job pretrain-1 failed: Essential container in task "
                         "exited (exit code 77)")


class RecordingTI(FakeTI):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.xcoms: dict[str, object] = {}

    def xcom_push(self, key, value):
        self.xcoms[key] = value


@pytest.fixture
def clock(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)


def test_the_exit_code_agrees_with_the_jobs():
    from tasks.train.pause import MARKER
    from tasks.train.supervisor import PAUSED_EXIT

    assert (job_pause.PAUSED_EXIT, pause_api.MARKER) == (PAUSED_EXIT, MARKER)


@pytest.mark.parametrize("status, said", [(PAUSED_LOCAL, "paused at step 6"),
                                          (PAUSED_BATCH, "paused at a step its log names")])
def test_a_paused_job_ends_its_task_skipped_with_how_to_resume(use_backend, clock, runs_ended,
                                                               status, said):
    backend = use_backend(ScriptedBackend([RUNNING, status]))
    op = operator(retries=3)
    with pytest.raises(AirflowSkipException, match=said):
        op.execute(context(store=FakeStore()))
    assert backend.submits == 1 and backend.stops == [], "no further attempt, nothing stopped"
    told = " ".join(op.log.warnings())
    assert said in told
    assert "from_run=manual__1, start_at=pretrain, fork_step=" in told
    assert not [m for level, m in op.log.records if level == "error"]


def test_a_paused_job_leaves_the_runs_note_with_the_conf_that_resumes_it(use_backend, clock,
                                                                        runs_ended):
    """The DAG run's note (the XCom llmops.airflow.run_note copies when the run ends): the step of
    how many, and the run's own conf with the resume Params in place of any it had. Through the DAG:
    tests/test_pause_resume_dag.py (make test-slow)."""
    from types import SimpleNamespace

    from llmops.stages.run_summary import NOTE_XCOM

    status = JobStatus(PAUSED_LOCAL.state, PAUSED_LOCAL.message, details=PAUSED_LOCAL.details,
                       result={**PAUSED_LOCAL.result, "max_steps": 12})
    use_backend(ScriptedBackend([RUNNING, status]))
    op, ti = operator(), RecordingTI()
    ctx = {**context(ti=ti, store=FakeStore()),
           "dag_run": SimpleNamespace(conf={"recipe": "tiny", "from_run": "manual__0", "fork_step": 3})}
    with pytest.raises(AirflowSkipException, match="paused at step 6"):
        op.execute(ctx)
    note = ti.xcoms[NOTE_XCOM]
    assert note.startswith("paused at step 6 of 12: pretrain checkpointed that step and stopped on "
                           "request; no model, so the later stages were skipped. Resume with "
                           "from_run=manual__1, start_at=pretrain, fork_step=6"), note
    resume = {"recipe": "tiny", "from_run": "manual__1", "start_at": "pretrain", "fork_step": 6}
    assert json.loads(note[note.index("{"):]) == resume
    assert f"nothing else changed: {json.dumps(resume)}" in " ".join(op.log.warnings())


def test_a_remote_pause_is_recorded_with_its_s3_checkpoints_and_refused_as_such():
    """A Batch or HyperPod job's checkpoints directory was the container's: its pause record
    points at the S3 mirror, and a resume through from_run says that is not supported yet."""
    from llmops.stages import reuse

    record = reuse.pause_record(
        {"paused_at_step": 6, "kept_steps": [4, 6], "outputs": {
            "checkpoint": "/opt/ml/checkpoints/step_000006", "checkpoints": "/opt/ml/checkpoints",
            "checkpoint_uri": "s3://b/run/checkpoints"}}, identity={}, key="", where={})
    assert (record["checkpoints"], record["kept"], record["kind"]) == ("s3://b/run/checkpoints", {}, "paused")
    with pytest.raises(reuse.FromRunError, match="paused pretraining keeps its checkpoints at "
                                                 "s3://b/run/checkpoints, not on a disk this worker "
                                                 "reads"):
        reuse._fork_point(record, 6, "manual__1")


def test_a_pause_after_a_continued_attempt_ends_the_chain(use_backend, clock, runs_ended):
    from tests.test_attempt_chain import MAX_RUNTIME, Attempts

    backend = use_backend(Attempts([[RUNNING, MAX_RUNTIME], [RUNNING, PAUSED_LOCAL],
                                    [RUNNING, RUNNING]]))
    with pytest.raises(AirflowSkipException, match="paused at step 6"):
        operator().execute(context(store=FakeStore()))
    assert backend.submits == 2


def test_a_failure_is_still_a_failure(use_backend, clock, runs_ended):
    use_backend(ScriptedBackend([RUNNING, JobStatus(JobState.FAILED, "the job exited with code 1",
                                                    details={"exit_code": 1})]))
    with pytest.raises(job_op.AirflowException, match="code 1"):
        operator().execute(context(store=FakeStore()))


def test_the_pretrain_task_records_its_marker_and_shows_the_link(use_backend, clock, runs_ended,
                                                                 tmp_path):
    use_backend(ScriptedBackend([RUNNING, PAUSED_LOCAL]))
    op = JobOperator(task_id="pretrain", deferrable=False,
                     spec={"stage": "pretrain", "entrypoint": "tasks.pretrain", "backend": "local",
                           "config": {"output_dir": str(tmp_path / "pretrain")}})
    ti = RecordingTI()
    with pytest.raises(AirflowSkipException):
        op.execute(context(ti=ti, store=FakeStore()))
    place = ti.xcoms[pause_api.XCOM_KEY]
    assert place["marker"] == str(tmp_path / "pretrain" / "checkpoints" / "PAUSE")
    assert place["why_not"] == "" and place["backend"] == "local"
    url = ti.xcoms[links.PausePretrainingLink().xcom_key]
    assert url.endswith("/llmops-pause/runs/dag/manual__1")
    assert ti.xcoms[links.LINKS_KEY][pause_api.LINK_NAME] == url


def test_a_sagemaker_pretraining_says_why_it_cannot_be_paused():
    marker, why = pause_api.marker_place("sagemaker", "s3://b/out", {"checkpoint_uri": "s3://b/c"})
    assert marker == "" and "SageMaker" in why
    assert pause_api.marker_place("batch", "", {"checkpoint_uri": "s3://b/run/checkpoints"}) == \
        ("s3://b/run/checkpoints/PAUSE", "")


def test_the_later_stages_skip_when_pretraining_made_no_model(use_backend, clock):
    run = {"dag_id": "llm_lifecycle", "run_id": "manual__paused", "root": "/tmp/x",
           "config": {"finetune": {}}, "backends": {}, "experiment": "llm_lifecycle", "parent_run_id": ""}
    with pytest.raises(NothingToRun, match="paused or skipped"):
        specs.finetune_spec(run, {"outputs": {"data_dir": "d"}, "data_hash": ""}, None)
    with pytest.raises(NothingToRun, match="paused or skipped"):   # evaluate: none_failed too
        specs.evaluate_spec(run, {"outputs": {"data_dir": "d"}, "data_hash": ""}, None, None, None)
    op = JobOperator(task_id="finetune", build_spec=specs.finetune_spec, deferrable=False,
                     op_kwargs={"run": run, "data": {"outputs": {"data_dir": "d"}}, "base": None})
    with pytest.raises(AirflowSkipException, match="finetune: pretraining produced no model"):
        op.execute(context(store=FakeStore()))


# -- the endpoint ----------------------------------------------------------------------------

def allow():
    return None


@pytest.fixture
def roots(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPS_ALLOWED_STORAGE_ROOTS", str(tmp_path / "store"))
    return tmp_path / "store"


def client(tasks: dict, **kwargs):
    from fastapi.testclient import TestClient

    kwargs.setdefault("authorize_read", allow)
    kwargs.setdefault("authorize_pause", allow)
    return TestClient(pause_api.make_app(lookup=lambda dag_id, run_id: tasks.get(run_id), **kwargs))


def running(marker: Path | str, state: str = "running") -> dict:
    return {"state": state, "try_number": 1,
            "place": {"marker": str(marker), "why_not": "", "backend": "local", "job_name": "pretrain-x"}}


def test_pausing_a_running_run_writes_its_marker(roots):
    marker = roots / "runs" / "r1" / "pretrain" / "checkpoints" / "PAUSE"
    api = client({"r1": running(marker)})
    page = api.get("/runs/llm_lifecycle/r1")
    assert page.status_code == 200 and "<button type='submit'>Pause pretraining" in page.text
    answer = api.post("/runs/llm_lifecycle/r1", json={"at_step": 6, "by": "ana"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["marker"] == str(marker)
    written = json.loads(marker.read_text())
    assert (written["at_step"], written["by"]) == (6, "ana")
    assert sorted(p.name for p in marker.parent.iterdir()) == ["PAUSE"], "written atomically"
    # the page's form: no step = after the next step; a browser gets a page back
    form = api.post("/runs/llm_lifecycle/r1", data={"at_step": ""})
    assert form.status_code == 200 and "pauses after the next step" in form.text
    assert "at_step" not in json.loads(marker.read_text())


@pytest.mark.parametrize("tasks, status, reason", [
    ({}, 404, "has no task 'pretrain'"),
    ({"r1": running("/x/checkpoints/PAUSE", state="success")}, 409, "is success, not running"),
    ({"r1": {"state": "running", "place": None}}, 409, "has not recorded its job yet"),
    ({"r1": {"state": "deferred", "place": {"marker": "", "job_name": "p",
                                             "why_not": "a SageMaker training job syncs"}}},
     409, "cannot be paused from here: a SageMaker training job syncs"),
    ({"r1": running("/etc/checkpoints/PAUSE")}, 409, "outside the allowed storage roots"),
    ({"r1": running("relative/checkpoints/PAUSE")}, 409, "neither an absolute path"),
])
def test_a_run_with_no_running_pretraining_is_refused_with_why(roots, tasks, status, reason):
    api = client(tasks)
    answer = api.post("/runs/llm_lifecycle/r1", json={})
    assert answer.status_code == status and reason in answer.json()["detail"], answer.text
    page = api.get("/runs/llm_lifecycle/r1")
    assert reason in html.unescape(page.text) and "<button" not in page.text
    assert not Path("/etc/checkpoints/PAUSE").exists()


def test_a_marker_outside_checkpoints_or_a_bad_step_is_refused(roots):
    api = client({"r1": running(roots / "elsewhere" / "PAUSE"), "r2": running(roots / "checkpoints" / "PAUSE")})
    assert "not a PAUSE marker beside checkpoints" in api.post("/runs/d/r1", json={}).json()["detail"]
    bad = api.post("/runs/d/r2", json={"at_step": "soon"})
    assert bad.status_code == 400 and "at_step 'soon'" in bad.json()["detail"]
    assert not (roots / "checkpoints" / "PAUSE").exists()


def test_the_marker_on_s3(moto_s3, roots, monkeypatch):
    monkeypatch.setenv("LLMOPS_ALLOWED_STORAGE_ROOTS", "s3://ckpt/runs")
    moto_s3.create_bucket(Bucket="ckpt")
    api = client({"r1": {"state": "deferred", "place": {
        "marker": "s3://ckpt/runs/r1/checkpoints/PAUSE", "why_not": "", "job_name": "p",
        "backend": "batch"}}})
    assert api.post("/runs/d/r1", json={"at_step": 40}).status_code == 200
    body = moto_s3.get_object(Bucket="ckpt", Key="runs/r1/checkpoints/PAUSE")["Body"].read()
    assert json.loads(body)["at_step"] == 40


def test_without_airflow_credentials_nothing_is_written(airflow_db, roots):
    """The app as the API server mounts it (the plugin), with Airflow's own auth manager."""
    from fastapi.testclient import TestClient

    from airflow.api_fastapi.app import create_app

    api = TestClient(create_app())
    path = "/llmops-pause/runs/llm_lifecycle/manual__nope"
    assert api.post(path, json={}).status_code in (401, 403)
    assert api.get(path).status_code in (401, 403)
    home = Path(__import__("os").environ["AIRFLOW_HOME"])
    password = json.loads((home / "simple_auth_manager_passwords.json.generated").read_text())
    token = api.post("/auth/token", json={"username": "admin", "password": password["admin"]}
                     ).json()["access_token"]
    answer = api.post(path, json={}, headers={"Authorization": f"Bearer {token}"})
    # authorized, then refused by the real metadata DB: that run has no pretrain task
    assert answer.status_code == 404 and "has no task 'pretrain'" in answer.json()["detail"]


def test_a_real_local_pretraining_paused_from_the_page_ends_its_task_skipped(
        tiny_data_dir, tmp_path, monkeypatch):
    """The endpoint writes the marker of the run's pretraining (before its first step, so that it
    pauses at exactly step 6); the real job on the local backend checkpoints step 6 and exits;
    the operator ends the task skipped, saying so."""
    from tasks.configs import to_dict
    from tasks.train import checkpoint as ckpt
    from tests.test_pause import PAUSE_AT, cfg_for

    monkeypatch.setenv("LLMOPS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LLMOPS_ALLOWED_STORAGE_ROOTS", str(tmp_path))
    output_dir = tmp_path / "store" / "pretrain"
    cfg = cfg_for(tiny_data_dir, output_dir)
    marker, why = pause_api.marker_place("local", str(output_dir), {})
    place = {"marker": marker, "why_not": why, "backend": "local", "job_name": "pretrain-x"}
    api = client({"r1": {"state": "running", "place": place}})
    assert api.post("/runs/llm_lifecycle/r1", json={"at_step": PAUSE_AT}).status_code == 200

    op = JobOperator(task_id="pretrain", deferrable=False,
                     spec={"stage": "pretrain", "entrypoint": "tasks.pretrain",
                           "config": to_dict(cfg)})
    op._cached_logger = __import__("tests.test_wait_faults", fromlist=["Recorder"]).Recorder()
    ti = RecordingTI()
    with pytest.raises(AirflowSkipException, match=f"paused at step {PAUSE_AT}"):
        op.execute(context(ti=ti, store=FakeStore()))
    assert ti.xcoms[pause_api.XCOM_KEY]["marker"] == marker
    assert any(f"paused at step {PAUSE_AT} on request" in w for w in op.log.warnings())
    checkpoints = output_dir / "checkpoints"
    assert [s for s, _ in ckpt.step_dirs(checkpoints)][0] == PAUSE_AT
    assert not Path(marker).exists(), "the job consumed the marker"
