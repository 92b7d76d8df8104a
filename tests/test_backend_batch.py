"""The AWS Batch backend: a multi-node parallel job with the run's team as fair-share identifier
and its priority as scheduling priority (on a queue with a fair-share policy only), a copy of a
resent SubmitJob terminated, checked against botocore's model and run against moto
(submit, poll, result, reattach, stop, fail), and its launch command started for real on this
machine as two Batch nodes would start it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmops.infra.aws.validation import validate_request
from llmops.jobs.backends import JobState, remote
from llmops.jobs.backends.batch.batch_backend import BatchBackend
from llmops.jobs.backends.batch.batch_requests import job_definition, submit_request
from llmops.jobs.backends.batch.batch_settings import BatchSettings
from llmops.jobs.spec import JobSpec, JobSpecError, job_name
from tests.aws_fixtures import CONN_ID, ENTRY, IMAGE, ROOT, Moto, free_port, stop_process_group, wait_http

QUEUE = "llmops-gpu"


def settings(**changes) -> dict:
    return {"batch": {"aws_conn_id": CONN_ID, "job_queue": QUEUE, "staging_uri": "s3://llmops-test/staging",
                      "image": IMAGE, "gpus": 8, "efa_devices": 4, "vcpus": 96, "memory_mib": 1_000_000,
                      "instance_type": "p4d.24xlarge", "retry_attempts": 3, "shared_memory_mib": 65536,
                      **changes}}


def pretrain(name: str, **changes) -> JobSpec:
    spec = JobSpec(stage="pretrain", entrypoint="tests.sample_job", name=name, config={"seconds": 0.1},
                   instance_count=2, nproc_per_node=8, max_run_seconds=3 * 24 * 3600,
                   env={"MLFLOW_RUN_ID": "abc123"}, tags={"team": "research", "priority": "70"})
    return spec.replace(**changes)


def test_multi_node_request_carries_nodes_fair_share_and_priority():
    spec = pretrain(job_name("b", prefix="pretrain"))
    cfg = BatchSettings(**{k: v for k, v in settings()["batch"].items()})
    staged = remote.plan(spec, spec.name, cfg.staging_uri)
    definition = job_definition(spec, cfg, IMAGE, 2)
    validate_request("batch", "RegisterJobDefinition", definition)
    container = definition["nodeProperties"]["nodeRangeProperties"][0]["container"]
    assert definition["type"] == "multinode" and definition["nodeProperties"]["mainNode"] == 0
    assert {"type": "GPU", "value": "8"} in container["resourceRequirements"]
    assert len(container["linuxParameters"]["devices"]) == 4            # EFA devices
    assert container["ulimits"] == [{"name": "memlock", "softLimit": -1, "hardLimit": -1}]
    request = submit_request(spec, cfg, staged, spec.name, "arn:aws:batch:us-east-1:1:job-definition/x:1")
    validate_request("batch", "SubmitJob", request)
    assert request["shareIdentifier"] == "research" and request["schedulingPriorityOverride"] == 70
    assert request["nodeOverrides"]["numNodes"] == 2
    overrides = request["nodeOverrides"]["nodePropertyOverrides"][0]["containerOverrides"]
    assert overrides["instanceType"] == "p4d.24xlarge"
    command = overrides["command"]
    assert command[:2] == ["python3", "/opt/llmops/job_entry.py"]
    assert command[command.index("--launcher") + 1] == "torchrun"
    env = {e["name"]: e["value"] for e in overrides["environment"]}
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1" and env["MLFLOW_RUN_ID"] == "abc123"
    assert request["timeout"] == {"attemptDurationSeconds": 3 * 24 * 3600}
    assert request["retryStrategy"]["evaluateOnExit"][0] == {"onStatusReason": "Host EC2*", "action": "RETRY"}


@pytest.mark.parametrize("tags, message", [({"team": "ml-research"}, "fair-share identifier"),
                                           ({"priority": "10000"}, "0-9999")])
def test_scheduling_values_batch_would_refuse_are_refused_first(tags, message):
    spec = pretrain("pretrain-0123456789ab", tags=tags)
    cfg = BatchSettings(**settings()["batch"])
    with pytest.raises(JobSpecError, match=message):
        submit_request(spec, cfg, remote.plan(spec, spec.name, cfg.staging_uri), spec.name, "arn")


def _queue(moto: Moto) -> None:
    batch, iam = moto.client("batch"), moto.client("iam")
    if batch.describe_job_queues(jobQueues=[QUEUE])["jobQueues"]:
        return
    role = iam.create_role(RoleName=f"batch-{QUEUE}", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    env = batch.create_compute_environment(computeEnvironmentName="gpu", type="UNMANAGED",
                                           state="ENABLED", serviceRole=role)
    policy = batch.create_scheduling_policy(name="teams", fairsharePolicy={
        "shareDecaySeconds": 3600, "shareDistribution": [{"shareIdentifier": "research", "weightFactor": 1.0}]})
    batch.create_job_queue(jobQueueName=QUEUE, state="ENABLED", priority=1,
                           schedulingPolicyArn=policy["arn"],
                           computeEnvironmentOrder=[{"order": 1, "computeEnvironment": env["computeEnvironmentArn"]}])


@pytest.fixture()
def aws(moto_server):
    moto_server.bucket("llmops-test")
    _queue(moto_server)
    return moto_server


def staged_request(moto: Moto, handle: dict) -> dict:
    bucket, key = handle["staging_prefix"][len("s3://"):].split("/", 1)
    body = moto.client("s3").get_object(Bucket=bucket, Key=f"{key}/request.json")["Body"]
    return json.loads(body.read())


def test_submit_poll_reattach_and_stop_against_moto(aws, tmp_path):
    backend = BatchBackend(settings=settings())
    spec = pretrain(job_name("batch-ok", prefix="pretrain"))
    handle = backend.submit(spec)
    assert handle["reattached"] is False
    sent = staged_request(aws, handle)
    validate_request("batch", "SubmitJob", sent)   # what went to Batch, share and priority included
    assert sent["shareIdentifier"] == "research" and sent["schedulingPriorityOverride"] == 70
    described = aws.client("batch").describe_jobs(jobs=[handle["job_id"]])["jobs"][0]
    assert described["nodeProperties"]["numNodes"] == 2
    # moto marks Batch jobs SUCCEEDED at once without running the container: no result yet.
    status = backend.status(handle)
    assert status.details["status"] == "SUCCEEDED" and status.state is JobState.FAILED
    assert "wrote no result" in status.message
    # The main node's entry would write this; write it as it would, then poll again.
    aws.client("s3").put_object(Bucket="llmops-test", Key=handle["result_uri"].split("/", 3)[3],
                                Body=json.dumps({"metrics": {"answer": 42.0}}).encode())
    assert backend.status(handle).result == {"metrics": {"answer": 42.0}}
    again = backend.submit(spec)
    assert again["reattached"] is True and again["job_id"] == handle["job_id"]
    jobs = aws.client("batch").list_jobs(jobQueue=QUEUE, filters=[{"name": "JOB_NAME", "values": [spec.name]}])
    assert len(jobs["jobSummaryList"]) == 1, "a retried task must not submit a second job"
    backend.stop(again)   # TerminateJob is accepted; on a finished job it changes nothing
    described = aws.client("batch").describe_jobs(jobs=[handle["job_id"]])["jobs"][0]
    assert described["statusReason"].startswith("Stopped by its Airflow task")
    # The job definition is reused while nothing about it changes.
    backend.submit(pretrain(job_name("batch-ok-2", prefix="pretrain")))
    definitions = aws.client("batch").describe_job_definitions(jobDefinitionName="llmops-pretrain",
                                                               status="ACTIVE")["jobDefinitions"]
    assert len(definitions) == 1


def test_a_failed_job_is_reported_and_retried_as_a_new_attempt(tmp_path):
    """A moto server whose Batch jobs fail (MOTO_SIMPLE_BATCH_FAIL_AFTER)."""
    port = free_port()
    env = {**os.environ, "MOTO_SIMPLE_BATCH_FAIL_AFTER": "0"}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1",
                             "-p", str(port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    conn = "llmops_aws_failing"
    try:
        moto = Moto(f"http://127.0.0.1:{port}")
        wait_http(f"{moto.endpoint}/moto-api/")
        moto.api("config", {"batch": {"use_docker": False}})
        os.environ[f"AIRFLOW_CONN_{conn.upper()}"] = json.dumps(
            {"conn_type": "aws", "login": "testing", "password": "testing",
             "extra": {"region_name": "us-east-1", "endpoint_url": moto.endpoint}})
        moto.bucket("llmops-test")
        _queue(moto)
        backend = BatchBackend(settings=settings(aws_conn_id=conn))
        spec = pretrain(job_name("batch-fail", prefix="pretrain"))
        handle = backend.submit(spec)
        status = backend.status(handle)
        assert status.state is JobState.FAILED and status.message.startswith(f"Batch job {spec.name} failed")
        retry = backend.submit(spec)
        assert retry["reattached"] is False and retry["job_name"] == f"{spec.name}-r2"
    finally:
        os.environ.pop(f"AIRFLOW_CONN_{conn.upper()}", None)
        stop_process_group(proc)


def test_the_launch_command_runs_two_nodes_with_torchrun(tmp_path):
    """Two entry processes given the variables Batch gives node 0 and node 1 of a multi-node
    job: torchrun rendezvous between them, and only the main node writes the result."""
    port = str(free_port())
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"seconds": 0.2}))
    procs = []
    for node in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_BATCH_JOB_NUM_NODES": "2",
               "AWS_BATCH_JOB_NODE_INDEX": str(node), "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0",
               "MASTER_PORT": port, "LLMOPS_WORKDIR": str(tmp_path / f"node{node}")}
        if node:
            env["AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS"] = "127.0.0.1"
        else:
            env["MASTER_ADDR"] = "127.0.0.1"
        procs.append(subprocess.Popen(
            [sys.executable, str(ENTRY), "--entrypoint", "tests.sample_job", "--config", str(config),
             "--result", str(tmp_path / "result.json"), "--launcher", "torchrun",
             "--nproc-per-node", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "--nnodes=2 --node_rank=0" in outputs[0] and "--nnodes=2 --node_rank=1" in outputs[1]
    assert all("sample job starting" in out for out in outputs)
    assert json.loads((tmp_path / "result.json").read_text())["metrics"] == {"answer": 42.0}
    assert "llmops.entry: result written" in outputs[0]
    assert "llmops.entry: result written" not in outputs[1]


# -- idempotent submission: the window between SubmitJob and recording the job id --------------

class WorkerDied(BaseException):
    """The worker process going away (not an exception a try would handle)."""


class LaggyBatch:
    """moto's Batch client, with ListJobs as eventually consistent as the real one (a new job
    is missing from the next `lag` listings) and a worker that can die around SubmitJob."""

    def __init__(self, client):
        self._client, self.lag, self.hidden = client, 0, 0
        self.die_after_submit = False

    def __getattr__(self, name):
        return getattr(self._client, name)

    def submit_job(self, **kwargs):
        out = self._client.submit_job(**kwargs)
        self.hidden = self.lag
        if self.die_after_submit:
            self.die_after_submit = False
            raise WorkerDied("killed right after SubmitJob returned")
        return out

    def list_jobs(self, **kwargs):
        if self.hidden:
            self.hidden -= 1
            return {"jobSummaryList": []}
        return self._client.list_jobs(**kwargs)


@pytest.fixture()
def laggy(aws, monkeypatch):
    from llmops.jobs.backends.batch import batch_backend as batch

    real = BatchBackend._hook
    client = {}

    class Hook:
        def __init__(self, inner):
            self._inner = inner
            if "batch" not in client:
                client["batch"] = LaggyBatch(inner.client)
            self.client = client["batch"]

        def __getattr__(self, name):
            return getattr(self._inner, name)

    monkeypatch.setattr(BatchBackend, "_hook", lambda self, *a, **k: Hook(real(self, *a, **k)))
    monkeypatch.setattr(batch, "LIST_INTERVAL_SECONDS", 0.05)
    BatchBackend(settings=settings())._hook(CONN_ID)   # make the client
    return client["batch"]


def _jobs_named(aws, name: str) -> list[dict]:
    return aws.client("batch").list_jobs(jobQueue=QUEUE, filters=[{"name": "JOB_NAME", "values": [name]}])[
        "jobSummaryList"]


def test_a_worker_killed_right_after_submit_job_does_not_lead_to_a_second_job(aws, laggy):
    backend = BatchBackend(settings=settings())
    spec = pretrain(job_name("batch-crash-after", prefix="pretrain"))
    laggy.lag, laggy.die_after_submit = 3, True   # the retry's first listings miss the job
    with pytest.raises(WorkerDied):
        backend.submit(spec)
    [job] = _jobs_named(aws, spec.name)
    retry = backend.submit(spec)
    assert retry["job_id"] == job["jobId"] and retry["reattached"] is True
    assert len(_jobs_named(aws, spec.name)) == 1, "the retry must not submit a second multi-node job"
    # The retry recorded the id it found: the next one describes the job, without listing.
    bucket, key = retry["staging_prefix"][len("s3://"):].split("/", 1)
    record = json.loads(aws.client("s3").get_object(Bucket=bucket, Key=f"{key}/batch-job.json")["Body"].read())
    assert record["job_id"] == job["jobId"]
    described = aws.client("batch").describe_jobs(jobs=[job["jobId"]])["jobs"][0]
    assert described["tags"]["llmops:submit-token"] == record["token"]


def test_a_worker_killed_between_its_claim_and_submit_job_is_resubmitted_once(aws, laggy, monkeypatch):
    from llmops.jobs.backends.batch import batch_backend as batch

    monkeypatch.setattr(batch, "SUBMIT_WINDOW_SECONDS", 0.5)
    backend = BatchBackend(settings=settings())
    spec = pretrain(job_name("batch-crash-before", prefix="pretrain"))
    real_definition = BatchBackend._definition

    def die(self, hook, request):
        raise WorkerDied("killed before SubmitJob")

    monkeypatch.setattr(BatchBackend, "_definition", die)
    with pytest.raises(WorkerDied):
        backend.submit(spec)
    monkeypatch.setattr(BatchBackend, "_definition", real_definition)
    assert _jobs_named(aws, spec.name) == []
    retry = backend.submit(spec)       # waits out the window, then takes the claim over
    assert retry["reattached"] is False and retry["job_name"] == spec.name   # the same attempt
    assert [j["jobId"] for j in _jobs_named(aws, spec.name)] == [retry["job_id"]]
    assert backend.submit(spec)["job_id"] == retry["job_id"]


def test_only_one_try_can_claim_an_attempt(aws):
    """The claim is PutObject with If-None-Match: * (botocore and moto's server both honour it)."""
    from llmops.infra.aws import s3 as s3_mod

    backend = BatchBackend(settings=settings())
    hook = s3_mod.s3_hook(CONN_ID)
    prefix = "s3://llmops-test/staging/claim-test/job"
    first = backend._claim(hook, prefix, "job")
    assert first and backend._claim(hook, prefix, "job") == ""
    record = json.loads(aws.client("s3").get_object(Bucket="llmops-test",
                                                    Key="staging/claim-test/job/batch-job.json")["Body"].read())
    assert record["token"] == first
    assert backend._claim(hook, prefix, "job", if_match='"stale-etag"') == ""


def test_every_job_carries_the_cost_allocation_tags_and_propagates_them():
    run_id = "scheduled__2026-11-30T01:00:00+00:00"
    spec = pretrain(job_name("b", prefix="pretrain"),
                    tags={"team": "research", "dag_id": "llm_lifecycle", "run_id": run_id})
    cfg = BatchSettings(**{k: v for k, v in settings()["batch"].items()})
    request = submit_request(spec, cfg, remote.plan(spec, spec.name, cfg.staging_uri), spec.name,
                             "arn:aws:batch:us-east-1:1:job-definition/x:1")
    validate_request("batch", "SubmitJob", request)
    assert {k: request["tags"][k] for k in ("dag_id", "run_id", "team", "stage")} == {
        "dag_id": "llm_lifecycle", "run_id": run_id, "team": "research", "stage": "pretrain"}
    assert request["propagateTags"] is True   # onto the ECS tasks, where the cost is billed


# -- the queue decides shareIdentifier; a lost response never makes a second job ---------------

FIFO = "llmops-fifo"


@pytest.fixture()
def fifo(aws):
    batch = aws.client("batch")
    if not batch.describe_job_queues(jobQueues=[FIFO])["jobQueues"]:
        env = batch.describe_compute_environments(computeEnvironments=["gpu"])["computeEnvironments"][0]
        batch.create_job_queue(jobQueueName=FIFO, state="ENABLED", priority=1, computeEnvironmentOrder=[
            {"order": 1, "computeEnvironment": env["computeEnvironmentArn"]}])
    return FIFO


def test_share_identifier_and_priority_follow_the_queues_scheduling_policy(aws, fifo):
    """AWS refuses a shareIdentifier on a queue without a fair-share policy and requires one (and
    a priority) on a queue with one: the queue is described before anything is claimed."""
    spec = pretrain(job_name("batch-fifo", prefix="pretrain"))   # team research, priority 70
    handle = BatchBackend(settings=settings(job_queue=fifo)).submit(spec)
    sent = staged_request(aws, handle)
    assert "shareIdentifier" not in sent and "schedulingPriorityOverride" not in sent
    # A fair-share queue: the run without a priority gets the default one.
    handle = BatchBackend(settings=settings()).submit(
        pretrain(job_name("batch-fair", prefix="pretrain"), tags={"team": "research"}))
    sent = staged_request(aws, handle)
    assert (sent["shareIdentifier"], sent["schedulingPriorityOverride"]) == ("research", 0)
    # ... and one without a team is refused before anything is claimed, uploaded or submitted.
    lonely = pretrain(job_name("batch-noteam", prefix="pretrain"), tags={})
    with pytest.raises(JobSpecError, match="fair-share scheduling policy.*team.*share_identifier"):
        BatchBackend(settings=settings()).submit(lonely)
    assert _jobs_named(aws, lonely.name) == []
    assert aws.client("s3").list_objects_v2(Bucket="llmops-test", Prefix=f"staging/{lonely.name}/")[
        "KeyCount"] == 0
    assert BatchBackend(settings=settings(share_identifier="ops")).submit(lonely)["reattached"] is False
    with pytest.raises(JobSpecError, match="no job queue 'missing'"):
        BatchBackend(settings=settings(job_queue="missing")).submit(lonely)


def test_a_claim_whose_response_was_lost_is_still_this_tries(aws):
    """botocore resends a PutObject whose response was lost; the resend fails its If-None-Match
    against the record the first send wrote. That record holds this try's token: the claim is
    its own (it used to read as another try's, and the task waited out the submit window)."""
    from llmops.infra.aws import s3 as s3_mod

    hook = s3_mod.s3_hook(CONN_ID)
    client = hook.get_conn()

    class LostOnce:
        def put_object(self, **kwargs):
            client.put_object(**kwargs)          # written; the answer is lost ...
            return client.put_object(**kwargs)   # ... and the resend is refused (412)

        def __getattr__(self, name):
            return getattr(client, name)

    hook.get_conn = lambda: LostOnce()
    backend = BatchBackend(settings=settings())
    token = backend._claim(hook, "s3://llmops-test/staging/lost-claim/job", "job")
    assert token
    record = json.loads(client.get_object(Bucket="llmops-test",
                                          Key="staging/lost-claim/job/batch-job.json")["Body"].read())
    assert record["token"] == token


def test_copies_of_one_submission_are_terminated_after_the_submit(aws, laggy):
    """A SubmitJob resent after its response was lost: two multi-node jobs carry the claim's
    token. The one SubmitJob answered with stays; the copy is terminated right after."""
    terminated = []

    def resend(**kwargs):
        laggy._client.submit_job(**kwargs)            # AWS took it; the answer was lost
        return laggy._client.submit_job(**kwargs)     # botocore's resend

    laggy.submit_job = resend
    laggy.describe_jobs = lambda jobs: {"jobs": [   # as if they were still queued (moto ends them)
        {**j, "status": "RUNNABLE"} for j in laggy._client.describe_jobs(jobs=jobs)["jobs"]]}
    laggy.terminate_job = lambda jobId, reason: terminated.append((jobId, reason))
    spec = pretrain(job_name("batch-resent", prefix="pretrain"))
    handle = BatchBackend(settings=settings()).submit(spec)
    jobs = _jobs_named(aws, spec.name)
    assert len(jobs) == 2
    [copy] = [j["jobId"] for j in jobs if j["jobId"] != handle["job_id"]]
    assert terminated == [(copy, "Stopped by its Airflow task (llmops): duplicate submission")]
    assert handle["submit_token"] and handle["settle_until"] > 0   # status() keeps looking a while


@pytest.mark.parametrize("kind", ["SPOT", "FARGATE_SPOT"])
def test_a_queue_with_a_spot_compute_environment_is_refused_before_any_job(monkeypatch, kind):
    """Issue 21.3: Batch cannot run multi-node parallel jobs on Spot; such a job would sit
    RUNNABLE forever. The queue's environments are described before anything is claimed."""
    calls: list[str] = []

    class Client:
        def describe_job_queues(self, jobQueues):
            calls.append("DescribeJobQueues")
            return {"jobQueues": [{"jobQueueName": jobQueues[0], "computeEnvironmentOrder": [
                {"order": 2, "computeEnvironment": "arn:aws:batch:us-east-1:1:compute-environment/spot"},
                {"order": 1, "computeEnvironment": "arn:aws:batch:us-east-1:1:compute-environment/od"}]}]}

        def describe_compute_environments(self, computeEnvironments):
            calls.append("DescribeComputeEnvironments")
            assert computeEnvironments[0].endswith("/od")   # in the queue's order
            return {"computeEnvironments": [
                {"computeEnvironmentName": "od", "computeResources": {"type": "EC2"}},
                {"computeEnvironmentName": "spot", "computeResources": {"type": kind}}]}

        def __getattr__(self, name):
            raise AssertionError(f"{name} called after a refusal")

    class Hook:
        client = Client()

    backend = BatchBackend(settings=settings())
    monkeypatch.setattr(backend, "_hook", lambda *a, **k: Hook())
    with pytest.raises(JobSpecError, match=rf"queue '{QUEUE}'.*'spot' of type {kind}.*cannot run on Spot"):
        backend.submit(pretrain(job_name("batch-spot", prefix="pretrain")))
    assert calls == ["DescribeJobQueues", "DescribeComputeEnvironments"]
