"""Deployment settings of the remote backends: one typed block per backend, read at submit time.

They live in the Airflow Variable `llmops_backends` (JSON; on MWAA a Variable or a Secrets Manager
entry, locally `AIRFLOW_VAR_LLMOPS_BACKENDS`). Credentials are NOT here: AWS access comes from the
Airflow connection named by `aws_conn_id` (on MWAA the execution role), the Ray token from the
connection named by `ray_conn_id`. Nothing in a block may be secret: it is copied into job
requests, which AWS shows to anyone who can describe the job.

    {"sagemaker": {"role_arn": "arn:aws:iam::123456789012:role/llmops-training",
                   "staging_uri": "s3://my-bucket/llmops", "image": "<ecr>/llmops-train:0.1.0",
                   "instance_type": "ml.g5.2xlarge",
                   "stages": {"pretrain": {"instance_type": "ml.p5.48xlarge", "instance_count": 2,
                                           "spot": true}}},
     "batch": {...}, "hyperpod": {...}, "ray": {...}}

A block's `stages` entry overrides its fields for one stage; a run's `stage_resources` Param
(instance type and count, processes per node, image, max run time) overrides both.

How a remote job is watched, per block (or stage):
- `poll_interval_seconds` (default 30, at least 5): how often the task (or the triggerer) reads
  the job's state and new log lines. The SageMaker, SageMaker Processing and Batch backends put
  it into the job's handle as `poll_interval`; AWS rate-limits describe and CloudWatch calls per account, and a sweep polls
  many jobs at once.
- `deadline_grace_seconds` (default 1800, at least 0): the service itself stops a job at its max
  run time (SageMaker StoppingCondition, Batch attemptDurationSeconds); Airflow's own deadline is
  the job's start + its max run time + this grace, a backstop for a service that did not.
- `max_queue_seconds` (default 0: no bound): how long a job may wait for capacity or admission
  before it first starts, counted from its submission. Past it Airflow stops the job and fails
  the task with the service's last waiting reason (Batch statusReason, SageMaker StatusMessage,
  Kueue's message). SageMaker also gets it as StoppingCondition.MaxPendingTimeInSeconds when it
  is within the service's range (1800 s to 28 days), so SageMaker stops the job itself. Set it
  per stage (`stages`) to wait hours for a pretraining fleet but minutes for an evaluation.
- SageMaker spot: `spot_wait_factor` (default 2.0, at least 1) makes MaxWaitTimeInSeconds that
  many times MaxRuntimeInSeconds, the slack for waiting on spot capacity and for restarts after
  interruptions; `max_wait_seconds` sets it explicitly instead.

Encryption: `kms_key_id` (a KMS key id, key ARN, alias/<name> or alias ARN) is applied to every S3
object the Airflow side writes for a job (ServerSideEncryption aws:kms + SSEKMSKeyId: a bucket
policy that requires SSE-KMS refuses anything else), to what the service writes itself (SageMaker
OutputDataConfig / ProcessingOutputConfig KmsKeyId, unless `output_kms_key_id` names another key),
and is handed to the job as LLMOPS_S3_KMS_KEY_ID for its own writes (docker/job_entry.py). The
same variable in the Airflow environment is the key of the Airflow side's other S3 writes (step
cache, job ledger, log cursors) and of a block without `kms_key_id` (llmops.aws.s3).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

from llmops import settings as deployment
from tasks.configs import ConfigError, from_dict, to_dict

VARIABLE = deployment.BACKENDS_VARIABLE
MIN_POLL_INTERVAL = 5
# A KMS key as S3 and SageMaker take it: key id, multi-Region key id, key or alias ARN, alias name.
KMS_KEY = re.compile(r"^(arn:aws[a-z-]*:kms:[a-z0-9-]+:\d{12}:(key|alias)/[A-Za-z0-9/_-]+"
                     r"|alias/[A-Za-z0-9/_-]+|(mrk-)?[0-9a-f]{32}|[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12})$")
S = TypeVar("S", bound="RemoteSettings")


class BackendSettingsError(ValueError):
    """A backend's settings are missing or wrong; the message names the key and the fix."""


@dataclass(kw_only=True)
class RemoteSettings:
    aws_conn_id: str = "aws_default"   # Airflow connection for AWS (region, endpoint, role)
    region_name: str = ""              # empty = the connection's region
    staging_uri: str = ""              # s3:// prefix for configs, results and staged local inputs
    image: str = ""                    # default image when the run does not pick one
    instance_type: str = ""
    instance_count: int = 0            # 0 = the spec's
    nproc_per_node: int = 0            # 0 = the spec's
    entry_script: str = "/opt/llmops/job_entry.py"  # where docker/job_entry.py sits in the image
    env: dict = field(default_factory=dict)         # extra (non-secret) environment for every job
    tags: dict = field(default_factory=dict)        # extra tags for every job (cost allocation)
    stages: dict = field(default_factory=dict)      # stage -> overrides of the fields above
    poll_interval_seconds: int = 30    # how often the job's state and log are read (>= 5)
    deadline_grace_seconds: int = 1800  # Airflow's backstop beyond the job's max run time (>= 0)
    kms_key_id: str = ""               # SSE-KMS for every S3 write of a job (see the module docstring)
    max_queue_seconds: int = 0         # longest wait before the job first starts (0 = no bound)

    def __post_init__(self) -> None:
        if self.kms_key_id and not KMS_KEY.match(self.kms_key_id):
            raise BackendSettingsError(
                f"{type(self).__name__}.kms_key_id {self.kms_key_id!r} is not a KMS key: give its key "
                "id, key ARN (arn:aws:kms:<region>:<account>:key/<id>), alias/<name> or alias ARN.")
        if self.poll_interval_seconds < MIN_POLL_INTERVAL:
            raise BackendSettingsError(
                f"{type(self).__name__}.poll_interval_seconds must be at least {MIN_POLL_INTERVAL} "
                f"(AWS rate-limits describe calls per account), got {self.poll_interval_seconds}.")
        if self.deadline_grace_seconds < 0:
            raise BackendSettingsError(f"{type(self).__name__}.deadline_grace_seconds must be >= 0, "
                                       f"got {self.deadline_grace_seconds}.")
        if not isinstance(self.max_queue_seconds, int) or self.max_queue_seconds < 0:
            raise BackendSettingsError(
                f"{type(self).__name__}.max_queue_seconds must be a whole number of seconds >= 0 "
                f"(0 = wait for capacity without a bound), got {self.max_queue_seconds!r}.")

    def for_stage(self: S, stage: str) -> S:
        """These settings with the stage's overrides applied (unknown keys refused)."""
        overrides = self.stages.get(stage) or {}
        if not isinstance(overrides, dict):
            raise BackendSettingsError(f"{type(self).__name__}.stages.{stage} must be an object.")
        data = {**to_dict(self), **overrides, "stages": {}}
        try:
            return from_dict(type(self), data, where=f"{type(self).__name__}.stages.{stage}")
        except ConfigError as exc:
            raise BackendSettingsError(str(exc)) from None

    def for_job(self: S, spec: Any) -> S:
        """for_stage, then the job's own settings_overrides for this class (the run's team's
        role, fair share, namespace and queue, put on the spec by whoever built it): no stage
        override replaces them."""
        block = self.for_stage(spec.stage)
        overrides = spec.settings_overrides.get(type(self).__name__) or {}
        return dataclasses.replace(block, **overrides) if overrides else block

    def require(self, *names: str, backend: str) -> None:
        missing = [n for n in names if not getattr(self, n)]
        if missing:
            raise BackendSettingsError(
                f"The {backend} backend needs {', '.join(missing)} in the Airflow Variable "
                f"'{VARIABLE}' (key '{backend}'), e.g. "
                + json.dumps({backend: {n: EXAMPLES.get(n, "...") for n in missing}}))


EXAMPLES = {
    "role_arn": "arn:aws:iam::123456789012:role/llmops-sagemaker",
    "staging_uri": "s3://my-bucket/llmops",
    "image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/llmops-train:0.1.0",
    "instance_type": "ml.g5.2xlarge",
    "job_queue": "llmops-gpu",
    "eks_cluster_name": "my-hyperpod-eks",
}


@dataclass(kw_only=True)
class SageMakerSettings(RemoteSettings):
    role_arn: str = ""
    # How SageMaker launches processes across instances: torch_distributed (torchrun),
    # pytorchddp (mpirun), smdistributed_dataparallel, smdistributed_modelparallel, mpi, none;
    # auto = torch_distributed when the job has several instances or processes, else none.
    distribution: str = "auto"
    mp_parameters: dict = field(default_factory=dict)  # smdistributed model parallel parameters
    mpi_processes_per_host: int = 0                     # 0 = the spec's nproc_per_node
    mpi_custom_options: str = ""
    input_mode: str = "File"            # File (copied before start) or FastFile (streamed from S3)
    volume_size_gb: int = 100
    volume_kms_key_id: str = ""
    output_kms_key_id: str = ""
    spot: bool = False                  # managed spot training (needs checkpoints to resume)
    spot_wait_factor: float = 2.0       # spot: MaxWait = factor x MaxRuntime (capped at 28 days)
    max_wait_seconds: int = 0           # spot: an explicit MaxWait instead of the factor
    retry_attempts: int = 0             # SageMaker's own retries of internal errors (RetryStrategy)
    keep_alive_seconds: int = 0         # warm pool: keep the instances for the next job
    subnets: list = field(default_factory=list)
    security_group_ids: list = field(default_factory=list)
    encrypt_inter_container_traffic: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.spot_wait_factor < 1:
            raise BackendSettingsError(
                f"SageMakerSettings.spot_wait_factor must be at least 1 (SageMaker needs "
                f"MaxWaitTimeInSeconds >= MaxRuntimeInSeconds), got {self.spot_wait_factor}.")
        if self.max_wait_seconds < 0:
            raise BackendSettingsError(f"SageMakerSettings.max_wait_seconds must be >= 0 (0 = "
                                       f"spot_wait_factor x the max run time), got {self.max_wait_seconds}.")


@dataclass(kw_only=True)
class ProcessingSettings(RemoteSettings):
    role_arn: str = ""
    volume_size_gb: int = 50
    volume_kms_key_id: str = ""
    shard_inputs: bool = True           # several instances: each gets a share of the S3 keys
    subnets: list = field(default_factory=list)
    security_group_ids: list = field(default_factory=list)


@dataclass(kw_only=True)
class BatchSettings(RemoteSettings):
    job_queue: str = ""
    share_identifier: str = ""          # fair share; "" = the run's team (its llmops_teams share)
    job_role_arn: str = ""              # the role the containers run with (S3, MLflow access)
    execution_role_arn: str = ""        # pulls the image, writes logs (Fargate/ECR)
    vcpus: int = 8
    memory_mib: int = 30000
    gpus: int = 0                       # per node
    efa_devices: int = 0                # per node; >0 adds /dev/infiniband/uverbs* and EFA env
    shared_memory_mib: int = 0          # /dev/shm for data loader workers; 0 = Docker's default
    retry_attempts: int = 1             # Batch attempts per job (1-10)
    propagate_tags: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.share_identifier and not re.fullmatch(r"[A-Za-z0-9]{1,255}\*?", self.share_identifier):
            raise BackendSettingsError(
                f"BatchSettings.share_identifier {self.share_identifier!r} is not a Batch fair-share "
                "identifier: letters and digits only (at most 255), optionally ending in '*'.")


@dataclass(kw_only=True)
class HyperPodSettings(RemoteSettings):
    kind: str = "HyperPodPyTorchJob"    # or PyTorchJob (Kubeflow training operator)
    eks_cluster_name: str = ""          # credentials through EksHook and aws_conn_id ...
    kubernetes_conn_id: str = ""        # ... or a Kubernetes connection instead
    # May use {team}: hyperpod-ns-{team} under task governance. "" = the kind's DEFAULT_NAMESPACES.
    # HyperPod auto-resumes a PyTorchJob only in `kubeflow` or a namespace starting `hyperpod`.
    namespace: str = ""
    queue_name: str = ""                # Kueue local queue, e.g. hyperpod-ns-{team}-localqueue
    priority_classes: dict = field(default_factory=dict)  # min priority -> class, {"0": "low", "500": "high"}
    service_account: str = ""
    gpus_per_node: int = 0
    efa_per_node: int = 0
    cpu: str = ""                       # per node, Kubernetes quantities: "90", "1000Gi"
    memory: str = ""
    node_selector: dict = field(default_factory=dict)
    max_retry_count: int = 3            # HyperPod auto-resume: restarts after a node fault
    require_healthy_nodes: bool = True  # only nodes HyperPod's health checks mark Schedulable
    # HyperPod hang/slowness detection from the job's log lines (HyperPodPyTorchJob only).
    log_monitoring: list = field(default_factory=lambda: [{
        "name": "training-step-progress",
        "logPattern": r".*step (\d+)/\d+.*",
        "expectedStartCutOffInSeconds": 1800,
        "expectedRecurringFrequencyInSeconds": 900,
    }])

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in HYPERPOD_KINDS:
            raise BackendSettingsError(f"HyperPodSettings.kind {self.kind!r} is not one of "
                                       f"{list(HYPERPOD_KINDS)}.")
        if self.max_retry_count < 0:
            raise BackendSettingsError(f"HyperPodSettings.max_retry_count must be >= 0, got "
                                       f"{self.max_retry_count}.")
        if "{" not in self.namespace:   # with {team}, checked once the run's team is known
            check_auto_resume_namespace(self, self.resolved_namespace())

    def resolved_namespace(self, team: str = "default") -> str:
        """The namespace a job of `team` goes to."""
        return (self.namespace or DEFAULT_NAMESPACES[self.kind]).format(team=team)


# Where a job goes when the settings name no namespace. A PyTorchJob gets HyperPod's auto-resume
# (the job-auto-resume annotations) only in these namespaces; the HyperPod training operator
# resumes its own HyperPodPyTorchJob (runPolicy.jobMaxRetryCount) in any.
HYPERPOD_KINDS = ("HyperPodPyTorchJob", "PyTorchJob")
DEFAULT_NAMESPACES = {"HyperPodPyTorchJob": "default", "PyTorchJob": "kubeflow"}


def auto_resumes(kind: str, namespace: str) -> bool:
    """Whether HyperPod restarts a job of `kind` in `namespace` after a node fault."""
    return kind != "PyTorchJob" or namespace == "kubeflow" or namespace.startswith("hyperpod")


def check_auto_resume_namespace(settings: HyperPodSettings, namespace: str) -> None:
    """Refuse a PyTorchJob that asks for auto-resume (max_retry_count > 0) in a namespace where
    HyperPod silently does not give it: after a node fault it would fail, not resume."""
    if settings.max_retry_count and not auto_resumes(settings.kind, namespace):
        raise BackendSettingsError(
            f"HyperPodSettings.namespace {namespace!r}: HyperPod auto-resumes a PyTorchJob only in "
            "the 'kubeflow' namespace or one starting with 'hyperpod' (e.g. hyperpod-ns-{team}). "
            "Set namespace to one of those, kind to HyperPodPyTorchJob, or max_retry_count to 0 "
            "to run without auto-resume.")




@dataclass(kw_only=True)
class RaySettings(RemoteSettings):
    ray_conn_id: str = "ray_default"    # HTTP connection: host = dashboard URL, password = token
    python: str = "python"
    runtime_env: dict = field(default_factory=dict)  # extra Ray runtime_env (working_dir, pip, ...)
    entrypoint_num_cpus: float = 0.0
    entrypoint_num_gpus: float = 0.0


def settings_class(backend: str) -> type[RemoteSettings]:
    """The settings block class of a remote backend (its key in the Variable)."""
    return {"sagemaker": SageMakerSettings, "sagemaker_processing": ProcessingSettings,
            "batch": BatchSettings, "hyperpod": HyperPodSettings, "ray": RaySettings}[backend]


def load(backend: str, cls: type[S], settings: dict[str, Any] | None = None) -> S:
    """The settings block of `backend`, from `settings` or else the Airflow Variable."""
    raw = settings if settings is not None else _variable()
    block = raw.get(backend, {}) if isinstance(raw, dict) else {}
    try:
        return from_dict(cls, block, where=f"{VARIABLE}.{backend}")
    except ConfigError as exc:
        raise BackendSettingsError(str(exc)) from None


def _variable() -> dict[str, Any]:
    data = deployment.variable_json(VARIABLE, BackendSettingsError)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise BackendSettingsError(f"The Airflow Variable '{VARIABLE}' must be a JSON object.")
    return data
