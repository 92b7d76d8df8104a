"""A 2-node pretraining job whose nodes share no disk, on AWS Batch, SageMaker and HyperPod (both
job kinds), driven through the project's own backends against tests/chaos/fake_aws.py and
tests/chaos/fake_eks.py.

What is real: the backends' requests (validated by botocore, stored by moto), S3 (moto), the
image's entry (docker/job_entry.py) on every node, torchrun's rendezvous across the two nodes,
the supervisor and the training loop with DDP on gloo, MLflow. What is simulated (fake_aws): the
services running the containers, one per node, each on its own empty work dir and TMPDIR (a new
attempt gets new ones), the SageMaker toolkit's torchrun across instances, the Kubernetes API,
the HyperPod / Kubeflow operators and HyperPod's agent (torchrun), a node's host dying.

Each backend, one test:
1. the first attempt trains until rank 1 (node 1) hangs at HANG_STEP, and node 1's host dies:
   the attempt fails as the service fails it (HyperPod restarts the job's pods on new nodes);
2. the next attempt starts on fresh disks, restores the newest complete checkpoint from the run's
   storage in S3 before its first step, and finishes: it lost at most one checkpoint interval;
3. the job ends within END_BUDGET_S of its last step in the log (before: ~300 s, node 1 waiting
   for a result file on node 0's disk until torchrun's exit barrier gave up);
4. the result's checkpoint URI names a complete checkpoint (its manifest, written last) in S3.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import boto3
import pytest

from llmops.jobs.backends import JobState, remote
from llmops.jobs.backends.batch import BatchBackend
from llmops.jobs.backends.sagemaker import SageMakerTrainingBackend
from llmops.jobs.spec import JobSpec, job_name
from tasks.configs import tiny, to_dict
from tests.aws_fixtures import DUMMY_CREDENTIALS, IMAGE, REGION, free_port, sagemaker_settings
from tests.chaos.fake_aws import BATCH_GROUP, CREDENTIALS, SM_GROUP, ChaosClient, FakeAws
from tests.chaos.fake_eks import FakeEks

pytestmark = pytest.mark.timeout(900)

CONN = "llmops_multinode"
BUCKET = "llmops-multinode"
QUEUE = "llmops-multinode-queue"
MAX_STEPS, INTERVAL, HANG_STEP = 60, 10, 35
END_BUDGET_S = 30.0
STEP_LINE = re.compile(r"\bstep (\d+)/(\d+) \|")
RESUME_LINE = re.compile(r"resuming from (\S+) at step (\d+)")


@pytest.fixture(scope="module")
def fake(tmp_path_factory, tiny_data_dir):
    server = FakeAws(free_port(), tmp_path_factory.mktemp("fake-aws"), pending_seconds=0.5,
                     stop_grace_seconds=2, stopping_seconds=0.5).start()
    saved = {k: os.environ.get(k) for k in [f"AIRFLOW_CONN_{CONN.upper()}", *DUMMY_CREDENTIALS]}
    os.environ[f"AIRFLOW_CONN_{CONN.upper()}"] = json.dumps(server.connection())
    os.environ.update(DUMMY_CREDENTIALS)
    s3 = moto(server, "s3")
    s3.create_bucket(Bucket=BUCKET)
    for path in sorted(tiny_data_dir.rglob("*")):   # the data set lives in S3: no node shares it
        if path.is_file():
            s3.upload_file(str(path), BUCKET, f"data/{path.relative_to(tiny_data_dir).as_posix()}")
    batch, iam = moto(server, "batch"), moto(server, "iam")
    role = iam.create_role(RoleName="batch-multinode", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    env = batch.create_compute_environment(computeEnvironmentName="multinode", type="UNMANAGED",
                                           state="ENABLED", serviceRole=role)
    batch.create_job_queue(jobQueueName=QUEUE, state="ENABLED", priority=1, computeEnvironmentOrder=[
        {"order": 1, "computeEnvironment": env["computeEnvironmentArn"]}])
    try:
        yield server
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
        server.stop()


def moto(server: FakeAws, service: str):
    """A client straight to moto: what the test reads is never faulted."""
    return boto3.client(service, endpoint_url=server.moto_url, region_name=REGION,
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def pretrain_spec(prefix: str, **changes) -> JobSpec:
    config = to_dict(tiny().pretrain)
    config.update(data_dir=f"s3://{BUCKET}/data", output_dir=f"s3://{BUCKET}/{prefix}/pretrain",
                  max_steps=MAX_STEPS, checkpoint_interval=INTERVAL, eval_interval=30,
                  log_interval=1, hot_spare=False, max_restarts=0, hang_timeout_s=600.0)
    spec = JobSpec(stage="pretrain", entrypoint="tasks.pretrain", name=job_name(prefix, prefix=prefix),
                   config=config, instance_count=2,
                   max_run_seconds=3600, env={"LLMOPS_FAULTS": f"hang@{HANG_STEP}:1"})
    return spec.replace(**changes)


def wait_state(backend, handle, states: set[JobState], timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while True:
        status = backend.status(handle)
        if status.state in states:
            return status
        assert time.monotonic() < deadline, f"still {status.state} ({status.message}) after {timeout} s"
        time.sleep(0.5)


def log_events(server: FakeAws, group: str, streams: list[str]) -> list[tuple[float, str]]:
    """(timestamp in s, line) of every line the job's nodes wrote to CloudWatch, in time order."""
    logs = moto(server, "logs")
    events = []
    for stream in streams:
        token = None
        while True:
            kwargs = {"nextToken": token} if token else {"startFromHead": True}
            page = logs.get_log_events(logGroupName=group, logStreamName=stream, **kwargs)
            events += [(e["timestamp"] / 1000, e["message"]) for e in page["events"]]
            if page.get("nextForwardToken") in (None, token):
                break
            token = page["nextForwardToken"]
    return sorted(events)


def newest_complete_step(server: FakeAws, uri: str) -> int:
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    keys = [o["Key"] for page in moto(server, "s3").get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix.rstrip("/") + "/") for o in page.get("Contents", [])]
    steps = [int(m.group(1)) for k in keys if (m := re.search(r"/step_(\d+)/manifest\.json$", k))]
    return max(steps, default=-1)


@dataclass
class Platform:
    """How a test reaches one backend's simulated jobs."""

    backend: Any
    staging: str
    events: Callable[[dict], list[tuple[float, str]]]   # (time, line) of every node of an attempt
    ended_at: Callable[[dict], float | None]
    lose_node_1: Callable[[dict], None]
    continue_after_loss: Callable[[JobSpec, dict], dict]   # the handle of the attempt that goes on


def wait_for_line(platform: Platform, handle: dict, pattern: re.Pattern, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(pattern.search(line) for _, line in platform.events(handle)):
            return
        status = platform.backend.status(handle)
        assert status.state in (JobState.PENDING, JobState.RUNNING), \
            f"job {handle['job_name']} ended ({status.state}: {status.message}) before {pattern.pattern!r}"
        time.sleep(1)
    raise TimeoutError(f"no line {pattern.pattern!r} from {handle['job_name']} after {timeout} s")


def run_two_nodes_lose_one(platform: Platform, spec: JobSpec, server: FakeAws) -> dict:
    backend = platform.backend
    first = backend.submit(spec)
    # rank 1 (node 1) stops in step HANG_STEP; rank 0 waits for it in that step's all-reduce
    wait_for_line(platform, first, re.compile(rf"\bstep {HANG_STEP - 1}/{MAX_STEPS} \|"), timeout=300)
    reached = HANG_STEP - 1
    uri = remote.plan(spec, first["job_name"], platform.staging).checkpoint_uri   # every attempt's
    deadline = time.monotonic() + 60   # the last checkpoint's upload may still be under way
    while newest_complete_step(server, uri) < reached - reached % INTERVAL and time.monotonic() < deadline:
        time.sleep(0.5)
    lost_at = time.time()
    platform.lose_node_1(first)

    # Fresh nodes, empty disks: a new attempt (Batch, SageMaker) or the same job restarted by
    # HyperPod's auto-resume.
    handle = platform.continue_after_loss(spec, first)
    done = wait_state(backend, handle, {JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED}, 420)
    events = [(t, line) for t, line in platform.events(handle) if t >= lost_at]
    text = "\n".join(line for _, line in events)
    assert done.state is JobState.SUCCEEDED, f"{done.message}\n{text[-4000:]}"

    # 2. restored from the run's storage before the first step; lost at most one interval
    resumed = [m for _, line in events if (m := RESUME_LINE.search(line))]
    assert resumed, f"the next attempt did not restore a checkpoint:\n{text[-4000:]}"
    restored_step = int(resumed[0].group(2))
    first_step = min(int(m.group(1)) for _, line in events if (m := STEP_LINE.search(line)))
    assert first_step == restored_step + 1, (first_step, restored_step)
    assert reached - restored_step <= INTERVAL, \
        f"lost {reached - restored_step} steps (reached {reached}, restored {restored_step})"

    # 3. the job ends within seconds of its last step
    last_step_at = max(t for t, line in events if STEP_LINE.search(line))
    idle = platform.ended_at(handle) - last_step_at
    print(f"{type(backend).__name__}: end of job {idle:.1f} s after the last step; lost "
          f"{reached - restored_step} steps (reached {reached}, restored {restored_step})")
    assert idle <= END_BUDGET_S, f"the job ended {idle:.0f} s after its last step"

    # 4. the result names a complete checkpoint in S3: the newest one, the final step's
    checkpoint = done.result["outputs"]["checkpoint"]
    assert checkpoint.startswith(uri.rstrip("/") + "/"), (checkpoint, uri)
    bucket, _, key = checkpoint[len("s3://"):].partition("/")
    moto(server, "s3").head_object(Bucket=bucket, Key=f"{key}/manifest.json")
    assert checkpoint.endswith(f"step_{MAX_STEPS:06d}") and newest_complete_step(server, uri) == MAX_STEPS
    assert done.result["metrics"]["step"] == MAX_STEPS
    return handle


def aws_platform(server: FakeAws, backend: Any, staging: str, group: str) -> Platform:
    """Batch and SageMaker: the job's CloudWatch streams; a lost host fails the attempt and the
    next one (fresh nodes) is submitted as the operator's retry would."""
    chaos = ChaosClient(server.url)

    def events(handle: dict) -> list[tuple[float, str]]:
        job = chaos.job(handle["job_name"])
        return log_events(server, group, job["streams"]) if job else []

    def continue_after_loss(spec: JobSpec, first: dict) -> dict:
        failed = wait_state(backend, first, {JobState.FAILED, JobState.STOPPED, JobState.SUCCEEDED}, 120)
        assert failed.state is JobState.FAILED, failed.message
        retry = backend.submit(spec.replace(env={}))   # the new host has no injected hang
        assert retry["reattached"] is False and retry["job_name"] != first["job_name"]
        return retry

    return Platform(backend, staging, events, lambda h: chaos.job(h["job_name"])["ended_at"],
                    lambda h: chaos.lose_host(h["job_name"], node=1), continue_after_loss)


def test_batch_two_nodes_no_shared_disk(fake):
    backend = BatchBackend(settings={"batch": {
        "aws_conn_id": CONN, "job_queue": QUEUE, "image": IMAGE, "instance_type": "m5.xlarge",
        "staging_uri": f"s3://{BUCKET}/batch-staging"}})
    run_two_nodes_lose_one(aws_platform(fake, backend, f"s3://{BUCKET}/batch-staging", BATCH_GROUP),
                           pretrain_spec("mn-batch", instance_type="m5.xlarge"), fake)


def test_sagemaker_two_instances_no_shared_disk(fake):
    backend = SageMakerTrainingBackend(settings={"sagemaker": sagemaker_settings(
        BUCKET, aws_conn_id=CONN, instance_type="ml.m5.xlarge")})
    run_two_nodes_lose_one(aws_platform(fake, backend, f"s3://{BUCKET}/staging", SM_GROUP),
                           pretrain_spec("mn-sm", instance_type="ml.m5.xlarge"), fake)


@pytest.mark.parametrize("kind", ["HyperPodPyTorchJob", "PyTorchJob"])
def test_hyperpod_two_pods_no_shared_disk(fake, kind, tmp_path, monkeypatch):
    """The HyperPod operator restarts the whole job on a replaced node (auto-resume): no new
    attempt from us, the same job goes on from the newest checkpoint in S3."""
    from llmops.jobs.backends import hyperpod

    eks = FakeEks(tmp_path / "eks", {**CREDENTIALS, "AWS_ENDPOINT_URL": fake.moto_url,
                                     "AWS_ENDPOINT_URL_S3": fake.moto_url})
    monkeypatch.setattr(hyperpod, "_CLIENTS", {})
    monkeypatch.setattr(hyperpod, "connect", lambda *key: eks)
    staging = f"s3://{BUCKET}/hp-staging-{kind.lower()}"
    backend = hyperpod.HyperPodBackend(settings={"hyperpod": {
        "aws_conn_id": CONN, "staging_uri": staging, "image": IMAGE, "eks_cluster_name": "hp",
        "kind": kind, "max_retry_count": 2}})

    def events(handle: dict) -> list[tuple[float, str]]:
        return [(t, line) for t, _, line in eks.logs(handle["k8s_name"])]

    def ended_at(handle: dict) -> float:
        return hyperpod._epoch(eks.job(handle["k8s_name"]).body["status"]["completionTime"])

    def continue_after_loss(spec: JobSpec, first: dict) -> dict:
        return first

    platform = Platform(backend, staging, events, ended_at,
                        lambda h: eks.lose_host(h["k8s_name"], 1, heal_env=("LLMOPS_FAULTS",)),
                        continue_after_loss)
    try:
        handle = run_two_nodes_lose_one(platform, pretrain_spec(f"mn-{kind.lower()[:8]}"), fake)
        job = eks.job(handle["k8s_name"])
        assert job.restarts == 1 and job.generation == 2, "one restart, on replaced nodes"
    finally:
        eks.shutdown()
