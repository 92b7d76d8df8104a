"""What every remote backend's settings block shares: RemoteSettings (connection, staging,
resources, how a job is watched, encryption), BackendSettingsError, the examples a missing key's
message shows. The Variable they are read from and what each field means:
llmops.jobs.backends.backend_settings.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

from llmops.core import settings as deployment
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
