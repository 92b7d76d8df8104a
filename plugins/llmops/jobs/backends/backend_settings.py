"""Deployment settings of the remote backends: one typed block per backend, read at submit time.

Each block's class lives with its backend (`<backend>/<backend>_settings.py`), on the shared base
in `remote_settings.py`, and the backend's entry (llmops.jobs.backends.BACKENDS) names it; this
module finds it (`settings_class`) and reads the Variable (`load`).

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
cache, job ledger, log cursors) and of a block without `kms_key_id` (llmops.infra.aws.s3).
"""

from __future__ import annotations

from typing import Any

from llmops.core import settings as deployment
from llmops.jobs import backends
from llmops.jobs.backends.remote_settings import VARIABLE, BackendSettingsError, RemoteSettings, S
from tasks.configs import ConfigError, from_dict


def settings_class(backend: str) -> type[RemoteSettings]:
    """The settings block class of a remote backend (its key in the Variable), as its entry in
    llmops.jobs.backends.BACKENDS names it."""
    dotted = backends.entry(backend).settings
    if not dotted:
        raise ValueError(f"Backend {backend!r} runs here and has no settings block.")
    return backends.load(dotted)


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
