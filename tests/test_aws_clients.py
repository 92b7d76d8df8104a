"""One AWS client per connection and region in a process (llmops.infra.aws.clients), and bounded log
reads per poll: polls and triggers reuse the clients, an edited connection gets new ones, a
role's credentials refresh inside a cached client, and a Batch poll reads the main node's stream
plus the end of a node that failed, never every node's."""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import botocore.session
import pytest

from llmops.infra.aws import clients, s3
from llmops.jobs.backends import JobState, get_backend
from llmops.jobs.backends.batch.batch_backend import BatchBackend
from tests.aws_fixtures import REGION

CONN = "llmops_clients"


@pytest.fixture()
def conn(moto_server, monkeypatch):
    """An Airflow connection of its own to the session's moto, and an empty client cache."""
    def define(**extra):
        monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", json.dumps({
            "conn_type": "aws", "login": "testing", "password": "testing",
            "extra": {"region_name": REGION, "endpoint_url": moto_server.endpoint, **extra}}))

    define()
    clients.clear()
    yield define
    clients.clear()


@pytest.fixture()
def constructions(monkeypatch):
    """Every botocore client made in this process, by service."""
    made: list[str] = []
    lock = threading.Lock()
    real = botocore.session.Session.create_client

    def counting(self, service_name, *args, **kwargs):
        with lock:
            made.append(service_name)
        return real(self, service_name, *args, **kwargs)

    monkeypatch.setattr(botocore.session.Session, "create_client", counting)
    return made


def _finished_training_job(moto, name: str) -> dict:
    """A SageMaker training job (moto: Completed at once) with its result in S3, and its handle."""
    bucket = moto.bucket("llmops-clients")
    prefix = f"s3://{bucket}/staging/{name}/{name}"
    moto.client("sagemaker").create_training_job(
        TrainingJobName=name, RoleArn="arn:aws:iam::123456789012:role/sm",
        AlgorithmSpecification={"TrainingImage": "img:1", "TrainingInputMode": "File"},
        OutputDataConfig={"S3OutputPath": f"{prefix}/output"},
        ResourceConfig={"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 10},
        StoppingCondition={"MaxRuntimeInSeconds": 600})
    moto.client("s3").put_object(Bucket=bucket, Key=f"staging/{name}/{name}/result.json",
                                 Body=json.dumps({"metrics": {"loss": 1.5}}).encode())
    return {"backend": "sagemaker", "name": name, "job_name": name, "aws_conn_id": CONN,
            "region_name": REGION, "result_uri": f"{prefix}/result.json", "copy_back": {}}


def test_polls_and_triggers_share_one_client_per_service_and_an_edited_connection_gets_new_ones(
        conn, constructions, moto_server):
    handle = _finished_training_job(moto_server, "clients-poll")
    constructions.clear()   # the test's own clients to moto

    def poll(_):   # what each trigger's poll does, each in a thread of the triggerer's pool
        backend = get_backend("sagemaker")   # a trigger builds its own backend
        backend.read_logs(handle, None)
        return backend.status(handle)

    assert poll(0).state is JobState.SUCCEEDED
    first = sorted(constructions)
    assert first == ["logs", "s3", "sagemaker"], first   # one of each, for the first poll
    with ThreadPoolExecutor(6) as pool:
        statuses = list(pool.map(poll, range(30)))
    assert all(s.state is JobState.SUCCEEDED and s.result == {"metrics": {"loss": 1.5}} for s in statuses)
    assert sorted(constructions) == first, "30 polls from 6 threads built no client"

    conn(config_kwargs={"connect_timeout": 7})   # an admin edits the connection
    assert poll(0).state is JobState.SUCCEEDED
    assert sorted(constructions) == sorted(first * 2), "the edited connection got new clients"
    from llmops.jobs.backends.sagemaker.sagemaker_hook import jobs_hook

    assert jobs_hook(CONN, REGION).get_conn().meta.config.connect_timeout == 7


def test_a_connection_outside_the_environment_is_read_again_after_the_recheck_interval(
        conn, constructions, monkeypatch):
    """A connection in the DB or a secrets backend costs a round trip: it is read again every
    RECHECK_SECONDS, not on every poll, and a change then gives a new client."""
    from airflow.sdk import BaseHook, Connection

    definition = json.loads(os.environ[f"AIRFLOW_CONN_{CONN.upper()}"])
    monkeypatch.delenv(f"AIRFLOW_CONN_{CONN.upper()}")
    reads = []

    def get_connection(conn_id):
        reads.append(conn_id)
        return Connection.from_json(json.dumps(definition), conn_id=conn_id)

    monkeypatch.setattr(BaseHook, "get_connection", classmethod(lambda cls, conn_id: get_connection(conn_id)))
    now = [1000.0]
    monkeypatch.setattr(clients.time, "monotonic", lambda: now[0])
    first = s3.s3_hook(CONN, REGION)
    looked_up = len(reads)
    definition["extra"]["config_kwargs"] = {"read_timeout": 9}
    assert s3.s3_hook(CONN, REGION) is first and len(reads) == looked_up, "not read again yet"
    now[0] += clients.RECHECK_SECONDS + 1
    second = s3.s3_hook(CONN, REGION)
    assert second is not first and second.get_conn().meta.config.read_timeout == 9
    assert constructions.count("s3") == 2


def test_a_cached_clients_assumed_role_credentials_refresh_before_they_expire(conn, constructions, moto_server):
    """A role_arn connection: the cached client keeps the provider's RefreshableCredentials, so
    credentials past their expiry are assumed again (moto's STS), not pinned."""
    conn(role_arn="arn:aws:iam::123456789012:role/llmops-airflow",
         service_config={"sts": {"endpoint_url": moto_server.endpoint}})
    hook = s3.s3_hook(CONN, REGION)
    client = hook.get_conn()
    client.list_buckets()
    credentials = client._request_signer._credentials
    before = credentials.get_frozen_credentials().access_key
    credentials._expiry_time = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=1)
    client.list_buckets()   # signs with fresh credentials: AssumeRole again
    assert credentials.get_frozen_credentials().access_key != before
    assert s3.s3_hook(CONN, REGION).get_conn() is client and constructions.count("s3") == 1


class NodeJobs:
    """DescribeJobs of a 4-node job's node jobs: node 2 failed, the others run."""

    def __init__(self, job_id: str, streams: dict[int, str]):
        self.job_id, self.streams, self.calls = job_id, streams, []

    def describe_jobs(self, jobs):
        self.calls.append(list(jobs))
        out = []
        for node_id in jobs:
            index = int(node_id.split("#")[1])
            failed = index == 2
            out.append({"jobId": node_id, "status": "FAILED" if failed else "RUNNING",
                        "nodeDetails": {"nodeIndex": index, "isMainNode": index == 0},
                        "container": {"logStreamName": self.streams[index],
                                      **({"exitCode": 1} if failed else {})}})
        return {"jobs": out}


def test_a_batch_poll_reads_the_main_node_and_the_end_of_a_failed_node_only(moto_server, monkeypatch):
    logs = moto_server.client("logs")
    group = "/aws/batch/job"
    try:
        logs.create_log_group(logGroupName=group)
    except logs.exceptions.ResourceAlreadyExistsException:
        pass
    streams = {i: f"llmops-pretrain/default/clients-{i}" for i in range(4)}
    now = int(time.time() * 1000)   # CloudWatch refuses events older than 14 days
    for index, stream in streams.items():
        logs.create_log_stream(logGroupName=group, logStreamName=stream)
        logs.put_log_events(logGroupName=group, logStreamName=stream, logEvents=[
            {"timestamp": now - 100_000 + n, "message": f"node {index} line {n}"} for n in range(100)])
    reads = []
    real_get = logs.get_log_events
    logs.get_log_events = lambda **kw: reads.append(kw["logStreamName"]) or real_get(**kw)
    nodes = NodeJobs("job-1", streams)
    monkeypatch.setattr(BatchBackend, "_hook", lambda self, *a, **k: type("Hook", (), {"client": nodes}))
    monkeypatch.setattr("llmops.jobs.backends.batch.batch_hook.logs_client", lambda conn_id, region=None: logs)
    handle = {"backend": "batch", "job_id": "job-1", "job_name": "clients-batch", "aws_conn_id": CONN,
              "region_name": REGION, "instance_count": 4}

    lines, cursor = BatchBackend().read_logs(handle, None)
    failed = [line for line in lines if line.startswith("[node 2 failed] ")]
    assert [line.split("] ", 1)[1] for line in failed] == [f"node 2 line {n}" for n in range(60, 100)]
    assert sum("node 0 line" in line for line in lines) == 100
    assert not any("node 1 line" in line or "node 3 line" in line for line in lines), "healthy nodes unread"
    assert nodes.calls == [["job-1#0", "job-1#1", "job-1#2", "job-1#3"]], "one DescribeJobs for all nodes"

    logs.put_log_events(logGroupName=group, logStreamName=streams[0], logEvents=[
        {"timestamp": now, "message": "node 0 step 101"}])
    reads.clear()
    lines, cursor = BatchBackend().read_logs(handle, cursor)
    assert lines == ["[clients-0] node 0 step 101"], "the failed node's end is shown once"
    assert sorted(reads) == sorted([streams[0], streams[2]]) and len(nodes.calls) == 2


def test_a_sagemaker_poll_reads_algo_1_with_one_call_and_lists_streams_only_when_quiet(conn, moto_server):
    from llmops.jobs.backends.batch.batch_hook import logs_client
    from llmops.jobs.backends.sagemaker.sagemaker_backend import SageMakerTrainingBackend
    from llmops.jobs.backends.sagemaker.sagemaker_hook import KINDS

    group, name = KINDS["training"][4], "clients-sm-logs"
    direct = moto_server.client("logs")
    try:
        direct.create_log_group(logGroupName=group)
    except direct.exceptions.ResourceAlreadyExistsException:
        pass
    now = int(time.time() * 1000)
    for stream in (f"{name}/algo-1-1767614400", f"{name}/algo-2-1767614400"):
        direct.create_log_stream(logGroupName=group, logStreamName=stream)
        direct.put_log_events(logGroupName=group, logStreamName=stream, logEvents=[
            {"timestamp": now - 1000 + n, "message": f"{stream[-17:-11]} line {n}"} for n in range(3)])
    client = logs_client(CONN, REGION)   # the process's client, which the backend's hook shares
    calls = []
    for op in ("get_log_events", "get_paginator"):
        real = getattr(client, op)
        setattr(client, op, lambda *a, _op=op, _real=real, **k: calls.append(_op) or _real(*a, **k))
    backend, handle = SageMakerTrainingBackend(), {"aws_conn_id": CONN, "region_name": REGION, "job_name": name}
    try:
        lines, cursor = backend.read_logs(handle, None)
        assert lines == ["algo-1 line 0", "algo-1 line 1", "algo-1 line 2"], "rank 0's stream alone"
        direct.put_log_events(logGroupName=group, logStreamName=f"{name}/algo-1-1767614400",
                              logEvents=[{"timestamp": now, "message": "algo-1 step 4"}])
        calls.clear()
        lines, cursor = backend.read_logs(handle, cursor)
        assert lines == ["algo-1 step 4"] and calls == ["get_log_events"], calls   # no listing
        calls.clear()
        lines, cursor = backend.read_logs(handle, cursor)
        assert lines == [] and calls == ["get_log_events", "get_paginator"], calls   # quiet: look again
    finally:
        del client.get_log_events, client.get_paginator
