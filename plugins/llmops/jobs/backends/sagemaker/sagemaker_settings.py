"""The `sagemaker` and `sagemaker_processing` blocks of the backends' settings
(llmops.jobs.backends.backend_settings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmops.jobs.backends.remote_settings import BackendSettingsError, RemoteSettings


INPUT_MODES = ("auto", "File", "FastFile")


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
    # How S3 channels reach the container: File (copied before start), FastFile (streamed from S3
    # as read), or auto: FastFile for the inputs the stage streams
    # (tasks.common.uris.STREAMED_INPUTS: pretraining's token shards, so a new attempt does not copy
    # the corpus before its first step), File for the rest (configs, models, SFT files: read whole
    # at start anyway).
    input_mode: str = "auto"
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
        if self.input_mode not in INPUT_MODES:
            raise BackendSettingsError(f"SageMakerSettings.input_mode must be one of {INPUT_MODES}, "
                                       f"got {self.input_mode!r}.")
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
