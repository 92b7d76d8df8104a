"""The SageMaker Training and Processing backends: what they render (checked against botocore's
service model, including the lengths, patterns and enums botocore itself skips) and how they
behave against a moto server: submit, poll, fail, stop, reattach, and the result coming back
through S3 from the container's entry."""

from __future__ import annotations

import json

import pytest
from botocore.validate import ParamValidator

from llmops.infra.aws.validation import AwsRequestError, service_model, validate_request
from llmops.jobs.backends import JobState, get_backend, remote
from llmops.jobs.backends.fabric import fabric_env
from llmops.jobs.backends.sagemaker.sagemaker_backend import (SageMakerProcessingBackend,
                                                              SageMakerTrainingBackend)
from llmops.jobs.backends.sagemaker.sagemaker_requests import (distribution_hyperparameters,
                                                               processing_request, training_request)
from llmops.jobs.backends.sagemaker.sagemaker_settings import ProcessingSettings, SageMakerSettings
from llmops.jobs.spec import JobSpec, JobSpecError, job_name
from tests.aws_fixtures import IMAGE, ROLE, run_training_container, sagemaker_settings

STAGING = "s3://llmops-test/staging"


def pretrain_spec(**changes) -> JobSpec:
    spec = JobSpec(stage="pretrain", entrypoint="tasks.pretrain",
                   name=job_name("dag", "run", "pretrain", prefix="pretrain"),
                   config={"data_dir": "s3://data-bucket/runs/r1/data_prep",
                           "output_dir": "s3://data-bucket/runs/r1/pretrain", "max_steps": 10},
                   instance_type="ml.p4d.24xlarge", instance_count=2, nproc_per_node=8,
                   max_run_seconds=5 * 24 * 3600, env={"MLFLOW_RUN_ID": "0123abcd"},
                   tags={"data_hash": "f" * 64, "team": "research"})
    return spec.replace(**changes)


def render(spec: JobSpec, **settings) -> tuple[dict, dict]:
    cfg = SageMakerSettings(role_arn=ROLE, staging_uri=STAGING, image=IMAGE, **settings)
    staged = remote.plan(spec, spec.name, STAGING)
    return training_request(spec, cfg, staged, spec.name, "us-east-1")


def decode(hyperparameters: dict[str, str]) -> dict:
    """What SageMaker's training toolkit hands the program: each value JSON-decoded."""
    return {k: json.loads(v) for k, v in hyperparameters.items()}


# -- rendering ------------------------------------------------------------------------------

def test_pretraining_streams_its_token_shards_fastfile_and_the_rest_is_copied():
    """input_mode auto (the default): pretraining's data_dir channel is FastFile (streamed from S3
    as read: a new attempt does not copy the corpus before its first step), any other input is
    File; the request is valid for botocore's model. An explicit mode applies to every channel,
    and a mode SageMaker does not have is refused before any request."""
    from llmops.jobs.backends.backend_settings import BackendSettingsError

    spec = pretrain_spec(config={**pretrain_spec().config, "fork_from": "s3://data-bucket/runs/r0/ckpt"})
    request, _ = render(spec)
    validate_request("sagemaker", "CreateTrainingJob", request)
    modes = {c["ChannelName"]: c["InputMode"] for c in request["InputDataConfig"]}
    assert modes["data_dir"] == "FastFile"
    assert modes["fork_from"] == "File" and modes["llmops_config"] == "File"
    finetune = JobSpec(stage="finetune", entrypoint="tasks.finetune", name="ft-1",
                       config={"data_dir": "s3://data-bucket/runs/r1/data_prep",
                               "base_model": "s3://data-bucket/runs/r1/pretrain/model",
                               "output_dir": "s3://data-bucket/runs/r1/finetune"},
                       instance_type="ml.g5.2xlarge")
    request, _ = render(finetune)
    validate_request("sagemaker", "CreateTrainingJob", request)
    assert {c["InputMode"] for c in request["InputDataConfig"]} == {"File"}  # SFT files: read whole
    request, _ = render(spec, input_mode="File")
    assert {c["InputMode"] for c in request["InputDataConfig"][1:]} == {"File"}
    with pytest.raises(BackendSettingsError, match="input_mode must be one of"):
        SageMakerSettings(role_arn=ROLE, staging_uri=STAGING, image=IMAGE, input_mode="Pipe")


def test_multi_node_training_request_is_valid_and_complete():
    request, mapping = render(pretrain_spec(), spot=True, retry_attempts=2, subnets=["subnet-0abc1234"],
                              security_group_ids=["sg-0abc1234"], input_mode="FastFile")
    validate_request("sagemaker", "CreateTrainingJob", request)
    assert request["ResourceConfig"]["InstanceType"] == "ml.p4d.24xlarge"
    assert request["ResourceConfig"]["InstanceCount"] == 2
    # Five days of pretraining: the limit follows the job; spot may take twice that in all
    # (waiting for capacity, restarts after interruptions and RetryStrategy attempts included).
    assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": 432000, "MaxWaitTimeInSeconds": 864000}
    assert request["EnableManagedSpotTraining"] is True
    assert request["RetryStrategy"] == {"MaximumRetryAttempts": 2}
    assert request["VpcConfig"] == {"Subnets": ["subnet-0abc1234"], "SecurityGroupIds": ["sg-0abc1234"]}
    assert request["CheckpointConfig"] == {"S3Uri": "s3://data-bucket/runs/r1/pretrain/checkpoints",
                                           "LocalPath": "/opt/ml/checkpoints"}
    assert request["InfraCheckConfig"] == {"EnableInfraCheck": True}
    env = request["Environment"]
    assert {k: env[k] for k in ("FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "NCCL_PROTO", "NCCL_DEBUG")} == \
        {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_PROTO": "simple", "NCCL_DEBUG": "WARN"}
    assert env["MLFLOW_RUN_ID"] == "0123abcd"
    hp = decode(request["HyperParameters"])
    assert hp["sagemaker_torch_distributed_enabled"] is True        # torchrun on every instance
    assert hp["sagemaker_program"] == "job_entry.py" and hp["entrypoint"] == "tasks.pretrain"
    assert hp["config"] == "${SM_CHANNEL_LLMOPS_CONFIG}/config.json"  # the config is a channel
    channels = {c["ChannelName"]: c for c in request["InputDataConfig"]}
    assert channels["data_dir"]["InputMode"] == "FastFile"
    assert channels["data_dir"]["DataSource"]["S3DataSource"]["S3Uri"] == "s3://data-bucket/runs/r1/data_prep/"
    assert mapping == {"s3://data-bucket/runs/r1/data_prep": "${SM_CHANNEL_DATA_DIR}"}
    assert {"Key": "team", "Value": "research"} in request["Tags"]
    assert {"Key": "llmops:stage", "Value": "pretrain"} in request["Tags"]


@pytest.mark.parametrize("distribution, expected", [
    ("torch_distributed", {"sagemaker_torch_distributed_enabled": True}),
    ("pytorchddp", {"sagemaker_pytorch_ddp_enabled": True}),
    ("smdistributed_dataparallel", {"sagemaker_distributed_dataparallel_enabled": True}),
    ("mpi", {"sagemaker_mpi_enabled": True, "sagemaker_mpi_num_of_processes_per_host": 8}),
    ("smdistributed_modelparallel", {"sagemaker_mpi_enabled": True,
                                     "mp_parameters": {"partitions": 2, "microbatches": 4}}),
])
def test_each_distribution_renders_the_toolkit_launch(distribution, expected):
    request, _ = render(pretrain_spec(), distribution=distribution,
                        mp_parameters={"partitions": 2, "microbatches": 4})
    validate_request("sagemaker", "CreateTrainingJob", request)
    hp = decode(request["HyperParameters"])
    assert {k: hp[k] for k in expected} == expected


def test_single_instance_single_process_needs_no_launcher_and_no_fabric():
    request, _ = render(pretrain_spec(instance_type="ml.g5.2xlarge", instance_count=1, nproc_per_node=1))
    hp = decode(request["HyperParameters"])
    assert not any(k.startswith(("sagemaker_torch", "sagemaker_mpi", "sagemaker_pytorch")) for k in hp)
    assert "FI_PROVIDER" not in request["Environment"] and "InfraCheckConfig" not in request
    assert fabric_env("ml.g5.2xlarge", 4) == {"NCCL_DEBUG": "WARN"}  # GPUs without EFA: NCCL only


def test_fsx_and_local_inputs_become_channels():
    spec = pretrain_spec(config={"data_dir": "fsx://fs-0123456789abcdef0/lustre/tokens",
                                 "output_dir": "s3://b/out"})
    with pytest.raises(JobSpecError, match="FSx for Lustre, which needs subnets"):
        render(spec)
    request, mapping = render(spec, subnets=["subnet-0abc1234"], security_group_ids=["sg-0abc1234"])
    validate_request("sagemaker", "CreateTrainingJob", request)
    fsx = next(c for c in request["InputDataConfig"] if c["ChannelName"] == "data_dir")
    assert fsx["DataSource"] == {"FileSystemDataSource": {
        "FileSystemId": "fs-0123456789abcdef0", "FileSystemType": "FSxLustre",
        "FileSystemAccessMode": "ro", "DirectoryPath": "/lustre/tokens"}}


def test_local_storage_is_staged_under_the_staging_prefix(tmp_path):
    data = tmp_path / "data_prep"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    spec = pretrain_spec(config={"data_dir": str(data), "output_dir": str(tmp_path / "pretrain")})
    staged = remote.plan(spec, spec.name, STAGING)
    root = f"{STAGING}/{spec.name}"
    assert staged.config["data_dir"] == f"{root}/inputs/data_dir"
    assert staged.uploads == {str(data): f"{root}/inputs/data_dir"}
    assert staged.config["output_dir"] == staged.output_uri == f"{root}/output"
    assert staged.copy_back == {f"{root}/output": str(tmp_path / "pretrain")}
    # Every attempt resumes from the same checkpoints.
    assert remote.plan(spec, remote.attempt_name(spec.name, 2), STAGING).checkpoint_uri == \
        staged.checkpoint_uri == f"{root}/checkpoints"


@pytest.mark.parametrize("change, field", [
    ({"env": {"HF_TOKEN": "hf_abc"}}, "looks like a secret"),
    ({"env": {"MLFLOW_TRACKING_URI": "https://user:pw@mlflow.example.com"}}, "password"),
])
def test_secrets_never_reach_a_request(change, field):
    with pytest.raises(JobSpecError, match=field):
        render(pretrain_spec(**change))
    # Names that merely contain such a word pass.
    render(pretrain_spec(env={"TOKENIZERS_PARALLELISM": "false"}))


def test_warm_pool_and_spot_cannot_be_combined():
    with pytest.raises(JobSpecError, match="Warm pools"):
        render(pretrain_spec(), spot=True, keep_alive_seconds=600)
    request, _ = render(pretrain_spec(), keep_alive_seconds=1800)
    assert request["ResourceConfig"]["KeepAlivePeriodInSeconds"] == 1800


# -- the validator: what botocore misses -----------------------------------------------------

@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.update(TrainingJobName="x" * 64), "TrainingJobName: 64 characters, more than the maximum 63"),
    (lambda r: r.update(TrainingJobName="bad_name"), "TrainingJobName: 'bad_name' does not match"),
    (lambda r: r["ResourceConfig"].update(InstanceType="ml.p5.48xlarg"), "is not an allowed value"),
    (lambda r: r["ResourceConfig"].update(KeepAlivePeriodInSeconds=99999), "above the maximum 21600"),
    (lambda r: r["Environment"].update({"BAD-NAME": "x"}), "Environment key 'BAD-NAME'"),
    (lambda r: r["Tags"].append({"Key": "team", "Value": "a,b"}), "Tags[2].Value: 'a,b' does not match"),
    (lambda r: r["InputDataConfig"][0].update(InputMode="Stream"), "InputMode: 'Stream' is not an allowed"),
])
def test_the_validator_catches_what_botocore_lets_through(mutate, message):
    request, _ = render(pretrain_spec(instance_type="ml.g5.2xlarge", instance_count=1, nproc_per_node=1,
                                      tags={}))
    request["Tags"] = request["Tags"][:2]
    mutate(request)
    shape = service_model("sagemaker").operation_model("CreateTrainingJob").input_shape
    assert not ParamValidator().validate(request, shape).has_errors(), "botocore itself accepts it"
    with pytest.raises(AwsRequestError) as err:
        validate_request("sagemaker", "CreateTrainingJob", request)
    assert message in str(err.value)


def test_the_validator_also_catches_unknown_and_missing_fields():
    request, _ = render(pretrain_spec())
    request["StoppingCondition"]["MaxRunTimeInSeconds"] = 5
    del request["RoleArn"]
    with pytest.raises(AwsRequestError) as err:
        validate_request("sagemaker", "CreateTrainingJob", request)
    assert "StoppingCondition.MaxRunTimeInSeconds: unknown field" in str(err.value)
    assert "RoleArn: required field is missing" in str(err.value)


def test_processing_request_shards_raw_inputs_across_instances():
    spec = JobSpec(stage="data_prep", entrypoint="tasks.data.prep", name="data-prep-0123456789ab",
                   config={"inputs": ["s3://raw/crawl/part-*.jsonl"], "output_dir": "s3://b/data",
                           "sft_inputs": ["s3://raw/sft/train.jsonl", "s3://raw/sft/eval.jsonl"]},
                   instance_type="ml.m5.4xlarge", instance_count=4, max_run_seconds=6 * 3600)
    cfg = ProcessingSettings(role_arn=ROLE, staging_uri=STAGING, image=IMAGE)
    staged = remote.plan(spec, spec.name, STAGING)
    request, mapping = processing_request(spec, cfg, staged, spec.name)
    validate_request("sagemaker", "CreateProcessingJob", request)
    inputs = {i["InputName"]: i["S3Input"] for i in request["ProcessingInputs"]}
    assert inputs["inputs_0"]["S3DataDistributionType"] == "ShardedByS3Key"
    assert inputs["inputs_0"]["S3Uri"] == "s3://raw/crawl/"
    assert inputs["sft_inputs_0"]["S3DataDistributionType"] == "FullyReplicated"  # needed whole
    assert request["ProcessingResources"]["ClusterConfig"]["InstanceCount"] == 4
    assert mapping["s3://raw/crawl"] == "/opt/ml/processing/input/inputs_0"
    assert request["AppSpecification"]["ContainerEntrypoint"] == ["python3", "/opt/llmops/job_entry.py"]
    assert request["ProcessingOutputConfig"]["Outputs"][0]["S3Output"]["S3Uri"] == "s3://b/data"


def test_distribution_refuses_impossible_combinations():
    cfg = SageMakerSettings()
    with pytest.raises(JobSpecError, match="runs on"):
        distribution_hyperparameters("smdistributed_dataparallel", "ml.g5.2xlarge", 2, 1, cfg)
    with pytest.raises(JobSpecError, match="needs a distribution"):
        distribution_hyperparameters("none", "ml.g5.12xlarge", 1, 4, cfg)
    with pytest.raises(JobSpecError, match="mp_parameters"):
        distribution_hyperparameters("smdistributed_modelparallel", "ml.p4d.24xlarge", 2, 8, cfg)


# -- against moto ----------------------------------------------------------------------------

@pytest.fixture()
def aws(moto_server):
    moto_server.bucket("llmops-test")
    return moto_server


def sample(name: str, **config) -> JobSpec:
    return JobSpec(stage="sample", entrypoint="tests.sample_job", name=name, config=config,
                   instance_type="ml.m5.xlarge", max_run_seconds=3600,
                   env={"MLFLOW_EXPERIMENT_NAME": "sample"})


def test_training_job_submit_result_and_reattach(aws, tmp_path):
    backend = SageMakerTrainingBackend(settings={"sagemaker": sagemaker_settings("llmops-test")})
    spec = sample(job_name("sm-ok", prefix="sm-ok"), seconds=0.1, marker_dir=str(tmp_path / "m"))
    handle = backend.submit(spec)
    assert handle["reattached"] is False and aws.training_jobs("sm-ok") == [spec.name]
    described = aws.client("sagemaker").describe_training_job(TrainingJobName=spec.name)
    assert described["RoleArn"] == ROLE and described["ResourceConfig"]["InstanceType"] == "ml.m5.xlarge"
    # moto marks the job Completed at once and runs nothing: no container has written a result yet.
    status = backend.status(handle)
    assert status.state is JobState.FAILED and "wrote no result" in status.message
    proc = run_training_container(aws, spec.name, tmp_path)   # what SageMaker would run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    status = backend.status(handle)
    assert status.state is JobState.SUCCEEDED and status.result["metrics"] == {"answer": 42.0}
    again = backend.submit(spec)                                # a retried task
    assert again["reattached"] is True and again["job_name"] == spec.name
    assert aws.training_jobs("sm-ok") == [spec.name], "no second job"
    backend.stop(again)                                         # finished: nothing to stop
    assert backend.status(again).state is JobState.SUCCEEDED


def test_a_failing_container_leaves_its_reason_and_no_result(aws, tmp_path):
    backend = SageMakerTrainingBackend(settings={"sagemaker": sagemaker_settings("llmops-test")})
    spec = sample(job_name("sm-fail", prefix="sm-fail"), exit_code=7)
    handle = backend.submit(spec)
    proc = run_training_container(aws, spec.name, tmp_path)
    assert proc.returncode == 7 and "sample job failing on purpose" in proc.stdout
    status = backend.status(handle)
    assert status.state is JobState.FAILED and "wrote no result" in status.message


def test_an_invalid_request_is_refused_before_anything_is_created(aws):
    backend = SageMakerTrainingBackend(settings={"sagemaker": sagemaker_settings(
        "llmops-test", instance_type="ml.p5.48xlarg")})
    spec = sample(job_name("sm-bad", prefix="sm-bad")).replace(instance_type="local")
    with pytest.raises(AwsRequestError, match="InstanceType: 'ml.p5.48xlarg' is not an allowed value"):
        backend.submit(spec)
    assert aws.training_jobs("sm-bad") == []


def test_missing_settings_name_the_variable_and_the_key(aws):
    backend = SageMakerTrainingBackend(settings={"sagemaker": {"aws_conn_id": "llmops_aws"}})
    with pytest.raises(ValueError, match="llmops_backends.*role_arn.*staging_uri"):
        backend.submit(sample("sm-unset-0123456789ab"))


def test_processing_job_stop_and_a_new_attempt_after_it(aws):
    settings = {"sagemaker_processing": sagemaker_settings("llmops-test", instance_type="ml.m5.xlarge")}
    backend = SageMakerProcessingBackend(settings=settings)
    spec = sample(job_name("proc", prefix="proc"), seconds=0.1)
    handle = backend.submit(spec)
    key = handle["staging_prefix"].split("/", 3)[3] + "/request.json"
    request = json.loads(aws.client("s3").get_object(Bucket="llmops-test", Key=key)["Body"].read())
    validate_request("sagemaker", "CreateProcessingJob", request)
    # Someone stops the job (moto allows it on any job; SageMaker only while it runs).
    aws.client("sagemaker").stop_processing_job(ProcessingJobName=handle["job_name"])
    status = backend.status(handle)
    assert status.state is JobState.STOPPED and "was stopped" in status.message
    retry = backend.submit(spec)            # the retried task starts attempt 2, same checkpoints
    assert retry["reattached"] is False and retry["job_name"] == f"{spec.name}-r2"
    assert retry["checkpoint_uri"] == handle["checkpoint_uri"]


def test_backends_are_registered_for_the_stage_params():
    from llmops.policy.params import lifecycle_params

    choices = set(lifecycle_params()["backend_pretrain"].schema["enum"])
    assert {"local", "sagemaker", "sagemaker_processing", "hyperpod", "batch", "ray"} <= choices
    assert isinstance(get_backend("sagemaker"), SageMakerTrainingBackend)


def test_backends_poll_every_30_seconds_by_default():
    """AWS's describe calls are rate-limited per account: SageMaker and Batch are polled every
    30 s (the settings' poll_interval_seconds, carried in the handle), not every 2 s."""
    from llmops.jobs.backends.batch.batch_backend import BatchBackend

    assert SageMakerTrainingBackend.poll_interval == SageMakerProcessingBackend.poll_interval == 30.0
    assert BatchBackend.poll_interval == 30.0
    assert remote.watch_fields(SageMakerSettings()) == {"poll_interval": 30.0,
                                                        "deadline_grace_seconds": 1800,
                                                        "max_queue_seconds": 0}


def test_max_queue_seconds_becomes_max_pending_time_within_sagemakers_range():
    """Issue 21.3: SageMaker stops a job pending past MaxPendingTimeInSeconds (1800 s - 28 days,
    botocore's model); outside that range only Airflow's own check bounds the wait."""
    from llmops.jobs.backends.remote_settings import BackendSettingsError
    from llmops.jobs.backends.sagemaker.sagemaker_requests import (MAX_PENDING_RANGE,
                                                                   stopping_condition)

    model = __import__("botocore.session").session.get_session().get_service_model("sagemaker")
    bounds = model.shape_for("StoppingCondition").members["MaxPendingTimeInSeconds"].metadata
    assert MAX_PENDING_RANGE == (bounds["min"], bounds["max"])
    spec = JobSpec(stage="pretrain", entrypoint="tasks.pretrain", name="j", max_run_seconds=3600)
    assert stopping_condition(spec, SageMakerSettings(max_queue_seconds=7200)) == {
        "MaxRuntimeInSeconds": 3600, "MaxPendingTimeInSeconds": 7200}
    assert stopping_condition(spec, SageMakerSettings(max_queue_seconds=600)) == {"MaxRuntimeInSeconds": 3600}
    assert stopping_condition(spec, SageMakerSettings(spot=True, max_queue_seconds=7200)) == {
        "MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 7200, "MaxPendingTimeInSeconds": 7200}
    with pytest.raises(BackendSettingsError, match="max_queue_seconds must be a whole number"):
        SageMakerSettings(max_queue_seconds=-1)


# -- cost allocation ------------------------------------------------------------------------

RUN_ID = "scheduled__2026-11-30T01:00:00+00:00"


@pytest.mark.parametrize("kind", ["training", "processing"])
def test_every_job_carries_the_cost_allocation_tags(kind):
    """dag_id, run_id, team, stage as Tags (the operator puts dag_id and run_id in spec.tags),
    within the service model's patterns and lengths."""
    spec = pretrain_spec(tags={"team": "research", "dag_id": "llm_lifecycle", "run_id": RUN_ID})
    if kind == "training":
        request, _ = render(spec)
        validate_request("sagemaker", "CreateTrainingJob", request)
    else:
        spec = spec.replace(instance_type="ml.m5.4xlarge")
        cfg = ProcessingSettings(role_arn=ROLE, staging_uri=STAGING, image=IMAGE)
        request, _ = processing_request(spec, cfg, remote.plan(spec, spec.name, STAGING), spec.name)
        validate_request("sagemaker", "CreateProcessingJob", request)
    tags = {t["Key"]: t["Value"] for t in request["Tags"]}
    assert {k: tags[k] for k in ("dag_id", "run_id", "team", "stage")} == {
        "dag_id": "llm_lifecycle", "run_id": RUN_ID, "team": "research", "stage": "pretrain"}
    untagged = pretrain_spec(tags={})   # no team: the default team, still tagged
    assert {"Key": "team", "Value": "default"} in render(untagged)[0]["Tags"]


# -- what SageMaker would take and do wrong, or refuse ----------------------------------------

def test_torch_distributed_starts_the_runs_processes_per_node_not_one_per_gpu():
    """The toolkit's torchrun starts one process per GPU unless told otherwise: 4 processes on an
    8-GPU instance (tensor parallel 4, or a memory-bound model) silently became 8."""
    for nproc in (4, 1):
        request, _ = render(pretrain_spec(nproc_per_node=nproc), distribution="torch_distributed")
        validate_request("sagemaker", "CreateTrainingJob", request)
        hp = decode(request["HyperParameters"])
        assert hp["sagemaker_torch_distributed_enabled"] is True
        assert hp["sagemaker_mpi_num_of_processes_per_host"] == nproc
    request, _ = render(pretrain_spec(nproc_per_node=4), distribution="torch_distributed",
                        mpi_processes_per_host=2)   # the settings' explicit count wins
    assert decode(request["HyperParameters"])["sagemaker_mpi_num_of_processes_per_host"] == 2


class _Refusing:
    def __init__(self, message: str):
        self.message = message

    def describe_training_job(self, **kwargs):
        from botocore.exceptions import ClientError

        raise ClientError({"Error": {"Code": "ValidationException", "Message": self.message}},
                          "DescribeTrainingJob")


@pytest.mark.parametrize("message, absent", [
    ("Requested resource not found.", True),
    ("Could not find training job 'arn:aws:sagemaker:us-east-1:123456789012:training-job/x'.", True),
    ("1 validation error detected: Value 'x_y' at 'trainingJobName' failed to satisfy constraint: "
     "Member must satisfy regular expression pattern", False),
    ("User: arn:aws:sts::123456789012:assumed-role/x is not authorized in this region", False),
])
def test_only_not_found_means_the_job_is_absent(monkeypatch, message, absent):
    """Any other ValidationException read as 'absent' made a retried task create attempt 1
    again, or skip to a new attempt beside a running one."""
    from botocore.exceptions import ClientError

    from llmops.jobs.backends.sagemaker.sagemaker_hook import SageMakerJobsHook

    hook = SageMakerJobsHook(aws_conn_id="llmops_aws")
    monkeypatch.setattr(hook, "get_conn", lambda: _Refusing(message))
    if absent:
        assert hook.describe_job("training", "x") is None
    else:
        with pytest.raises(ClientError, match="ValidationException"):
            hook.describe_job("training", "x")


KMS = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"


def test_a_kms_key_encrypts_the_jobs_outputs_and_every_staged_object(aws, tmp_path):
    """A bucket policy requiring SSE-KMS refuses every PutObject without it: each object the
    backend writes carries the key, and SageMaker and the job are told to use it."""
    request, _ = render(pretrain_spec(), kms_key_id=KMS)
    assert request["OutputDataConfig"]["KmsKeyId"] == KMS
    assert request["Environment"]["LLMOPS_S3_KMS_KEY_ID"] == KMS
    request, _ = render(pretrain_spec(), kms_key_id=KMS, output_kms_key_id="alias/outputs")
    assert request["OutputDataConfig"]["KmsKeyId"] == "alias/outputs"   # the explicit one wins
    processing, _ = processing_request(
        pretrain_spec(instance_type="ml.m5.4xlarge"),
        ProcessingSettings(role_arn=ROLE, staging_uri=STAGING, image=IMAGE, kms_key_id=KMS),
        remote.plan(pretrain_spec(), "p", STAGING), "p")
    validate_request("sagemaker", "CreateProcessingJob", processing)
    assert processing["ProcessingOutputConfig"]["KmsKeyId"] == KMS
    local_input = tmp_path / "inputs"
    local_input.mkdir()
    (local_input / "data.jsonl").write_text("{}\n")
    backend = SageMakerTrainingBackend(settings={"sagemaker": sagemaker_settings("llmops-test",
                                                                               kms_key_id=KMS)})
    handle = backend.submit(sample(job_name("sm-kms", prefix="sm-kms"), data_dir=str(local_input)))
    s3 = aws.client("s3")
    root = handle["staging_prefix"].split("/", 3)[3].rsplit("/", 1)[0]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="llmops-test", Prefix=root)["Contents"]]
    assert any(k.endswith("data.jsonl") for k in keys) and any(k.endswith("request.json") for k in keys)
    for key in keys:
        head = s3.head_object(Bucket="llmops-test", Key=key)
        assert (head.get("ServerSideEncryption"), head.get("SSEKMSKeyId")) == ("aws:kms", KMS), key


def test_a_created_jobs_token_tells_a_lost_response_from_another_try(aws, monkeypatch):
    """SageMaker refuses a second job of a name (ResourceInUse): after a lost response the
    resent create is refused, and the job is this try's own (its token tag), not a reattach."""
    backend = SageMakerTrainingBackend(settings={"sagemaker": sagemaker_settings("llmops-test")})
    spec = sample(job_name("sm-lost", prefix="sm-lost"))
    from llmops.jobs.backends.sagemaker.sagemaker_hook import SageMakerJobsHook

    real = SageMakerJobsHook.create_training_job

    def lost_then_resent(self, config, **kwargs):
        real(self, config, **kwargs)   # AWS creates the job; its answer never arrives ...
        from botocore.exceptions import ClientError

        raise ClientError({"Error": {"Code": "ResourceInUse", "Message": "Training job names must be "
                                     "unique: a training job with this name already exists"}},
                          "CreateTrainingJob")   # ... and botocore's resend is refused

    monkeypatch.setattr(SageMakerJobsHook, "create_training_job", lost_then_resent)
    handle = backend.submit(spec)
    assert handle["reattached"] is False and aws.training_jobs("sm-lost") == [spec.name]

    # Another try's create came first (this try's describe missed it): a reattach.
    from botocore.exceptions import ClientError

    def refused(self, config, **kwargs):
        raise ClientError({"Error": {"Code": "ResourceInUse", "Message": "already exists"}},
                          "CreateTrainingJob")

    real_describe, describes = SageMakerJobsHook.describe_job, []

    def racing(self, kind, name):
        describes.append(name)
        return None if len(describes) == 1 else real_describe(self, kind, name)

    monkeypatch.setattr(SageMakerJobsHook, "create_training_job", refused)
    monkeypatch.setattr(SageMakerJobsHook, "describe_job", racing)
    again = backend.submit(spec)
    assert again["reattached"] is True and again["job_name"] == spec.name
    assert aws.training_jobs("sm-lost") == [spec.name]


def test_a_job_held_for_capacity_says_so_in_its_pending_status(monkeypatch):
    """Issue 21.3: the newest transition's StatusMessage is the service's reason for waiting."""
    import datetime as dt

    created = dt.datetime(2026, 5, 1, tzinfo=dt.timezone.utc)
    message = "Insufficient capacity error from EC2 while launching instances, retrying!"

    class Hook:
        def describe_job(self, kind, name):
            return {"TrainingJobStatus": "InProgress", "SecondaryStatus": "Starting",
                    "CreationTime": created,
                    "SecondaryStatusTransitions": [{"Status": "Starting", "StartTime": created,
                                                    "StatusMessage": message}]}

        def status_of(self, kind, description):
            return description["TrainingJobStatus"]

    backend = SageMakerTrainingBackend()
    monkeypatch.setattr(backend, "_hook", lambda *a, **k: Hook())
    status = backend.status({"aws_conn_id": "aws_default", "job_name": "j"})
    assert status.state is JobState.PENDING
    assert status.message == f"InProgress (Starting): {message}"
    assert status.details["submitted_at"] == created.timestamp()
