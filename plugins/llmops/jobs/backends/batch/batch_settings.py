"""The `batch` block of the backends' settings (llmops.jobs.backends.backend_settings)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmops.jobs.backends.remote_settings import BackendSettingsError, RemoteSettings


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
