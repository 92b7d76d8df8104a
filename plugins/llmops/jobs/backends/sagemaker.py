"""SageMaker Training (`sagemaker`) and SageMaker Processing (`sagemaker_processing`) backends.

A JobSpec becomes a CreateTrainingJob request (rendered by `training_request`, a pure function):

    spec.image / instance_type / instance_count -> AlgorithmSpecification.TrainingImage, ResourceConfig
    spec.nproc_per_node + settings.distribution -> the `sagemaker_*` hyperparameters that make the
        DLC's training toolkit launch torchrun (torch_distributed), mpirun (pytorchddp, mpi) or
        smdistributed data / model parallel on every instance
    spec.entrypoint, config, result, outputs    -> hyperparameters for docker/job_entry.py (run by
        the toolkit as `sagemaker_program`); the stage config itself is an input channel
    config inputs (s3://, fsx://, local paths)  -> input channels (File / FastFile / FSx for Lustre)
    spec.checkpoint_uri                         -> CheckpointConfig, synced with /opt/ml/checkpoints,
                                                   so every attempt resumes from the last one
    spec.max_run_seconds                        -> StoppingCondition.MaxRuntimeInSeconds (all
                                                   attempts of RetryStrategy together), and with spot
                                                   MaxWaitTimeInSeconds = spot_wait_factor x that
    settings.max_queue_seconds                  -> StoppingCondition.MaxPendingTimeInSeconds when
                                                   within SageMaker's range (1800 s - 28 days);
                                                   Airflow's own queue check is the backstop
    spec.env (+ EFA/NCCL on multi-node GPUs)    -> Environment (secrets refused)
    spec.tags + stage + job                     -> Tags (+ this try's submit token)
    settings                                    -> role, spot, RetryStrategy, warm pool, VPC, KMS
    settings.kms_key_id                         -> OutputDataConfig / ProcessingOutputConfig
                                                   KmsKeyId, SSE-KMS on every staged object, and
                                                   LLMOPS_S3_KMS_KEY_ID for the job's own writes

Requests are checked against botocore's service model (lengths, patterns, enums) before they are
sent, and kept at `<staging>/<spec name>/<job>/request.json` as the record of what ran.
Processing renders CreateProcessingJob the same way: one container per instance, the data
inputs sharded by S3 key when there are several instances.

One job per attempt, whatever the network loses: an attempt's name is the spec's name (its hash
never cut, llmops.jobs.backends.remote.attempt_name) plus `-r<N>`, and SageMaker refuses a second
job of a name. When a create's response is lost, botocore sends it again and SageMaker answers
ResourceInUse: the job exists, and its `llmops:submit-token` tag says whether this try created it
(a submit, not a reattach, for the job ledger).

Waiting: the handle carries `poll_interval` and `deadline_grace_seconds` (settings), a status's
details carry `started_at` once the job runs (the first `Training` transition: TrainingStartTime
is set while data and image are still downloading), so Airflow's deadline counts from there.
A job not yet running says why in its status message: the secondary status and the newest
transition's StatusMessage (`InProgress (Starting): Insufficient capacity error from EC2 while
launching instances, retrying!`), which the watch logs once per change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import time
import uuid
from typing import Any

from llmops.aws import s3
from llmops.aws.validation import validate_request
from llmops.jobs.backends import remote
from llmops.jobs.backends.base import Backend, JobState, JobStatus
from llmops.jobs.backends.settings import ProcessingSettings, SageMakerSettings, load
from llmops.jobs.spec import JobSpec, JobSpecError

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "/opt/ml/checkpoints"
WORKDIR = "/opt/ml/llmops"            # on the job's volume, not the small root disk
CODE_DIR = "/opt/ml/code"             # docker/Dockerfile.train copies job_entry.py here
CONFIG_CHANNEL = "llmops_config"
PROCESSING_INPUT = "/opt/ml/processing/input"
PROCESSING_OUTPUT = "/opt/ml/processing/output"
PROCESSING_MAX_RUNTIME = 777_600      # the service's limit for processing jobs (9 days)
SHARDS_CHANNEL = "llmops_shards"      # the finalize job's copy of every host's shards
# Stages that follow the shards-then-finalize contract (tasks/data/prep.py): on several
# Processing instances they run as two jobs in one handle (SageMakerProcessingBackend).
TWO_PHASE_ENTRYPOINTS = ("tasks.data.prep",)
STOPPING_WAIT_SECONDS = 600
TOKEN_TAG = "llmops:submit-token"     # which try created a job (see the module docstring)
# botocore's model gives MaxWaitTimeInSeconds no upper bound; 28 days is SageMaker's documented
# maximum run time of a training job (MaxRuntimeInSeconds, whose default quota is 5 days).
SPOT_MAX_WAIT = 2_419_200
# StoppingCondition.MaxPendingTimeInSeconds: botocore's model says min 1800, max 2419200.
MAX_PENDING_RANGE = (1800, 2_419_200)
# InProgress with these secondary statuses has not started the program yet (or, after a spot
# interruption, is waiting to start it again).
NOT_RUNNING = {"Starting", "Pending", "LaunchingMLInstances", "PreparingTrainingStack", "Downloading",
               "DownloadingTrainingImage", "Interrupted", "Restarting"}

DISTRIBUTIONS = ("auto", "none", "torch_distributed", "pytorchddp", "smdistributed_dataparallel",
                 "smdistributed_modelparallel", "mpi")
# Instance types with Elastic Fabric Adapter, and those with GPUDirect RDMA over it (EC2 names;
# SageMaker's carry an "ml." prefix).
EFA_TYPES = {"p3dn.24xlarge", "p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge",
             "p5en.48xlarge", "p6-b200.48xlarge", "g5.48xlarge", "g6.48xlarge", "g6e.48xlarge",
             "trn1.32xlarge", "trn1n.32xlarge"}
RDMA_TYPES = {"p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge",
              "p6-b200.48xlarge"}
SMDDP_TYPES = {"ml.p3.16xlarge", "ml.p3dn.24xlarge", "ml.p4d.24xlarge", "ml.p4de.24xlarge",
               "ml.p5.48xlarge", "ml.p5e.48xlarge", "ml.p5en.48xlarge"}
# The training loop's progress line, for SageMaker's metric charts.
METRICS = [{"Name": "train:loss", "Regex": r"step \d+/\d+ \| loss ([0-9.eE+-]+)"},
           {"Name": "train:tokens_per_s", "Regex": r"\| ([0-9.]+) tok/s"}]

_TAG_CHARS = re.compile(r"[^\w\s.:/=+\-@]", re.UNICODE)


def is_gpu(instance_type: str) -> bool:
    return bool(re.match(r"(ml\.)?(p\d|g\d)", instance_type))


def fabric_env(instance_type: str, instance_count: int, efa: bool | None = None) -> dict[str, str]:
    """EFA and NCCL settings for collectives across instances (none on a single instance).

    NCCL_DEBUG=WARN: warnings and errors only. INFO prints thousands of lines per rank at start
    (every ring and channel), which CloudWatch ingests and bills, and MWAA's task log copies
    again; set NCCL_DEBUG=INFO in the stage's env to see whether NCCL picked EFA ("NET/OFI
    Selected Provider is efa") and GPUDirect RDMA ("via NET/AWS Libfabric/1/GDRDMA"). `efa`
    overrides the lookup by instance type (Batch knows its EFA devices, not always the type)."""
    name = instance_type.removeprefix("ml.")
    has_efa = name in EFA_TYPES if efa is None else efa
    if instance_count < 2 or not (is_gpu(name) or has_efa):
        return {}
    env = {"NCCL_DEBUG": "WARN"}
    if has_efa:
        env.update(FI_PROVIDER="efa", NCCL_PROTO="simple")
        if name in RDMA_TYPES:
            env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    return env


def aws_tags(tags: dict[str, str]) -> list[dict[str, str]]:
    """Tags within AWS's rules: allowed characters, 128/256 characters, no `aws:` keys."""
    out = []
    for key, value in sorted(tags.items()):
        key = _TAG_CHARS.sub("_", str(key))[:128]
        if not key or key.lower().startswith("aws:"):
            continue
        out.append({"Key": key, "Value": _TAG_CHARS.sub("_", str(value))[:256]})
    return out[:50]


def distribution_hyperparameters(distribution: str, instance_type: str, instance_count: int,
                                 nproc_per_node: int, settings: SageMakerSettings) -> dict[str, Any]:
    """The hyperparameters the SageMaker PyTorch training toolkit reads to launch processes
    (what the SageMaker Python SDK's `distribution=` argument renders to)."""
    if distribution not in DISTRIBUTIONS:
        raise JobSpecError(f"sagemaker distribution {distribution!r} is not one of {list(DISTRIBUTIONS)}.")
    if distribution == "auto":
        distribution = "torch_distributed" if instance_count > 1 or nproc_per_node > 1 else "none"
    procs = settings.mpi_processes_per_host or nproc_per_node
    if distribution == "none":
        if nproc_per_node > 1:
            raise JobSpecError("nproc_per_node > 1 needs a distribution that launches processes "
                               "(torch_distributed, pytorchddp, mpi or smdistributed).")
        return {}
    if distribution == "torch_distributed":
        # The toolkit's torchrun starts `sagemaker_mpi_num_of_processes_per_host` processes per
        # instance, and one per GPU without it: the run's nproc_per_node would be ignored.
        return {"sagemaker_torch_distributed_enabled": True, "sagemaker_instance_type": instance_type,
                "sagemaker_mpi_num_of_processes_per_host": procs}
    if distribution == "pytorchddp":
        return {"sagemaker_pytorch_ddp_enabled": True, "sagemaker_instance_type": instance_type}
    if distribution == "smdistributed_dataparallel":
        if instance_type not in SMDDP_TYPES:
            raise JobSpecError(f"smdistributed data parallel runs on {sorted(SMDDP_TYPES)}, "
                               f"not {instance_type}.")
        return {"sagemaker_distributed_dataparallel_enabled": True,
                "sagemaker_instance_type": instance_type,
                "sagemaker_distributed_dataparallel_custom_mpi_options": settings.mpi_custom_options}
    mpi = {"sagemaker_mpi_enabled": True, "sagemaker_mpi_num_of_processes_per_host": procs,
           "sagemaker_mpi_custom_mpi_options": settings.mpi_custom_options}
    if distribution == "smdistributed_modelparallel":
        if not settings.mp_parameters:
            raise JobSpecError("smdistributed_modelparallel needs mp_parameters in the sagemaker "
                               "settings, e.g. {\"partitions\": 2, \"microbatches\": 4}.")
        return {**mpi, "mp_parameters": settings.mp_parameters}
    return mpi


def _encode(hyperparameters: dict[str, Any]) -> dict[str, str]:
    """Values as the SageMaker SDK sends them: JSON text, which the toolkit decodes again."""
    return {k: json.dumps(v) for k, v in hyperparameters.items()}


def _channel(ref: remote.InputRef, input_mode: str, vpc: bool, shard: bool = False) -> dict[str, Any]:
    if ref.base.startswith("fsx://"):
        if not vpc:
            raise JobSpecError(f"Input {ref.field} ({ref.value}) is on FSx for Lustre, which needs "
                               "subnets and security_group_ids in the sagemaker settings.")
        fs_id, _, path = ref.base[len("fsx://"):].partition("/")
        return {"ChannelName": ref.channel, "InputMode": "File",
                "DataSource": {"FileSystemDataSource": {
                    "FileSystemId": fs_id, "FileSystemType": "FSxLustre",
                    "FileSystemAccessMode": "ro", "DirectoryPath": "/" + path}}}
    uri = ref.base if ref.is_file else ref.base.rstrip("/") + "/"   # a prefix ends at a "/"
    return {"ChannelName": ref.channel, "InputMode": input_mode,
            "DataSource": {"S3DataSource": {
                "S3DataType": "S3Prefix", "S3Uri": uri,
                "S3DataDistributionType": "ShardedByS3Key" if shard else "FullyReplicated"}}}


def _channels(staged: remote.Staged) -> list[remote.InputRef]:
    seen, out = set(), []
    for ref in staged.inputs:
        if ref.channel not in seen:
            seen.add(ref.channel)
            out.append(ref)
    return out


def input_map(staged: remote.Staged, mount: dict[str, str]) -> dict[str, str]:
    """{URI prefix in the config: where it is inside the container}, for job_entry.py."""
    return {ref.base: remote.in_container(remote.InputRef(ref.field, ref.base, ref.base,
                                                          is_file=ref.is_file), mount[ref.channel])
            for ref in _channels(staged)}


def training_request(spec: JobSpec, settings: SageMakerSettings, staged: remote.Staged,
                     job_name: str, region: str = "") -> tuple[dict[str, Any], dict[str, str]]:
    """The CreateTrainingJob request for one attempt of `spec`, and where each input URI is
    mounted inside the container (for job_entry.py)."""
    res = remote.merged(spec, settings)
    if not res["image"]:
        raise JobSpecError(f"No image for the {spec.stage} job: set stage_resources.{spec.stage}.image "
                           "or `image` in the sagemaker settings (see docker/build.sh).")
    if not res["instance_type"]:
        raise JobSpecError(f"No instance type for the {spec.stage} job: set "
                           f"stage_resources.{spec.stage}.instance_type (e.g. ml.g5.2xlarge).")
    vpc = bool(settings.subnets)
    channels = _channels(staged)
    if len(channels) + 1 > 20:
        raise JobSpecError(f"The {spec.stage} config reads {len(channels)} inputs; SageMaker allows "
                           "19 channels besides the config. Point several fields at one directory.")
    mount = {ref.channel: f"${{SM_CHANNEL_{ref.channel.upper()}}}" for ref in channels}
    config_dir = f"${{SM_CHANNEL_{CONFIG_CHANNEL.upper()}}}"
    entry = {"entrypoint": spec.entrypoint, "config": f"{config_dir}/config.json",
             "input-map-file": f"{config_dir}/input_map.json", "result": staged.result_uri,
             "output-uri": staged.output_uri, "checkpoint-uri": staged.checkpoint_uri,
             "launcher": "none"}
    if spec.argv:
        entry["argv"] = json.dumps(list(spec.argv))
    hyperparameters = {
        "sagemaker_program": "job_entry.py", "sagemaker_submit_directory": CODE_DIR,
        "sagemaker_container_log_level": 20, "sagemaker_job_name": job_name,
        **({"sagemaker_region": region} if region else {}),
        **distribution_hyperparameters(settings.distribution, res["instance_type"],
                                       res["instance_count"], res["nproc_per_node"], settings),
        **entry,
    }
    env = {**fabric_env(res["instance_type"], res["instance_count"]), **res["env"],
           "LLMOPS_WORKDIR": WORKDIR, "LLMOPS_CHECKPOINT_DIR": CHECKPOINT_DIR,
           **remote.kms_env(settings)}
    remote.check_environment(env)
    if settings.spot and settings.keep_alive_seconds:
        raise JobSpecError("Warm pools (keep_alive_seconds) cannot be used with managed spot "
                           "training; set one of them to 0/false.")
    stopping = stopping_condition(spec, settings)
    resource: dict[str, Any] = {"InstanceType": res["instance_type"],
                                "InstanceCount": res["instance_count"],
                                "VolumeSizeInGB": settings.volume_size_gb}
    if settings.keep_alive_seconds:
        resource["KeepAlivePeriodInSeconds"] = settings.keep_alive_seconds
    if settings.volume_kms_key_id:
        resource["VolumeKmsKeyId"] = settings.volume_kms_key_id
    output: dict[str, str] = {"S3OutputPath": s3.join(staged.prefix, "sagemaker-output")}
    if settings.output_kms_key_id or settings.kms_key_id:
        output["KmsKeyId"] = settings.output_kms_key_id or settings.kms_key_id
    request: dict[str, Any] = {
        "TrainingJobName": job_name,
        "RoleArn": settings.role_arn,
        "AlgorithmSpecification": {"TrainingImage": res["image"], "TrainingInputMode": "File",
                                   "MetricDefinitions": METRICS},
        "HyperParameters": _encode(hyperparameters),
        "InputDataConfig": [
            {"ChannelName": CONFIG_CHANNEL, "InputMode": "File",
             "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix",
                                             "S3Uri": s3.join(staged.prefix, "llmops") + "/",
                                             "S3DataDistributionType": "FullyReplicated"}}},
            *(_channel(ref, settings.input_mode, vpc) for ref in channels)],
        "OutputDataConfig": output,
        "ResourceConfig": resource,
        "StoppingCondition": stopping,
        "CheckpointConfig": {"S3Uri": staged.checkpoint_uri, "LocalPath": CHECKPOINT_DIR},
        "EnableManagedSpotTraining": settings.spot,
        "Environment": env,
        "ProfilerConfig": {"DisableProfiler": True},
        "Tags": aws_tags(res["tags"]),
    }
    if res["instance_count"] > 1 and is_gpu(res["instance_type"]):
        # SageMaker's deep health checks before a multi-node job starts (a bad GPU found at
        # start-up costs minutes; found at hour 10 it costs the hours since the last checkpoint).
        request["InfraCheckConfig"] = {"EnableInfraCheck": True}
    if settings.retry_attempts:
        request["RetryStrategy"] = {"MaximumRetryAttempts": settings.retry_attempts}
    if vpc:
        request["VpcConfig"] = {"Subnets": list(settings.subnets),
                                "SecurityGroupIds": list(settings.security_group_ids)}
    if settings.encrypt_inter_container_traffic:
        request["EnableInterContainerTrafficEncryption"] = True
    return request, input_map(staged, mount)


def stopping_condition(spec: JobSpec, settings: SageMakerSettings) -> dict[str, int]:
    """MaxRuntimeInSeconds is the job's own limit. With spot, MaxWaitTimeInSeconds (waiting for
    capacity plus running, every interruption and RetryStrategy attempt included) must be at least
    that: spot_wait_factor x the run time, unless max_wait_seconds says otherwise."""
    runtime = spec.max_run_seconds
    pending = ({"MaxPendingTimeInSeconds": settings.max_queue_seconds}
               if service_bounds_queue(settings) else {})
    if not settings.spot:
        return {"MaxRuntimeInSeconds": runtime, **pending}
    wait = settings.max_wait_seconds or min(int(runtime * settings.spot_wait_factor), SPOT_MAX_WAIT)
    return {"MaxRuntimeInSeconds": min(runtime, wait), "MaxWaitTimeInSeconds": wait, **pending}


def service_bounds_queue(settings: SageMakerSettings) -> bool:
    """Whether SageMaker itself stops the job at max_queue_seconds (MaxPendingTimeInSeconds takes
    only 1800 s to 28 days; outside that range Airflow's own check alone bounds the wait)."""
    low, high = MAX_PENDING_RANGE
    return low <= settings.max_queue_seconds <= high


def started_at(kind: str, description: dict[str, Any]) -> float | None:
    """When the job's program started (epoch seconds), or None before that."""
    if kind == "processing":
        return remote.epoch(description.get("ProcessingStartTime"))
    for transition in description.get("SecondaryStatusTransitions") or []:
        if transition.get("Status") == "Training":
            return remote.epoch(transition.get("StartTime"))
    if description.get("SecondaryStatus", "Starting") not in NOT_RUNNING | {"Failed", "Stopped"}:
        return remote.epoch(description.get("TrainingStartTime"))
    return None


def processing_request(spec: JobSpec, settings: ProcessingSettings, staged: remote.Staged,
                       job_name: str, phase: str = "") -> tuple[dict[str, Any], dict[str, str]]:
    """The CreateProcessingJob request for one attempt of `spec`: one container per instance.

    `phase` splits a stage with the shards-then-finalize contract (tasks/data/prep.py) in two:
    "shards" runs `--stage shards` on every instance, each writing its shards under
    `<prefix>/shards/host-<i>` (the whole input list on every host: shards go by index mod N);
    "finalize" runs `--stage finalize` on one instance over all of them (copied into its output
    dir first), writing the stage's real output and result."""
    res = remote.merged(spec, settings)
    if phase:
        spec = spec.replace(argv=(*spec.argv, "--stage", phase))
    if phase == "shards":
        staged = dataclasses.replace(staged, output_uri=s3.join(staged.prefix, "shards"),
                                     result_uri=s3.join(staged.prefix, "shards", "result.json"))
    elif phase == "finalize":
        res["instance_count"] = 1
    if not res["image"] or not res["instance_type"]:
        raise JobSpecError(f"The {spec.stage} job needs an image and an instance type (e.g. "
                           "ml.m5.4xlarge): set them in stage_resources or the "
                           "sagemaker_processing settings.")
    if spec.max_run_seconds > PROCESSING_MAX_RUNTIME:
        raise JobSpecError(f"SageMaker Processing jobs run at most {PROCESSING_MAX_RUNTIME} s; "
                           f"max_run_seconds is {spec.max_run_seconds}.")
    channels = _channels(staged)
    if len(channels) + 1 > 10:
        raise JobSpecError(f"SageMaker Processing takes 10 inputs; the {spec.stage} config reads "
                           f"{len(channels)} besides its config.")
    mount = {ref.channel: f"{PROCESSING_INPUT}/{ref.channel}" for ref in channels}
    shard = settings.shard_inputs and res["instance_count"] > 1 and not phase

    def s3_input(name: str, uri: str, sharded: bool) -> dict[str, Any]:
        return {"InputName": name, "S3Input": {
            "S3Uri": uri, "LocalPath": f"{PROCESSING_INPUT}/{name}", "S3DataType": "S3Prefix",
            "S3InputMode": "File",
            "S3DataDistributionType": "ShardedByS3Key" if sharded else "FullyReplicated"}}

    inputs = [s3_input(CONFIG_CHANNEL, s3.join(staged.prefix, "llmops") + "/", False)]
    for ref in channels:
        if not s3.is_s3(ref.base):
            raise JobSpecError(f"SageMaker Processing reads S3 only; input {ref.field} is {ref.value}.")
        # Only the raw data files are split across instances; models and configs are needed whole.
        inputs.append(s3_input(ref.channel, ref.base if ref.is_file else ref.base.rstrip("/") + "/",
                               shard and ref.field.startswith("inputs.")))
    if phase == "finalize":
        inputs.append(s3_input(SHARDS_CHANNEL, s3.join(staged.prefix, "shards") + "/", False))
    config_dir = f"{PROCESSING_INPUT}/{CONFIG_CHANNEL}"
    args = remote.entry_args(spec, staged, config=f"{config_dir}/config.json",
                             input_map_file=f"{config_dir}/input_map.json",
                             launcher="none", nproc_per_node=1, output_local=PROCESSING_OUTPUT)
    if phase == "finalize":
        cut = args.index("--") if "--" in args else len(args)
        args[cut:cut] = ["--merge-output", f"{PROCESSING_INPUT}/{SHARDS_CHANNEL}"]
    env = {**res["env"], "LLMOPS_WORKDIR": "/opt/ml/processing/llmops", **remote.kms_env(settings)}
    remote.check_environment(env)
    cluster: dict[str, Any] = {"InstanceCount": res["instance_count"],
                               "InstanceType": res["instance_type"],
                               "VolumeSizeInGB": settings.volume_size_gb}
    if settings.volume_kms_key_id:
        cluster["VolumeKmsKeyId"] = settings.volume_kms_key_id
    request: dict[str, Any] = {
        "ProcessingJobName": job_name,
        "RoleArn": settings.role_arn,
        "AppSpecification": {"ImageUri": res["image"],
                             "ContainerEntrypoint": ["python3", settings.entry_script],
                             "ContainerArguments": args},
        "ProcessingResources": {"ClusterConfig": cluster},
        "ProcessingInputs": inputs,
        "ProcessingOutputConfig": {"Outputs": [{"OutputName": "output", "S3Output": {
            "S3Uri": staged.output_uri, "LocalPath": PROCESSING_OUTPUT,
            "S3UploadMode": "EndOfJob"}}]},
        "StoppingCondition": {"MaxRuntimeInSeconds": spec.max_run_seconds},
        "Environment": env,
        "Tags": aws_tags(res["tags"]),
    }
    if settings.kms_key_id:
        request["ProcessingOutputConfig"]["KmsKeyId"] = settings.kms_key_id
    if settings.subnets:
        request["NetworkConfig"] = {"VpcConfig": {"Subnets": list(settings.subnets),
                                                  "SecurityGroupIds": list(settings.security_group_ids)}}
    return request, input_map(staged, mount)


class _SageMakerBackend(Backend):
    kind = ""
    poll_interval = 30.0     # seconds; the handle's `poll_interval` (settings) takes precedence
    log_lag_seconds = 10.0   # CloudWatch: a job's last lines can arrive this long after its end
    settings_key = ""
    settings_cls: type = SageMakerSettings
    operation = ""

    def __init__(self, settings: dict[str, Any] | None = None):
        self._settings = settings  # None: read the Airflow Variable at submit time

    def _hook(self, aws_conn_id: str, region_name: str = "", kms_key_id: str = ""):
        from llmops.hooks.sagemaker import jobs_hook

        return jobs_hook(aws_conn_id, region_name, kms_key_id)   # one per process (llmops.aws.clients)

    def render(self, spec: JobSpec, settings: Any, staged: remote.Staged, job_name: str,
               region: str) -> tuple[dict[str, Any], dict[str, str]]:
        raise NotImplementedError

    def create(self, hook: Any, request: dict[str, Any]) -> None:
        raise NotImplementedError

    # -- submit ------------------------------------------------------------------------------
    def submit(self, spec: JobSpec) -> dict[str, Any]:
        if not spec.name:
            raise JobSpecError("JobSpec.name is required to submit: it makes retries reattach.")
        settings = load(self.settings_key, self.settings_cls, self._settings).for_job(spec)
        settings.require("role_arn", "staging_uri", backend=self.settings_key)
        remote.check_environment(spec.env)
        remote.warn_if_unreachable(spec.env, log)
        hook = self._hook(settings.aws_conn_id, settings.region_name, settings.kms_key_id)
        attempt, description = remote.latest_attempt(
            spec.name, lambda name: hook.describe_job(self.kind, name))
        if description is not None and hook.status_of(self.kind, description) == "Stopping":
            description = self._wait_stopped(hook, remote.attempt_name(spec.name, attempt))
        if description is not None and hook.status_of(self.kind, description) in ("InProgress", "Completed"):
            job_name = remote.attempt_name(spec.name, attempt)
            staged = remote.plan(spec, job_name, settings.staging_uri)
            return self._handle(spec, settings, staged, job_name, attempt, reattached=True)
        attempt += 1
        job_name = remote.check_name("sagemaker", remote.attempt_name(spec.name, attempt))
        staged = remote.plan(spec, job_name, settings.staging_uri)
        request, mapping = self.render(spec, settings, staged, job_name, hook.conn_region_name or "")
        token = uuid.uuid4().hex
        request["Tags"] = [*request["Tags"][:49], {"Key": TOKEN_TAG, "Value": token}]
        validate_request("sagemaker", self.operation, request)
        remote.upload(staged, hook.s3_hook, log)
        s3.write_json(hook.s3_hook, s3.join(staged.prefix, "llmops", "input_map.json"), mapping)
        s3.write_json(hook.s3_hook, s3.join(staged.prefix, "request.json"), request)
        submitted_at = time.time()   # a describe may not show the job for a while after this
        try:
            self.create(hook, request)
        except Exception as exc:
            if not ("already exists" in str(exc) or "ResourceInUse" in str(exc)):
                raise
            # Either botocore resent this create after its response was lost (the job is this
            # try's), or another try of this task created it a moment ago: use it either way.
            ours = self._created_by(hook, job_name, token)
            log.info("SageMaker %s job %s already exists (%s): using it", self.kind, job_name,
                     "created by this try, its first response lost" if ours else "another try's")
            return {**self._handle(spec, settings, staged, job_name, attempt, reattached=not ours),
                    "submitted_at": submitted_at}
        log.info("Created SageMaker %s job %s (attempt %d)", self.kind, job_name, attempt)
        return {**self._handle(spec, settings, staged, job_name, attempt, reattached=False),
                "submitted_at": submitted_at}

    def _created_by(self, hook: Any, job_name: str, token: str) -> bool:
        """Whether the job of this name carries `token` (was created by this try's request)."""
        description = hook.describe_job(self.kind, job_name) or {}
        arn = description.get("TrainingJobArn") or description.get("ProcessingJobArn")
        try:
            return bool(arn) and hook.job_tags(arn).get(TOKEN_TAG) == token
        except Exception as exc:  # noqa: BLE001 - only the ledger's submit/reattach word depends on it
            log.warning("Could not read the tags of %s (%s): counting it as another try's", job_name, exc)
            return False

    def _wait_stopped(self, hook: Any, name: str) -> dict[str, Any] | None:
        deadline = time.monotonic() + STOPPING_WAIT_SECONDS
        while time.monotonic() < deadline:
            description = hook.describe_job(self.kind, name)
            if description is None or hook.status_of(self.kind, description) != "Stopping":
                return description
            time.sleep(10)
        raise JobSpecError(f"SageMaker job {name} has been stopping for {STOPPING_WAIT_SECONDS} s; "
                           "retry the task once it has stopped.")

    def _handle(self, spec: JobSpec, settings: Any, staged: remote.Staged, job_name: str,
                attempt: int, reattached: bool) -> dict[str, Any]:
        return {"backend": self.name, "name": spec.name, "job_name": job_name, "attempt": attempt,
                "aws_conn_id": settings.aws_conn_id, "region_name": settings.region_name,
                "result_uri": staged.result_uri, "staging_prefix": staged.prefix,
                "copy_back": staged.copy_back,
                "output_uri": staged.output_uri, "checkpoint_uri": staged.checkpoint_uri,
                "reattached": reattached, "kms_key_id": settings.kms_key_id,
                **remote.resource_fields(spec, settings),
                **remote.watch_fields(settings, self._slack(spec, settings)),
                **self._queue_backstop(settings)}

    def _queue_backstop(self, settings: Any) -> dict[str, Any]:
        """The handle's max_queue_seconds when SageMaker enforces the bound itself: two polls
        later, so the service's own stop (and its reason) comes first."""
        return {}

    def _slack(self, spec: JobSpec, settings: Any) -> int:
        """Wall-clock time the service itself allows beyond the max run time (none here)."""
        return 0

    def fingerprint(self, spec: JobSpec) -> str:
        """A short hash of the stage's resolved settings block; no network I/O."""
        settings = load(self.settings_key, self.settings_cls, self._settings).for_job(spec)
        return remote.settings_fingerprint(settings)

    # -- observe -----------------------------------------------------------------------------
    def status(self, handle: dict[str, Any]) -> JobStatus:
        hook = self._hook(handle["aws_conn_id"], handle.get("region_name", ""))
        description = hook.describe_job(self.kind, handle["job_name"])
        if description is None:
            return remote.not_visible_yet(handle, f"SageMaker {self.kind} job {handle['job_name']}") or JobStatus(
                JobState.FAILED, f"SageMaker has no {self.kind} job {handle['job_name']}")
        state = hook.status_of(self.kind, description)
        details = {"status": state, "secondary": description.get("SecondaryStatus", ""),
                   "arn": description.get("TrainingJobArn") or description.get("ProcessingJobArn")}
        start = started_at(self.kind, description)
        if start is not None:
            details["started_at"] = start
        created = remote.epoch(description.get("CreationTime"))
        if created is not None:
            details["submitted_at"] = created   # queue time counts from here
        end = remote.epoch(description.get("TrainingEndTime") or description.get("ProcessingEndTime"))
        if end is not None:
            details["ended_at"] = end  # billing stops here (the job ledger's accelerator-hours)
        if description.get("BillableTimeInSeconds") is not None:
            # what SageMaker charges per instance: Downloading and Uploading included, managed
            # spot's discount applied (the ledger's cost)
            details["billed_seconds"] = float(description["BillableTimeInSeconds"])
        if state in ("InProgress", "Stopping"):
            secondary = description.get("SecondaryStatus", state)
            running = (secondary not in NOT_RUNNING if self.kind == "training"
                       else start is not None or state == "Stopping")
            message = f"{state} ({secondary})"
            transitions = description.get("SecondaryStatusTransitions") or []
            if not running and transitions and transitions[-1].get("StatusMessage"):
                message += f": {transitions[-1]['StatusMessage']}"  # e.g. held for capacity
            return JobStatus(JobState.RUNNING if running else JobState.PENDING, message,
                             details=details)
        if state == "Completed":
            result, why = remote.fetch_result(handle, hook.s3_hook, log)
            if result is None:
                return JobStatus(JobState.FAILED, why, details=details)
            return JobStatus(JobState.SUCCEEDED, result=result, details=details)
        reason = description.get("FailureReason") or description.get("ExitMessage") or state
        if state == "Stopped":
            return JobStatus(JobState.STOPPED, f"SageMaker job {handle['job_name']} was stopped: {reason}",
                             details=details)
        return JobStatus(JobState.FAILED, f"SageMaker job {handle['job_name']} failed: {reason}",
                         details=details)

    def read_logs(self, handle: dict[str, Any], cursor: Any = None) -> tuple[list[str], Any]:
        hook = self._hook(handle["aws_conn_id"], handle.get("region_name", ""))
        # A cursor is {stream: forward token}; 0 or None reads from the start. Keys with a leading
        # "_" came from older releases (a read timer) and are dropped.
        tokens = ({k: v for k, v in cursor.items() if not k.startswith("_")}
                  if isinstance(cursor, dict) else None)
        return hook.log_lines(self.kind, handle["job_name"], tokens)

    def log_tail(self, handle: dict[str, Any], lines: int = 40) -> list[str]:
        """The job's last `lines` log lines, reading only the end of each instance's stream."""
        hook = self._hook(handle["aws_conn_id"], handle.get("region_name", ""))
        return hook.log_tail(self.kind, handle["job_name"], lines)

    def stop(self, handle: dict[str, Any]) -> None:
        hook = self._hook(handle["aws_conn_id"], handle.get("region_name", ""))
        if hook.stop_job(self.kind, handle["job_name"]):
            log.info("Stopping SageMaker %s job %s", self.kind, handle["job_name"])


class SageMakerTrainingBackend(_SageMakerBackend):
    name = "sagemaker"
    kind = "training"
    settings_key = "sagemaker"
    settings_cls = SageMakerSettings
    operation = "CreateTrainingJob"

    def render(self, spec, settings, staged, job_name, region):
        return training_request(spec, settings, staged, job_name, region)

    def _slack(self, spec, settings):
        # Spot: SageMaker itself lets the job wait for capacity and restart up to MaxWait.
        wait = stopping_condition(spec, settings).get("MaxWaitTimeInSeconds", 0)
        return max(0, wait - spec.max_run_seconds)

    def _queue_backstop(self, settings):
        if not service_bounds_queue(settings):
            return {}
        return {"max_queue_seconds": settings.max_queue_seconds + 2 * settings.poll_interval_seconds}

    def create(self, hook, request):
        # The provider's hook also checks that every S3 channel exists before submitting.
        hook.create_training_job(request, wait_for_completion=False, print_log=False)


class SageMakerProcessingBackend(_SageMakerBackend):
    """Processing jobs. A two-phase stage (TWO_PHASE_ENTRYPOINTS) on N > 1 instances is one
    handle over two jobs: `<name>` runs the shards phase on N instances; when status() sees it
    Completed it creates the finalize job (one instance) from the request submit() stored at
    `<prefix>/finalize-request.json`, named `finalize_name(<name>)` (-r2, -r3... after a failed
    one), so a status() repeated from a retried trigger finds it instead of creating another.
    A retried task reattaches to the completed shards job and, when the finalize job failed,
    points the handle at the next finalize attempt: the shards are not redone."""

    name = "sagemaker_processing"
    kind = "processing"
    settings_key = "sagemaker_processing"
    settings_cls = ProcessingSettings
    operation = "CreateProcessingJob"

    def _two_phase(self, spec: JobSpec, settings: Any) -> bool:
        return spec.entrypoint in TWO_PHASE_ENTRYPOINTS and remote.merged(spec, settings)["instance_count"] > 1

    def render(self, spec, settings, staged, job_name, region):
        return processing_request(spec, settings, staged, job_name,
                                  "shards" if self._two_phase(spec, settings) else "")

    def create(self, hook, request):
        hook.create_processing_job(request, wait_for_completion=False)

    def submit(self, spec: JobSpec) -> dict[str, Any]:
        handle = super().submit(spec)
        settings = load(self.settings_key, self.settings_cls, self._settings).for_job(spec)
        if not self._two_phase(spec, settings):
            return handle
        staged = remote.plan(spec, handle["job_name"], settings.staging_uri)
        request, _ = processing_request(spec, settings, staged, handle["job_name"], "finalize")
        validate_request("sagemaker", self.operation, request)
        hook = self._hook(settings.aws_conn_id, settings.region_name, settings.kms_key_id)
        request_uri = s3.join(staged.prefix, "finalize-request.json")
        s3.write_json(hook.s3_hook, request_uri, request)   # the same content on every try
        base = finalize_name(handle["job_name"])
        attempt, found = remote.latest_attempt(base, lambda n: hook.describe_job(self.kind, n))
        if found is not None and hook.status_of(self.kind, found) in ("Failed", "Stopped"):
            attempt += 1
        return {**handle, "finalize": {"job_name": remote.attempt_name(base, max(attempt, 1)),
                                       "request_uri": request_uri,
                                       "shards_result_uri": s3.join(staged.prefix, "shards", "result.json")}}

    def status(self, handle: dict[str, Any]) -> JobStatus:
        phases = handle.get("finalize")
        if not phases:
            return super().status(handle)
        shards = super().status({**handle, "result_uri": phases["shards_result_uri"], "copy_back": {}})
        if shards.state is not JobState.SUCCEEDED:
            return JobStatus(shards.state, f"shards: {shards.message}".strip(), details=shards.details)
        hook = self._hook(handle["aws_conn_id"], handle.get("region_name", ""))
        if hook.describe_job(self.kind, phases["job_name"]) is None:
            request = {**s3.read_json(hook.s3_hook, phases["request_uri"]),
                       "ProcessingJobName": phases["job_name"]}
            try:
                self.create(hook, request)
                log.info("Shards done; created SageMaker processing job %s (finalize)", phases["job_name"])
            except Exception as exc:
                if not ("already exists" in str(exc) or "ResourceInUse" in str(exc)):
                    raise
            return JobStatus(JobState.RUNNING, f"finalize job {phases['job_name']} submitted",
                             details=shards.details)
        return super().status({**handle, "job_name": phases["job_name"]})

    def _current(self, handle: dict[str, Any]) -> dict[str, Any]:
        phases = handle.get("finalize")
        if not phases:
            return handle
        hook = self._hook(handle["aws_conn_id"], handle.get("region_name", ""))
        started = hook.describe_job(self.kind, phases["job_name"]) is not None
        return {**handle, "job_name": phases["job_name"]} if started else handle

    def read_logs(self, handle: dict[str, Any], cursor: Any = None) -> tuple[list[str], Any]:
        current = self._current(handle)
        if isinstance(cursor, dict) and cursor.get("_job", current["job_name"]) != current["job_name"]:
            cursor = None   # the finalize job began: its log from the start
        lines, cursor = super().read_logs(current, cursor)
        return lines, ({**cursor, "_job": current["job_name"]} if isinstance(cursor, dict) else cursor)

    def stop(self, handle: dict[str, Any]) -> None:
        super().stop(handle)
        if handle.get("finalize"):
            super().stop({**handle, "job_name": handle["finalize"]["job_name"]})


def finalize_name(job_name: str) -> str:
    """The finalize job's name for a shards job: readable head, then a hash of the whole name
    (two attempts' names differ only at the end, which the head may cut)."""
    digest = hashlib.sha256(job_name.encode()).hexdigest()[:10]
    return f"{job_name[:63 - 13 - 4].rstrip('-')}-fin-{digest}"
