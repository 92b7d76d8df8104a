"""The SageMaker and Batch backends under what AWS does to a long wait: throttling and 5xx answers
(every client retries adaptively), jobs with more log streams than one DescribeLogStreams page,
failure messages that must not read a whole CloudWatch log, deadlines that count from the job's
start (and spot's own slack), polling every 30 s, job identity that follows the deployment's
settings; and the sweep pool and the MWAA bundle that make deferral mean something."""

from __future__ import annotations

import datetime
import json
import logging
import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import pytest
from airflow.providers.amazon.aws.hooks.batch_client import BatchClientHook

from llmops.infra.aws.validation import validate_request
from llmops.jobs.backends import JobState, remote
from llmops.jobs.backends.batch.batch_backend import BatchBackend
from llmops.jobs.backends.remote_settings import BackendSettingsError
from llmops.jobs.backends.sagemaker.sagemaker_backend import (SageMakerProcessingBackend,
                                                              SageMakerTrainingBackend)
from llmops.jobs.backends.sagemaker.sagemaker_hook import KINDS, SageMakerJobsHook
from llmops.jobs.backends.sagemaker.sagemaker_requests import (SPOT_MAX_WAIT, stopping_condition,
                                                               training_request)
from llmops.jobs.backends.backend_settings import load
from llmops.jobs.backends.sagemaker.sagemaker_settings import SageMakerSettings
from llmops.jobs.spec import JobSpec, job_name
from tests.aws_fixtures import CONN_ID, IMAGE, REGION, ROLE, sagemaker_settings

T0 = datetime.datetime(2026, 1, 5, 12, 0, tzinfo=datetime.timezone.utc)


def sample(name: str, **changes: Any) -> JobSpec:
    spec = JobSpec(stage="sample", entrypoint="tests.sample_job", name=name, config={"seconds": 0.1},
                   instance_type="ml.m5.xlarge", max_run_seconds=3600,
                   env={"MLFLOW_EXPERIMENT_NAME": "sample"})
    return spec.replace(**changes)


@pytest.fixture()
def aws(moto_server):
    moto_server.bucket("llmops-test")
    return moto_server


@pytest.fixture()
def no_backoff(monkeypatch):
    """botocore's retry sleeps (backoff and the adaptive rate limiter) made instant."""
    import botocore.retries.adaptive
    import botocore.retries.standard

    monkeypatch.setattr(botocore.retries.standard.ExponentialBackoff, "delay_amount", lambda self, ctx: 0)
    monkeypatch.setattr(botocore.retries.adaptive.ClientRateLimiter, "on_sending_request",
                        lambda self, request, **kwargs: None)


# -- 1. retries --------------------------------------------------------------------------------

def _aws_connection(monkeypatch, conn_id: str, endpoint: str = "", **extra: Any) -> str:
    extra = {"region_name": REGION, **({"endpoint_url": endpoint} if endpoint else {}), **extra}
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(
        {"conn_type": "aws", "login": "testing", "password": "testing", "extra": extra}))
    return conn_id


def test_every_client_of_the_backends_retries_adaptively(monkeypatch):
    conn = _aws_connection(monkeypatch, "llmops_plain")
    sm = SageMakerJobsHook(aws_conn_id=conn, region_name="eu-west-1")
    from llmops.infra.aws import s3

    clients = {"sagemaker": sm.get_conn(), "sagemaker logs": sm.logs_hook.get_conn(),
               "sagemaker s3": sm.s3_hook.get_conn(), "batch": BatchBackend()._hook(conn).client,
               "staging s3": s3.s3_hook(conn).get_conn()}
    for what, client in clients.items():
        # botocore counts max_attempts as retries: 10 retries, 11 attempts in all.
        assert client.meta.config.retries == {"mode": "adaptive", "total_max_attempts": 11}, what
    # The provider builds its Logs and S3 hooks without the hook's region; ours carry it.
    assert sm.logs_hook.get_conn().meta.region_name == "eu-west-1"
    assert isinstance(BatchBackend()._hook(conn), BatchClientHook)   # its helpers stay available


def test_the_connections_own_botocore_config_is_kept_and_its_retries_win(monkeypatch):
    tuned = _aws_connection(monkeypatch, "llmops_tuned", config_kwargs={"connect_timeout": 7})
    client = SageMakerJobsHook(aws_conn_id=tuned).get_conn()
    assert client.meta.config.connect_timeout == 7
    assert client.meta.config.retries["mode"] == "adaptive"
    admin = _aws_connection(monkeypatch, "llmops_admin",
                            config_kwargs={"retries": {"mode": "standard", "max_attempts": 3}})
    assert SageMakerJobsHook(aws_conn_id=admin).get_conn().meta.config.retries == \
        {"mode": "standard", "total_max_attempts": 4}


class FlakyProxy:
    """An HTTP proxy in front of moto that answers the first `failures` requests whose
    X-Amz-Target ends with `operation` with a ThrottlingException (as SageMaker does)."""

    def __init__(self, upstream: str, operation: str, failures: int):
        self.upstream, self.operation, self.left, self.throttled = upstream, operation, failures, 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("X-Amz-Target", "").endswith(proxy.operation) and proxy.left > 0:
                    proxy.left -= 1
                    proxy.throttled += 1
                    payload = json.dumps({"__type": "ThrottlingException", "message": "Rate exceeded"})
                    self.send_response(400)
                    self.send_header("Content-Type", "application/x-amz-json-1.1")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload.encode())
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                request = urllib.request.Request(proxy.upstream + self.path, data=body or None,
                                                 headers=headers, method=self.command)
                try:
                    response = urllib.request.urlopen(request, timeout=30)
                    status, data, reply_headers = response.status, response.read(), response.headers
                except urllib.error.HTTPError as exc:
                    status, data, reply_headers = exc.code, exc.read(), exc.headers
                self.send_response(status)
                for key, value in reply_headers.items():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def flaky(aws) -> Iterator[FlakyProxy]:
    proxy = FlakyProxy(aws.endpoint, "DescribeTrainingJob", failures=0)
    yield proxy
    proxy.close()


def test_a_throttled_describe_does_not_break_the_wait(aws, flaky, monkeypatch, no_backoff):
    """Six ThrottlingExceptions in a row (botocore's default gives up after five attempts)."""
    backend = SageMakerTrainingBackend(settings={"sagemaker": sagemaker_settings("llmops-test")})
    handle = backend.submit(sample(job_name("sm-throttled", prefix="sm-throttled")))
    handle["aws_conn_id"] = _aws_connection(monkeypatch, "llmops_flaky", flaky.endpoint)
    flaky.left = 6
    status = backend.status(handle)
    assert flaky.throttled == 6
    # moto completes jobs at once and runs no container: the answer is about the job, not the API.
    assert status.details["status"] == "Completed" and "wrote no result" in status.message


# -- 2. and 3. logs ------------------------------------------------------------------------------

def _streams(aws, group: str, streams: dict[str, int], later: tuple[str, ...] = ()) -> None:
    """`count` events in each stream, 1 ms apart; the streams in `later` write 10 s after."""
    logs = aws.client("logs")
    try:
        logs.create_log_group(logGroupName=group)
    except logs.exceptions.ResourceAlreadyExistsException:
        pass
    start = int(time.time() * 1000) - 3_600_000   # CloudWatch refuses events over 14 days old
    for stream, count in streams.items():
        logs.create_log_stream(logGroupName=group, logStreamName=stream)
        for first in range(0, count, 1000):
            logs.put_log_events(logGroupName=group, logStreamName=stream, logEvents=[
                {"timestamp": start + i + (10_000 if stream in later else 0), "message": f"{stream.rsplit('/', 1)[-1]} line {i}"}
                for i in range(first, min(count, first + 1000))])


@pytest.fixture()
def api_calls(monkeypatch) -> list[tuple[str, dict]]:
    """Every AWS call made in the test: (operation, response)."""
    import botocore.client

    calls: list[tuple[str, dict]] = []
    real = botocore.client.BaseClient._make_api_call

    def record(self, operation, params):
        response = real(self, operation, params)
        calls.append((operation, response))
        return response

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", record)
    return calls


def test_a_job_with_64_instances_is_followed_on_its_first_and_its_tail_reads_every_one(aws, api_calls):
    name = job_name("sm-wide", prefix="sm-wide")
    _streams(aws, KINDS["training"][4], {f"{name}/algo-{i}-1767614400": 1 for i in range(1, 65)})
    handle = {"aws_conn_id": CONN_ID, "region_name": "", "job_name": name}
    api_calls.clear()
    lines, cursor = SageMakerTrainingBackend().read_logs(handle, None)
    # a poll reads algo-1 (rank 0's) alone: not algo-10..19, not 64 streams
    assert lines == ["algo-1-1767614400 line 0"] and list(cursor) == [f"{name}/algo-1-1767614400"]
    assert sum(op == "GetLogEvents" for op, _ in api_calls) <= 2
    tail = SageMakerTrainingBackend().log_tail(handle, lines=64)   # DescribeLogStreams pages hold 50
    assert len(tail) == 64 and "[algo-64-1767614400] algo-64-1767614400 line 0" in tail


def test_the_failure_tail_reads_only_the_end_of_each_stream(aws, api_calls):
    name = job_name("sm-tail", prefix="sm-tail")
    crashed = f"{name}/algo-2-1767614400"   # the instance whose traceback came last
    _streams(aws, KINDS["training"][4], {f"{name}/algo-1-1767614400": 3000, crashed: 5}, later=(crashed,))
    handle = {"aws_conn_id": CONN_ID, "region_name": "", "job_name": name}
    tail = SageMakerTrainingBackend().log_tail(handle, lines=40)
    assert len(tail) == 40
    assert tail[-6:] == ["[algo-1-1767614400] algo-1-1767614400 line 2999",
                         *(f"[algo-2-1767614400] algo-2-1767614400 line {i}" for i in range(5))]
    reads = [response for operation, response in api_calls if operation == "GetLogEvents"]
    assert len(reads) == 2, "one GetLogEvents per stream"
    assert sum(len(r["events"]) for r in reads) <= 80, "never the whole log"


class FakeBatchClient:
    """DescribeJobs of a multi-node job with `nodes` nodes, each with its own log stream."""

    def __init__(self, job: dict, nodes: int = 0):
        self.job, self.nodes, self.calls = job, nodes, []

    def describe_jobs(self, jobs):
        self.calls.append(list(jobs))
        assert len(jobs) <= 100, "DescribeJobs takes at most 100 ids"
        out = []
        for job_id in jobs:
            if job_id == self.job["jobId"]:
                out.append(self.job)
            elif "#" in job_id and int(job_id.split("#")[1]) < self.nodes:
                out.append({"jobId": job_id, "status": "RUNNING", "container": {
                    "logStreamName": f"llmops-pretrain/default/node{job_id.split('#')[1]}"}})
        return {"jobs": out}


def fake_batch(monkeypatch, client: FakeBatchClient) -> None:
    class Hook:
        pass

    hook = Hook()
    hook.client = client
    hook.delay = lambda seconds: None
    hook.exponential_delay = BatchClientHook.exponential_delay
    monkeypatch.setattr(BatchBackend, "_hook", lambda self, conn, region="": hook)


def test_a_multi_node_batch_job_is_followed_on_its_main_node_and_its_failure_reads_every_node(
        aws, monkeypatch, api_calls):
    parent = {"jobId": "mnp-1", "status": "RUNNING", "startedAt": 1767614400123,
              "nodeProperties": {"numNodes": 120, "mainNode": 0, "nodeRangeProperties": [
                  {"targetNodes": "0:", "container": {"logConfiguration": {"logDriver": "awslogs"}}}]}}
    client = FakeBatchClient(parent, nodes=120)
    fake_batch(monkeypatch, client)
    _streams(aws, "/aws/batch/job", {f"llmops-pretrain/default/node{i}": 100 if i == 7 else 1
                                     for i in range(120)})
    handle = {"aws_conn_id": CONN_ID, "region_name": REGION, "job_id": "mnp-1", "job_name": "mnp"}
    lines, cursor = BatchBackend().read_logs(handle, None)
    # one poll: the parent, the main node's job, one stream read to its end (was: 120 streams)
    assert len(cursor) == 1 and lines == ["node0 line 0"]
    assert [len(c) for c in client.calls] == [1, 1]
    assert sum(op == "GetLogEvents" for op, _ in api_calls) <= 2
    client.calls.clear()
    api_calls.clear()
    tail = BatchBackend().log_tail(handle, lines=10)
    assert tail[-1] == "[node7] node7 line 99" and len(tail) == 10
    assert sum(len(r["events"]) for op, r in api_calls if op == "GetLogEvents") <= 120 * 10


# -- 4. deadlines --------------------------------------------------------------------------------

class FakeSageMakerHook:
    def __init__(self, description: dict):
        self.description = description

    def describe_job(self, kind, name):
        return self.description

    def status_of(self, kind, description):
        return description[KINDS[kind][2]]


def _sm_status(monkeypatch, backend, description: dict):
    monkeypatch.setattr(type(backend), "_hook", lambda self, conn, region="": FakeSageMakerHook(description))
    return backend.status({"aws_conn_id": CONN_ID, "job_name": "j", "result_uri": "s3://b/r.json"})


def test_a_training_job_starts_when_it_trains_not_when_its_instances_are_billed(monkeypatch):
    backend = SageMakerTrainingBackend()
    downloading = {"TrainingJobStatus": "InProgress", "SecondaryStatus": "Downloading",
                   "TrainingStartTime": T0,   # set already: the instances are up, the data is not
                   "SecondaryStatusTransitions": [{"Status": "Starting", "StartTime": T0},
                                                  {"Status": "Downloading", "StartTime": T0}]}
    status = _sm_status(monkeypatch, backend, downloading)
    assert status.state is JobState.PENDING and "started_at" not in status.details
    training = dict(downloading, SecondaryStatus="Training", SecondaryStatusTransitions=[
        *downloading["SecondaryStatusTransitions"],
        {"Status": "Training", "StartTime": T0 + datetime.timedelta(minutes=9)}])
    status = _sm_status(monkeypatch, backend, training)
    assert status.state is JobState.RUNNING
    assert status.details["started_at"] == T0.timestamp() + 540
    # A spot interruption: waiting again, but the job did start (its deadline counts from then).
    interrupted = dict(training, SecondaryStatus="Interrupted")
    status = _sm_status(monkeypatch, backend, interrupted)
    assert status.state is JobState.PENDING and status.details["started_at"] == T0.timestamp() + 540


def test_a_processing_job_runs_from_its_processing_start_time(monkeypatch):
    backend = SageMakerProcessingBackend()
    status = _sm_status(monkeypatch, backend, {"ProcessingJobStatus": "InProgress"})
    assert status.state is JobState.PENDING and "started_at" not in status.details
    status = _sm_status(monkeypatch, backend, {"ProcessingJobStatus": "InProgress", "ProcessingStartTime": T0})
    assert status.state is JobState.RUNNING and status.details["started_at"] == T0.timestamp()


def test_a_batch_job_starts_at_its_current_attempts_started_at(monkeypatch):
    job = {"jobId": "b-1", "status": "RUNNING", "startedAt": 1767614400500,
           "attempts": [{"startedAt": 1767610000000, "stoppedAt": 1767613000000}]}
    fake_batch(monkeypatch, FakeBatchClient(job))
    status = BatchBackend().status({"aws_conn_id": CONN_ID, "job_id": "b-1", "job_name": "b"})
    assert status.state is JobState.RUNNING and status.details["started_at"] == 1767614400.5
    fake_batch(monkeypatch, FakeBatchClient({"jobId": "b-1", "status": "RUNNABLE"}))
    assert "started_at" not in BatchBackend().status({"aws_conn_id": CONN_ID, "job_id": "b-1",
                                                      "job_name": "b"}).details


def test_a_batch_job_not_visible_yet_is_asked_for_again_before_it_counts_as_missing(monkeypatch):
    client = FakeBatchClient({"jobId": "other", "status": "RUNNING"})
    fake_batch(monkeypatch, client)
    status = BatchBackend().status({"aws_conn_id": CONN_ID, "job_id": "b-2", "job_name": "b"})
    assert status.state is JobState.FAILED and "no job b-2" in status.message
    assert len(client.calls) == 4


def render(spec: JobSpec, **settings: Any) -> dict:
    cfg = SageMakerSettings(role_arn=ROLE, staging_uri="s3://b/staging", image=IMAGE, **settings)
    request, _ = training_request(spec, cfg, remote.plan(spec, spec.name, "s3://b/staging"), spec.name)
    validate_request("sagemaker", "CreateTrainingJob", request)
    return request["StoppingCondition"]


def test_spot_waits_a_multiple_of_the_run_time_within_the_service_limit():
    spec = sample("sm-spot-0123456789ab", max_run_seconds=36_000)
    assert render(spec) == {"MaxRuntimeInSeconds": 36_000}
    assert render(spec, spot=True) == {"MaxRuntimeInSeconds": 36_000, "MaxWaitTimeInSeconds": 72_000}
    assert render(spec, spot=True, spot_wait_factor=1.5) == {"MaxRuntimeInSeconds": 36_000,
                                                             "MaxWaitTimeInSeconds": 54_000}
    assert render(spec, spot=True, max_wait_seconds=40_000) == {"MaxRuntimeInSeconds": 36_000,
                                                                "MaxWaitTimeInSeconds": 40_000}
    long = sample("sm-spot-0123456789ab", max_run_seconds=20 * 24 * 3600)
    assert render(long, spot=True)["MaxWaitTimeInSeconds"] == SPOT_MAX_WAIT
    for cfg in ({"spot_wait_factor": 0.5}, {"poll_interval_seconds": 2}, {"deadline_grace_seconds": -1}):
        with pytest.raises(BackendSettingsError, match=next(iter(cfg))):
            load("sagemaker", SageMakerSettings, {"sagemaker": cfg})


def test_the_handle_says_how_often_to_poll_and_how_long_past_the_run_time_to_wait(aws):
    backend = SageMakerTrainingBackend(settings={"sagemaker": sagemaker_settings(
        "llmops-test", spot=True, poll_interval_seconds=60, deadline_grace_seconds=600)})
    spec = sample(job_name("sm-handle", prefix="sm-handle"))
    handle = backend.submit(spec)
    assert handle["poll_interval"] == 60.0
    # Spot may wait and restart for 3600 s beyond the run time (factor 2) before SageMaker ends it.
    assert handle["deadline_grace_seconds"] == 600 + 3600
    assert stopping_condition(spec, load("sagemaker", SageMakerSettings, backend._settings)) == \
        {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 7200}
    assert backend.submit(spec)["deadline_grace_seconds"] == 4200   # reattached: the same
    processing = SageMakerProcessingBackend(settings={"sagemaker_processing": sagemaker_settings("llmops-test")})
    handle = processing.submit(sample(job_name("proc-handle", prefix="proc-handle")))
    assert handle["poll_interval"] == 30.0 and handle["deadline_grace_seconds"] == 1800


# -- 6. identity --------------------------------------------------------------------------------

def test_a_changed_deployment_setting_changes_the_fingerprint_without_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("fingerprint must not touch the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    spec = sample("fp-0123456789ab", stage="pretrain")
    base = {"role_arn": ROLE, "staging_uri": "s3://b/s", "image": IMAGE, "instance_type": "ml.g5.2xlarge"}

    def fp(backend_cls, key, **changes):
        return backend_cls(settings={key: {**base, **changes}}).fingerprint(spec)

    for cls, key in ((SageMakerTrainingBackend, "sagemaker"), (SageMakerProcessingBackend, "sagemaker_processing")):
        same = fp(cls, key)
        assert len(same) == 12 and same == fp(cls, key)
        assert fp(cls, key, image=IMAGE + "-v2") != same
        assert fp(cls, key, role_arn=ROLE + "-2") != same
        assert fp(cls, key, stages={"pretrain": {"instance_type": "ml.p5.48xlarge"}}) != same
        assert fp(cls, key, stages={"finetune": {"instance_type": "ml.p5.48xlarge"}}) == same
        assert fp(cls, key, poll_interval_seconds=120, deadline_grace_seconds=60) == same
    batch = {"job_queue": "q", "staging_uri": "s3://b/s", "image": IMAGE}
    one = BatchBackend(settings={"batch": batch}).fingerprint(spec)
    assert one != BatchBackend(settings={"batch": {**batch, "gpus": 8}}).fingerprint(spec)


# -- 7. the sweep pool ----------------------------------------------------------------------------

def test_the_sweep_pool_counts_deferred_trials_and_an_old_pool_is_fixed(airflow_db, caplog):
    from airflow.models.pool import Pool

    from llmops.airflow.sweep_pool import POOL, ensure_pool

    assert Pool.get_pool(POOL).include_deferred, "set-up (python -m llmops.airflow.sweep_pool) counts them"
    name = "llmops_sweep_old"
    Pool.create_or_update_pool(name, 3, "made by an older release", include_deferred=False)
    with caplog.at_level(logging.WARNING, logger="llmops.airflow.sweep_pool"):
        assert ensure_pool(name, slots=2) == (3, False)
    pool = Pool.get_pool(name)
    assert pool.include_deferred and pool.slots == 3 and pool.description == "made by an older release"
    assert "did not count deferred tasks" in caplog.text
    assert ensure_pool("llmops_sweep_new", slots=4) == (4, True)
    assert Pool.get_pool("llmops_sweep_new").include_deferred


# -- 8. the MWAA bundle ---------------------------------------------------------------------------

def test_the_mwaa_bundle_turns_deferral_on(tmp_path):
    import sys

    from tests.aws_fixtures import ROOT

    sys.path.insert(0, str(ROOT / "scripts"))
    import mwaa_bundle

    out = mwaa_bundle.build(tmp_path / "mwaa", "https://mlflow.example.com", "s3://b/llmops")
    options = json.loads((out / "airflow_configuration_options.json").read_text())
    assert options["operators.default_deferrable"] == "True"
    # workers' API calls outlast an API server restart (the matrix's restart row)
    assert int(options["workers.execution_api_retries"]) >= 10
    # What `aws mwaa update-environment --airflow-configuration-options file://...` sends.
    validate_request("mwaa", "UpdateEnvironment", {"Name": "llmops", "AirflowConfigurationOptions": options})
