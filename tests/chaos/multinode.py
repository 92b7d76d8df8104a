"""Multi-node jobs in the simulators (tests/chaos/fake_aws.py, fake_eks.py) through the project's
own backends: one fake AWS with the data set in its S3, a Batch queue, and one Platform per backend
(Batch, SageMaker, HyperPod with either job kind) that says how to read a job's log lines, when it
ended, how to lose one of its nodes and how the run goes on after that. Shared by
tests/test_multinode_no_shared_disk.py and benchmarks/multinode_end_of_job.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import boto3

from llmops.jobs.backends import JobState
from llmops.jobs.spec import JobSpec, job_name
from tasks.configs import tiny, to_dict
from tests.aws_fixtures import DUMMY_CREDENTIALS, IMAGE, REGION, free_port, sagemaker_settings
from tests.chaos.fake_aws import BATCH_GROUP, CREDENTIALS, SM_GROUP, ChaosClient, FakeAws
from tests.chaos.fake_eks import FakeEks

CONN = "llmops_multinode"
BUCKET = "llmops-multinode"
QUEUE = "llmops-multinode-queue"
STEP_LINE = re.compile(r"\bstep (\d+)/(\d+) \|")
RESUME_LINE = re.compile(r"resuming from (\S+) at step (\d+)")
BACKENDS = ("batch", "sagemaker", "HyperPodPyTorchJob", "PyTorchJob")


def start_fake(workdir: Path, data_dir: Path) -> FakeAws:
    """A fake AWS with `data_dir` under s3://BUCKET/data/ (no node shares a disk with it) and a
    Batch queue; `connected(server)` gives this process the Airflow connection CONN to it."""
    server = FakeAws(free_port(), workdir, pending_seconds=0.5, stop_grace_seconds=2,
                     stopping_seconds=0.5).start()
    s3 = moto(server, "s3")
    s3.create_bucket(Bucket=BUCKET)
    for path in sorted(data_dir.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), BUCKET, f"data/{path.relative_to(data_dir).as_posix()}")
    batch_queue(moto(server, "batch"), moto(server, "iam"), QUEUE)
    return server


@contextlib.contextmanager
def connected(server: FakeAws, conn: str = CONN) -> Iterator[FakeAws]:
    """The Airflow connection `conn` to the server's proxy, and dummy credentials, in this
    process's environment until the block ends."""
    saved = {k: os.environ.get(k) for k in [f"AIRFLOW_CONN_{conn.upper()}", *DUMMY_CREDENTIALS]}
    os.environ[f"AIRFLOW_CONN_{conn.upper()}"] = json.dumps(server.connection())
    os.environ.update(DUMMY_CREDENTIALS)
    try:
        yield server
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


def batch_queue(batch: Any, iam: Any, name: str) -> str:
    """An enabled Batch job queue `name` on an unmanaged compute environment of the same name."""
    role = iam.create_role(RoleName=f"batch-{name}", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    env = batch.create_compute_environment(computeEnvironmentName=name, type="UNMANAGED",
                                           state="ENABLED", serviceRole=role)
    batch.create_job_queue(jobQueueName=name, state="ENABLED", priority=1, computeEnvironmentOrder=[
        {"order": 1, "computeEnvironment": env["computeEnvironmentArn"]}])
    return name


def moto(server: FakeAws, service: str):
    """A client straight to moto: what the test reads is never faulted."""
    return boto3.client(service, endpoint_url=server.moto_url, region_name=REGION,
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def pretrain_spec(prefix: str, *, max_steps: int, interval: int, faults: str = "",
                  **changes: Any) -> JobSpec:
    """A tiny 2-node pretraining job reading s3://BUCKET/data and writing under s3://BUCKET/prefix,
    a log line per step and a checkpoint every `interval` steps."""
    config = to_dict(tiny().pretrain)
    config.update(data_dir=f"s3://{BUCKET}/data", output_dir=f"s3://{BUCKET}/{prefix}/pretrain",
                  max_steps=max_steps, checkpoint_interval=interval, eval_interval=30,
                  log_interval=1, hot_spare=False, max_restarts=0, hang_timeout_s=600.0)
    spec = JobSpec(stage="pretrain", entrypoint="tasks.pretrain", name=job_name(prefix, prefix=prefix),
                   config=config, instance_count=2, max_run_seconds=3600,
                   env={"LLMOPS_FAULTS": faults} if faults else {})
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
    node_ends: Callable[[dict], list[float | None]]   # when each node's container exited
    lose_node_1: Callable[[dict], None]
    continue_after_loss: Callable[[JobSpec, dict], dict]   # the handle of the attempt that goes on
    instance_type: str = ""      # what its jobs ask for
    eks: FakeEks | None = None   # HyperPod's simulated cluster

    def close(self) -> None:
        if self.eks is not None:
            self.eks.shutdown()


def aws_platform(server: FakeAws, backend: Any, staging: str, group: str, instance_type: str) -> Platform:
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
                    lambda h: chaos.job(h["job_name"])["node_ended_at"],
                    lambda h: chaos.lose_host(h["job_name"], node=1), continue_after_loss,
                    instance_type)


def platform(server: FakeAws, name: str, workdir: Path) -> Platform:
    """The Platform for backend `name` (one of BACKENDS); close() it when done. A HyperPod
    platform puts its FakeEks where the backend makes its Kubernetes client."""
    if name == "batch":
        from llmops.jobs.backends.batch import BatchBackend

        staging = f"s3://{BUCKET}/batch-staging"
        backend = BatchBackend(settings={"batch": {
            "aws_conn_id": CONN, "job_queue": QUEUE, "image": IMAGE, "instance_type": "m5.xlarge",
            "staging_uri": staging}})
        return aws_platform(server, backend, staging, BATCH_GROUP, "m5.xlarge")
    if name == "sagemaker":
        from llmops.jobs.backends.sagemaker import SageMakerTrainingBackend

        backend = SageMakerTrainingBackend(settings={"sagemaker": sagemaker_settings(
            BUCKET, aws_conn_id=CONN, instance_type="ml.m5.xlarge")})
        return aws_platform(server, backend, f"s3://{BUCKET}/staging", SM_GROUP, "ml.m5.xlarge")
    from llmops.jobs.backends import hyperpod

    eks = FakeEks(workdir / "eks", {**CREDENTIALS, "AWS_ENDPOINT_URL": server.moto_url,
                                    "AWS_ENDPOINT_URL_S3": server.moto_url})
    hyperpod._CLIENTS.clear()
    hyperpod.connect = lambda *key: eks
    staging = f"s3://{BUCKET}/hp-staging-{name.lower()}"
    backend = hyperpod.HyperPodBackend(settings={"hyperpod": {
        "aws_conn_id": CONN, "staging_uri": staging, "image": IMAGE, "eks_cluster_name": "hp",
        "kind": name, "max_retry_count": 2}})

    def ended_at(handle: dict) -> float:
        return hyperpod._epoch(eks.job(handle["k8s_name"]).body["status"]["completionTime"])

    # The HyperPod operator restarts the whole job on a replaced node (auto-resume): no new
    # attempt from us, the same job goes on from the newest checkpoint in S3.
    return Platform(backend, staging,
                    lambda h: [(t, line) for t, _, line in eks.logs(h["k8s_name"])], ended_at,
                    lambda h: eks.pod_ends(h["k8s_name"]),
                    lambda h: eks.lose_host(h["k8s_name"], 1, heal_env=("LLMOPS_FAULTS",)),
                    lambda spec, first: first, eks=eks)

