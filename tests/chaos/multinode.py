"""Multi-node jobs in the simulators (tests/chaos/fake_aws/, fake_eks.py) through the project's
own backends: one fake AWS with the data set in its S3, a Batch queue, and one Platform per backend
(Batch, SageMaker, HyperPod with either job kind) that says how to read a job's log lines, when it
ended, how to lose one of its nodes and how the run goes on after that, and one run that loses a
node mid-run (lose_a_node_mid_run). Shared by tests/test_multinode_no_shared_disk.py,
tests/test_node_loss_every_stage.py, tests/test_multiweek.py (a whole run of one spec across its
attempts: Platform.attempts and what follows) and benchmarks/multinode_end_of_job.py.
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

from llmops.jobs.backends import JobState, remote
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
def running_fake(workdir: Path, data_dir: Path) -> Iterator[FakeAws]:
    """start_fake, connected, until the block ends; then stopped."""
    server = start_fake(workdir, data_dir)
    try:
        with connected(server):
            yield server
    finally:
        server.stop()


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


def upload_dir(server: FakeAws, local: Path, key_prefix: str) -> str:
    """Every file under `local` to s3://BUCKET/key_prefix/; that URI."""
    s3 = moto(server, "s3")
    for path in sorted(local.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), BUCKET, f"{key_prefix}/{path.relative_to(local).as_posix()}")
    return f"s3://{BUCKET}/{key_prefix}"


def pretrain_spec(prefix: str, *, max_steps: int, interval: int, faults: str = "",
                  **changes: Any) -> JobSpec:
    """A tiny 2-node pretraining job reading s3://BUCKET/data and writing under s3://BUCKET/prefix,
    a log line per step and a checkpoint every `interval` steps. Its config does not name
    checkpoint_uri, as a DAG author's spec relying on the defaults does not: the stage decides
    that its checkpoints leave the node (tasks.configs.CHECKPOINTED_STAGES)."""
    config = to_dict(tiny().pretrain)
    config.update(data_dir=f"s3://{BUCKET}/data", output_dir=f"s3://{BUCKET}/{prefix}/pretrain",
                  max_steps=max_steps, checkpoint_interval=interval, eval_interval=30,
                  log_interval=1, hot_spare=False, max_restarts=0, hang_timeout_s=600.0)
    del config["checkpoint_uri"]
    spec = JobSpec(stage="pretrain", entrypoint="tasks.pretrain", name=job_name(prefix, prefix=prefix),
                   config=config, instance_count=2, max_run_seconds=3600,
                   env={"LLMOPS_FAULTS": faults} if faults else {})
    return spec.replace(**changes)


def post_training_spec(stage: str, prefix: str, model_uri: str, *, max_steps: int, interval: int,
                       faults: str = "", **changes: Any) -> JobSpec:
    """A tiny one-node fine-tuning or distillation job (`stage`) of the model at `model_uri` (the
    base model or the teacher), on s3://BUCKET/data's SFT split, writing under
    s3://BUCKET/prefix: a log line per step, a checkpoint every `interval` steps, and a config
    that does not name checkpoint_uri."""
    recipe = tiny()
    config = to_dict(recipe.finetune if stage == "finetune" else recipe.distill)
    config.update({"base_model" if stage == "finetune" else "teacher_model": model_uri},
                  data_dir=f"s3://{BUCKET}/data", output_dir=f"s3://{BUCKET}/{prefix}/{stage}",
                  max_steps=max_steps, checkpoint_interval=interval, eval_interval=max_steps,
                  log_interval=1, eval_examples=16)
    del config["checkpoint_uri"]
    spec = JobSpec(stage=stage, entrypoint=f"tasks.{stage}", name=job_name(prefix, prefix=prefix),
                   config=config, max_run_seconds=3600,
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
    lose_node: Callable[[dict, int], None]   # that node's host of the attempt dies (its disk too)
    continue_after_loss: Callable[[JobSpec, dict], dict]   # the handle of the attempt that goes on
    instance_type: str = ""      # what its jobs ask for
    eks: FakeEks | None = None   # HyperPod's simulated cluster
    server: FakeAws | None = None      # Batch and SageMaker: the fake AWS,
    chaos: ChaosClient | None = None   # ... its control API,
    group: str = ""                    # ... and the CloudWatch group of its jobs' streams
    create_operation: str = ""         # ... and the call that creates a job (SubmitJob, ...)

    def close(self) -> None:
        if self.eks is not None:
            self.eks.shutdown()

    def lose_node_1(self, handle: dict) -> None:
        self.lose_node(handle, 1)

    # -- a whole run of one spec, across its attempts --------------------------------------------
    def attempts(self, name: str) -> list[dict[str, Any]]:
        """The simulator's record of every job of spec `name` (its attempts `name`, `name-rN`,
        and any copy a resent create made), oldest first: name, created_at, started_at (None:
        never ran), ended_at, status, reason, node_ended_at (and streams, on AWS)."""
        if self.eks is not None:   # Kubernetes names: the spec's name is an annotation
            return [j for j in self.eks.report()["jobs"] if j["spec_name"] == name]
        pattern = re.compile(rf"{re.escape(name)}(?:-r\d+)?")
        return [j for j in self._chaos().report()["jobs"] if pattern.fullmatch(j["name"])]

    def attempt_events(self, job: dict[str, Any]) -> list[tuple[float, str]]:
        """(time, line) of every node of the attempt `job` (an entry of attempts())."""
        if self.eks is not None:
            return [(t, line) for t, _, line in self.eks.logs(job["name"])]
        assert self.server is not None
        return log_events(self.server, self.group, job["streams"])

    def segments(self, name: str) -> list[list[tuple[float, str]]]:
        """The log lines of each stretch of training of spec `name` that ran, in order: one per
        attempt that started (HyperPod: per generation of its pods, as a restart on replaced
        nodes goes on inside the same job)."""
        started = [j for j in self.attempts(name) if j["started_at"]]
        if self.eks is not None:
            return [lines for j in started for lines in self.eks.generations(j["name"])]
        return [self.attempt_events(j) for j in started]

    def billed(self, name: str) -> list[tuple[float, float]]:
        """(start, end) of every attempt that ran, as the simulator ran it: the time billed."""
        return [(j["started_at"], j["ended_at"]) for j in self.attempts(name) if j["started_at"]]

    def hold_for_capacity(self, seconds: float) -> None:
        """Jobs created from now on wait `seconds` for instances (HyperPod: for Kueue's
        admission) first (0: none)."""
        if self.eks is not None:
            self.eks.hold_for_capacity(seconds)
        else:
            self._chaos().config(capacity_wait_seconds=seconds)

    def capacity_held(self) -> bool:
        if self.eks is not None:
            return self.eks.capacity_wait_seconds > 0
        return self._chaos().config()["capacity_wait_seconds"] > 0

    def lose_next_create_answer(self) -> None:
        """The next create (SubmitJob, CreateTrainingJob, the job resource's POST) takes effect
        and its answer is lost: the client resends it."""
        if self.eks is not None:
            self.eks.lose_responses(self.create_operation, 1)
        else:
            self._chaos().faults([{"operations": [self.create_operation], "kind": "lost", "count": 1}])

    def lost_create_answers(self) -> int:
        report = self.eks.report() if self.eks is not None else self._chaos().report()
        return sum(1 for i in report["injections"]
                   if i["kind"] == "lost" and i["operation"] == self.create_operation)

    def lose_node_1_of(self, job: dict[str, Any]) -> None:
        """Node 1's host of attempt `job` dies (its disk with it)."""
        if self.eks is not None:   # the job restarts on replaced nodes, with the attempt's env
            self.eks.lose_host(job["name"], 1)
            return
        # By id: a Batch copy of a resent SubmitJob has the same name
        self._chaos().lose_host(job["job_id"] if job["service"] == "batch" else job["name"], node=1)

    def _chaos(self) -> ChaosClient:
        assert self.chaos is not None, "a Batch or SageMaker platform"
        return self.chaos


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


def lose_a_node_mid_run(platform: Platform, spec: JobSpec, server: FakeAws, *, node: int,
                        hang_step: int, end_budget_s: float | None = None) -> tuple[dict, dict]:
    """Run `spec` (its LLMOPS_FAULTS hangs node `node` in step `hang_step`) until that step, let
    its newest checkpoint reach S3, then lose that node's host; the run goes on as the service
    goes on (a new attempt on fresh disks, or HyperPod's restart on replaced nodes). Asserts:

    1. the run that goes on restores a checkpoint from the run's storage in S3 before its first
       step, and loses at most one checkpoint interval (the spec's checkpoint_interval);
    2. with `end_budget_s`: the job ends, and every other node exits, within that of its last
       step;
    3. the result's checkpoint URI names a complete checkpoint (its manifest, written last) in S3:
       the final step's, the newest there.
    Returns the handle of the attempt that finished and what it lost (printed too)."""
    backend, max_steps = platform.backend, spec.config["max_steps"]
    interval = spec.config["checkpoint_interval"]
    first = backend.submit(spec)
    # the node stops in step hang_step (a pretraining's peers wait for it in that step's all-reduce)
    wait_for_line(platform, first, re.compile(rf"\bstep {hang_step - 1}/{max_steps} \|"), timeout=300)
    reached = hang_step - 1
    uri = remote.plan(spec, first["job_name"], platform.staging).checkpoint_uri   # every attempt's
    deadline = time.monotonic() + 60   # the last checkpoint's upload may still be under way
    while newest_complete_step(server, uri) < reached - reached % interval and time.monotonic() < deadline:
        time.sleep(0.5)
    lost_at = time.time()
    platform.lose_node(first, node)

    # Fresh nodes, empty disks: a new attempt (Batch, SageMaker) or the same job restarted by
    # HyperPod's auto-resume.
    handle = platform.continue_after_loss(spec, first)
    done = wait_state(backend, handle, {JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED}, 420)
    events = [(t, line) for t, line in platform.events(handle) if t >= lost_at]
    text = "\n".join(line for _, line in events)
    assert done.state is JobState.SUCCEEDED, f"{done.message}\n{text[-4000:]}"

    # 1. restored from the run's storage before the first step; lost at most one interval
    resumed = [m for _, line in events if (m := RESUME_LINE.search(line))]
    assert resumed, f"the next attempt did not restore a checkpoint:\n{text[-4000:]}"
    restored_step = int(resumed[0].group(2))
    first_step = min(int(m.group(1)) for _, line in events if (m := STEP_LINE.search(line)))
    assert first_step == restored_step + 1, (first_step, restored_step)
    assert reached - restored_step <= interval, \
        f"lost {reached - restored_step} steps (reached {reached}, restored {restored_step})"

    # 2. the job ends within seconds of its last step
    last_step_at = max(t for t, line in events if STEP_LINE.search(line))
    idle = platform.ended_at(handle) - last_step_at
    others = max(platform.node_ends(handle)[1:], default=idle + last_step_at) - last_step_at
    summary = {"stage": spec.stage, "backend": type(backend).__name__, "reached": reached,
               "restored": restored_step, "lost_steps": reached - restored_step,
               "end_after_last_step_s": round(idle, 1)}
    print(f"{spec.stage} on {summary['backend']}: lost {reached - restored_step} steps (reached "
          f"{reached}, restored {restored_step}); the job ended {idle:.1f} s after its last step, "
          f"its other nodes {others:.1f} s after it")
    if end_budget_s is not None:
        assert idle <= end_budget_s, f"the job ended {idle:.0f} s after its last step"
        assert others <= end_budget_s, f"another node exited {others:.0f} s after the last step"

    # 3. the result names a complete checkpoint in S3: the newest one, the final step's
    checkpoint = done.result["outputs"]["checkpoint"]
    assert checkpoint.startswith(uri.rstrip("/") + "/"), (checkpoint, uri)
    bucket, _, key = checkpoint[len("s3://"):].partition("/")
    moto(server, "s3").head_object(Bucket=bucket, Key=f"{key}/manifest.json")
    assert checkpoint.endswith(f"step_{max_steps:06d}") and newest_complete_step(server, uri) == max_steps
    assert done.result["metrics"]["step"] == max_steps
    return handle, summary


def download(server: FakeAws, uri: str, local: Path) -> Path:
    """Every object under s3 `uri` (a folder) into `local`; `local`."""
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    prefix = prefix.rstrip("/") + "/"
    s3 = moto(server, "s3")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            target = local / obj["Key"][len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(target))
    return local


def aws_platform(server: FakeAws, backend: Any, staging: str, group: str, instance_type: str,
                 create_operation: str) -> Platform:
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
                    lambda h, node: chaos.lose_host(h["job_name"], node=node), continue_after_loss,
                    instance_type, server=server, chaos=chaos, group=group,
                    create_operation=create_operation)


def platform(server: FakeAws, name: str, workdir: Path, **hyperpod_settings: Any) -> Platform:
    """The Platform for backend `name` (one of BACKENDS); close() it when done. A HyperPod
    platform puts its FakeEks where the backend makes its Kubernetes client; `hyperpod_settings`
    go into its settings (a namespace, a Kueue queue_name)."""
    if name == "batch":
        from llmops.jobs.backends.batch.batch_backend import BatchBackend

        staging = f"s3://{BUCKET}/batch-staging"
        backend = BatchBackend(settings={"batch": {
            "aws_conn_id": CONN, "job_queue": QUEUE, "image": IMAGE, "instance_type": "m5.xlarge",
            "staging_uri": staging}})
        return aws_platform(server, backend, staging, BATCH_GROUP, "m5.xlarge", "SubmitJob")
    if name == "sagemaker":
        from llmops.jobs.backends.sagemaker.sagemaker_backend import SageMakerTrainingBackend

        backend = SageMakerTrainingBackend(settings={"sagemaker": sagemaker_settings(
            BUCKET, aws_conn_id=CONN, instance_type="ml.m5.xlarge")})
        return aws_platform(server, backend, f"s3://{BUCKET}/staging", SM_GROUP, "ml.m5.xlarge",
                            "CreateTrainingJob")
    from llmops.jobs.backends.hyperpod import hyperpod_backend as hyperpod
    from llmops.jobs.backends.hyperpod import hyperpod_hook

    eks = FakeEks(workdir / "eks", {**CREDENTIALS, "AWS_ENDPOINT_URL": server.moto_url,
                                    "AWS_ENDPOINT_URL_S3": server.moto_url})
    hyperpod_hook._CLIENTS.clear()
    hyperpod_hook.connect = lambda *key: eks
    staging = f"s3://{BUCKET}/hp-staging-{name.lower()}"
    backend = hyperpod.HyperPodBackend(settings={"hyperpod": {
        "aws_conn_id": CONN, "staging_uri": staging, "image": IMAGE, "eks_cluster_name": "hp",
        "kind": name, "max_retry_count": 2, **hyperpod_settings}})

    def ended_at(handle: dict) -> float:
        return hyperpod._epoch(eks.job(handle["k8s_name"]).body["status"]["completionTime"])

    # The HyperPod operator restarts the whole job on a replaced node (auto-resume): no new
    # attempt from us, the same job goes on from the newest checkpoint in S3.
    return Platform(backend, staging,
                    lambda h: [(t, line) for t, _, line in eks.logs(h["k8s_name"])], ended_at,
                    lambda h: eks.pod_ends(h["k8s_name"]),
                    lambda h, node: eks.lose_host(h["k8s_name"], node, heal_env=("LLMOPS_FAULTS",)),
                    lambda spec, first: first, eks=eks,
                    create_operation="create_namespaced_custom_object")

