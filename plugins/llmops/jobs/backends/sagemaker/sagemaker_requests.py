"""The SageMaker requests of one attempt, as pure functions: CreateTrainingJob
(`training_request`: channels, distribution hyperparameters, stopping condition, tags) and
CreateProcessingJob (`processing_request`). How a JobSpec maps onto them: the docstring of
llmops.jobs.backends.sagemaker.sagemaker_backend."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from llmops.infra.aws import s3
from llmops.jobs.backends import remote
from llmops.jobs.backends.fabric import fabric_env, is_gpu
from llmops.jobs.backends.sagemaker.sagemaker_settings import ProcessingSettings, SageMakerSettings
from llmops.jobs.spec import JobSpec, JobSpecError
from tasks.common.uris import STREAMED_INPUTS

CHECKPOINT_DIR = "/opt/ml/checkpoints"
WORKDIR = "/opt/ml/llmops"            # on the job's volume, not the small root disk
CODE_DIR = "/opt/ml/code"             # docker/Dockerfile.train copies job_entry.py here
CONFIG_CHANNEL = "llmops_config"
PROCESSING_INPUT = "/opt/ml/processing/input"
PROCESSING_OUTPUT = "/opt/ml/processing/output"
PROCESSING_MAX_RUNTIME = 777_600      # the service's limit for processing jobs (9 days)
SHARDS_CHANNEL = "llmops_shards"      # the finalize job's copy of every host's shards
# botocore's model gives MaxWaitTimeInSeconds no upper bound; 28 days is SageMaker's documented
# maximum run time of a training job (MaxRuntimeInSeconds, whose default quota is 5 days).
SPOT_MAX_WAIT = 2_419_200
# StoppingCondition.MaxPendingTimeInSeconds: botocore's model says min 1800, max 2419200.
MAX_PENDING_RANGE = (1800, 2_419_200)
DISTRIBUTIONS = ("auto", "none", "torch_distributed", "pytorchddp", "smdistributed_dataparallel",
                 "smdistributed_modelparallel", "mpi")
SMDDP_TYPES = {"ml.p3.16xlarge", "ml.p3dn.24xlarge", "ml.p4d.24xlarge", "ml.p4de.24xlarge",
               "ml.p5.48xlarge", "ml.p5e.48xlarge", "ml.p5en.48xlarge"}
# The training loop's progress line, for SageMaker's metric charts.
METRICS = [{"Name": "train:loss", "Regex": r"step \d+/\d+ \| loss ([0-9.eE+-]+)"},
           {"Name": "train:tokens_per_s", "Regex": r"\| ([0-9.]+) tok/s"}]

_TAG_CHARS = re.compile(r"[^\w\s.:/=+\-@]", re.UNICODE)


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


def input_mode(settings: SageMakerSettings, spec: JobSpec, ref: remote.InputRef) -> str:
    """The channel's InputMode: the settings', or for `auto` FastFile where the stage streams
    the input (its token shards: read block by block, never whole before the first step) and
    File elsewhere."""
    if settings.input_mode != "auto":
        return settings.input_mode
    return "FastFile" if ref.field in STREAMED_INPUTS.get(spec.entrypoint, ()) else "File"


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
            *(_channel(ref, input_mode(settings, spec, ref), vpc) for ref in channels)],
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
