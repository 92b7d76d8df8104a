"""AWS without AWS: a moto server on 127.0.0.1 reached through an Airflow connection, and what
moto does not do itself.

moto keeps SageMaker's and Batch's control-plane state (jobs, names, statuses, S3) but runs no
container: a SageMaker training job is `Completed` the moment it is created. `run_training_container`
does what SageMaker would do with a job's request, on this machine: it lays out /opt/ml under a
temp dir (input channels downloaded from S3, resourceconfig.json, the checkpoint dir synced from
and back to CheckpointConfig.S3Uri), decodes the hyperparameters as the training toolkit does and
runs the image's entry, docker/job_entry.py, with the request's Environment. Everything the
container writes goes to moto's S3, where the backend reads it.

What these tests cannot show, because moto (5.2.5) does not do it:
- SageMaker jobs are never InProgress and never Failed: a job is Completed when created (or
  Stopped when a processing job is stopped, whatever its state). StopTrainingJob is not
  implemented, so stopping a *running* training job is shown by the request it would send only.
  moto drops Environment, RetryStrategy, InfraCheckConfig and ProfilerConfig from its
  description; the backend's own copy of each request (`request.json`) is what the tests check.
- Batch jobs finish at submission (SUCCEEDED, or FAILED with MOTO_SIMPLE_BATCH_FAIL_AFTER) and
  never run; shareIdentifier, schedulingPriorityOverride, nodeOverrides and retryStrategy are
  accepted but neither stored nor enforced: no fair-share scheduling happens.
- No CloudWatch log lines exist for either service.
- No Kubernetes API at all: HyperPod manifests are checked against the CRD schemas only.
- Nothing about real instances: EFA, NCCL across nodes, spot interruptions, IAM, image builds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRY = ROOT / "docker" / "job_entry.py"
CONN_ID = "llmops_aws"
REGION = "us-east-1"
ROLE = "arn:aws:iam::123456789012:role/llmops-sagemaker"
IMAGE = "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.8.0-gpu-py312-cu129-ubuntu22.04-sagemaker"
DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def stop_process_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """End a server we started in its own session, and everything it spawned."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class Moto:
    """A moto server of this test session and boto3 clients pointed at it."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def client(self, service: str):
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def api(self, path: str, payload: dict | None = None) -> Any:
        request = urllib.request.Request(f"{self.endpoint}/moto-api/{path}",
                                         data=json.dumps(payload or {}).encode(), method="POST")
        return urllib.request.urlopen(request, timeout=10).read()

    def bucket(self, name: str) -> str:
        s3 = self.client("s3")
        try:
            s3.create_bucket(Bucket=name)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name

    def training_jobs(self, prefix: str = "") -> list[str]:
        jobs = self.client("sagemaker").list_training_jobs(MaxResults=100)["TrainingJobSummaries"]
        return sorted(j["TrainingJobName"] for j in jobs if j["TrainingJobName"].startswith(prefix))


@pytest.fixture(scope="session")
def moto_server() -> Iterator[Moto]:
    """`moto_server` on a free port for the session; an Airflow connection `llmops_aws` to it."""
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1",
                             "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{endpoint}/moto-api/")
        moto = Moto(endpoint)
        # Batch jobs otherwise need Docker; without it they are marked finished at once.
        moto.api("config", {"batch": {"use_docker": False}})
        connection = {"conn_type": "aws", "login": "testing", "password": "testing",
                      "extra": {"region_name": REGION, "endpoint_url": endpoint}}
        saved = {k: os.environ.get(k) for k in [f"AIRFLOW_CONN_{CONN_ID.upper()}", *DUMMY_CREDENTIALS]}
        os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps(connection)
        os.environ.update(DUMMY_CREDENTIALS)  # boto3 outside Airflow (the emulated container)
        yield moto
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    finally:
        stop_process_group(proc)


def sagemaker_settings(bucket: str, **overrides: Any) -> dict[str, Any]:
    return {"aws_conn_id": CONN_ID, "role_arn": ROLE, "staging_uri": f"s3://{bucket}/staging",
            "image": IMAGE, "instance_type": "ml.g5.2xlarge", **overrides}


# -- what SageMaker does with a training job, minus the container runtime ---------------------

def run_training_container(moto: Moto, job_name: str, workdir: Path, extra_env: dict | None = None
                           ) -> subprocess.CompletedProcess:
    """Run the training job's container for `job_name` as SageMaker would, on this machine."""
    sm, s3 = moto.client("sagemaker"), moto.client("s3")
    described = sm.describe_training_job(TrainingJobName=job_name)
    # moto keeps only part of a request (not Environment or RetryStrategy); the backend keeps the
    # whole request beside the job's staged config.
    request_uri = None
    for channel in described["InputDataConfig"]:
        if channel["ChannelName"] == "llmops_config":
            request_uri = channel["DataSource"]["S3DataSource"]["S3Uri"].rstrip("/").rsplit("/", 1)[0]
    bucket, key = request_uri[len("s3://"):].split("/", 1)
    request = json.loads(s3.get_object(Bucket=bucket, Key=f"{key}/request.json")["Body"].read())
    assert request["TrainingJobName"] == job_name
    cmd, env = training_container(s3, request, workdir, moto.endpoint, extra_env)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=str(workdir))
    # Continuous checkpoint sync, done once at the end here.
    sync_checkpoints(s3, request, workdir)
    return proc


CONTAINER_ENV = "LLMOPS_SIM_CONTAINER"   # marks every process of one simulated container


def kill_container(marker: str) -> int:
    """SIGKILL every process of the simulated container `marker` (its CONTAINER_ENV value, which
    every process it starts inherits): a container's end takes all its processes, including those
    in sessions of their own that outlived their parent (a supervisor's worker). Returns how many."""
    needle = f"\0{CONTAINER_ENV}={marker}\0".encode()
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in b"\0" + (entry / "environ").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
        except (OSError, ProcessLookupError):
            continue
    return killed


def image_root() -> Path:
    """The checkout the simulated containers run, as if their image were built from it: this
    one, or $LLMOPS_SIM_IMAGE_ROOT (a benchmark runs another commit's workload code beside this
    commit's simulator)."""
    return Path(os.environ.get("LLMOPS_SIM_IMAGE_ROOT") or ROOT)


def host_dir(workdir: Path, request: dict, host: int) -> Path:
    """Host `host`'s own disk under `workdir`: the workdir itself for a one-instance job, else
    `algo-<host+1>/` (SageMaker's host names): instances of a job share no disk."""
    count = request["ResourceConfig"]["InstanceCount"]
    return workdir if count == 1 else workdir / f"algo-{host + 1}"


def training_container(s3: Any, request: dict, workdir: Path, s3_endpoint: str,
                       extra_env: dict | None = None, *, host: int = 0,
                       master_port: int = 0) -> tuple[list[str], dict[str, str]]:
    """Lay out /opt/ml on host `host`'s own disk under `workdir` for a CreateTrainingJob
    `request` (channels and checkpoints downloaded from S3) and return the container's command
    and environment. Shared with tests/chaos/fake_aws/sagemaker.py, which runs the same command in the
    background, one per instance.

    Simulated part of the SageMaker PyTorch toolkit: with `sagemaker_torch_distributed_enabled`
    on several instances it runs torchrun around the program (nodes = instances, node rank = the
    host's index, the first host the rendezvous, `master_port`); one process per host here (CPU
    instances). One instance runs the program directly."""
    opt_ml = host_dir(workdir, request, host) / "opt_ml"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SM_", "AIRFLOW_CONN_"))}
    env.update(request.get("Environment", {}))
    for channel in request.get("InputDataConfig", []):
        local = opt_ml / "input" / "data" / channel["ChannelName"]
        _download(s3, channel["DataSource"]["S3DataSource"]["S3Uri"], local)
        env[f"SM_CHANNEL_{channel['ChannelName'].upper()}"] = str(local)
    checkpoints = opt_ml / "checkpoints"
    if request.get("CheckpointConfig"):  # a restarted job gets its checkpoints back
        _download(s3, request["CheckpointConfig"]["S3Uri"], checkpoints)
    hosts = [f"algo-{i + 1}" for i in range(request["ResourceConfig"]["InstanceCount"])]
    env.update({"SM_HOSTS": json.dumps(hosts), "SM_CURRENT_HOST": hosts[host],
                "LLMOPS_WORKDIR": str(opt_ml / "llmops"), "LLMOPS_CHECKPOINT_DIR": str(checkpoints),
                "TMPDIR": str(_mkdir(opt_ml.parent / "tmp")),
                "AWS_ENDPOINT_URL_S3": s3_endpoint, "PYTHONPATH": str(image_root()),
                "TRAINING_JOB_NAME": request["TrainingJobName"], **(extra_env or {})})
    # The toolkit decodes each hyperparameter from JSON and passes the non-`sagemaker_` ones to
    # the program as `--name value`.
    args = []
    hyperparameters = {k: json.loads(v) for k, v in request.get("HyperParameters", {}).items()}
    for name, value in sorted(hyperparameters.items()):
        if not name.startswith("sagemaker_"):
            args += [f"--{name}", str(value)]
    launch = [sys.executable]
    if len(hosts) > 1 and hyperparameters.get("sagemaker_torch_distributed_enabled"):
        launch += ["-m", "torch.distributed.run", f"--nnodes={len(hosts)}", f"--node_rank={host}",
                   "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={master_port}"]
    return [*launch, str(image_root() / ENTRY.relative_to(ROOT)), *args], env


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def sync_checkpoints(s3: Any, request: dict, workdir: Path, seen: dict | None = None) -> None:
    """Every host's /opt/ml/checkpoints back to CheckpointConfig.S3Uri (SageMaker syncs each
    instance's continuously, all to the same URI). `seen` ({path: (size, mtime)} of what went up
    before) makes a sync upload only what is new or changed, as SageMaker's does."""
    if request.get("CheckpointConfig"):
        for host in range(request["ResourceConfig"]["InstanceCount"]):
            local = host_dir(workdir, request, host) / "opt_ml" / "checkpoints"
            if local.is_dir():
                _upload(s3, local, request["CheckpointConfig"]["S3Uri"], seen)


def _download(s3: Any, uri: str, local: Path) -> None:
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    local.mkdir(parents=True, exist_ok=True)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix):].lstrip("/") or obj["Key"].rsplit("/", 1)[-1]
            (local / rel).parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(local / rel))


def _upload(s3: Any, local: Path, uri: str, seen: dict | None = None) -> None:
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    for path in sorted(local.rglob("*")):
        if path.is_file():
            stat = path.stat()
            if seen is not None and seen.get(path) == (stat.st_size, stat.st_mtime_ns):
                continue
            s3.upload_file(str(path), bucket, f"{prefix.rstrip('/')}/{path.relative_to(local).as_posix()}")
            if seen is not None:
                seen[path] = (stat.st_size, stat.st_mtime_ns)


# -- a real Ray cluster for the Ray Jobs API ---------------------------------------------------

@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """A one-node Ray cluster with its dashboard (the Jobs REST API) on 127.0.0.1; its URL."""
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # Ray's socket paths must stay short
    dashboard, gcs = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--num-cpus=2",
         f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
         "--include-dashboard=true", f"--temp-dir={temp}", "--disable-usage-stats",
         "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port",
         str(free_port())],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{dashboard}"
    try:
        wait_http(f"{url}/api/version", timeout=90)
        yield url
    finally:
        stop_process_group(proc, grace=3)
        _end_session_leftovers(proc.pid)
        import shutil

        shutil.rmtree(temp, ignore_errors=True)


def _end_session_leftovers(sid: int) -> None:
    """Ray workers may leave the process group; they stay in the session we started."""
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            if os.getsid(int(pid_dir.name)) == sid:
                os.kill(int(pid_dir.name), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
