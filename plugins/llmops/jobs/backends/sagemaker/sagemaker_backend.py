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

import hashlib
import logging
import time
import uuid
from typing import Any

from llmops.infra.aws import s3
from llmops.infra.aws.validation import validate_request
from llmops.jobs.backends import remote, shared
from llmops.jobs.backends.base import Backend, JobState, JobStatus
from llmops.jobs.backends.sagemaker.sagemaker_requests import (processing_request,
                                                               service_bounds_queue,
                                                               stopping_condition, training_request)
from llmops.jobs.backends.backend_settings import load
from llmops.jobs.backends.sagemaker.sagemaker_settings import ProcessingSettings, SageMakerSettings
from llmops.jobs.spec import JobSpec, JobSpecError

log = logging.getLogger(__name__)

# Stages that follow the shards-then-finalize contract (tasks/data/prep.py): on several
# Processing instances they run as two jobs in one handle (SageMakerProcessingBackend).
TWO_PHASE_ENTRYPOINTS = ("tasks.data.prep",)
STOPPING_WAIT_SECONDS = 600
TOKEN_TAG = "llmops:submit-token"     # which try created a job (see the module docstring)
# InProgress with these secondary statuses has not started the program yet (or, after a spot
# interruption, is waiting to start it again).
NOT_RUNNING = {"Starting", "Pending", "LaunchingMLInstances", "PreparingTrainingStack", "Downloading",
               "DownloadingTrainingImage", "Interrupted", "Restarting"}


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
        from llmops.jobs.backends.sagemaker.sagemaker_hook import jobs_hook

        # one per process (llmops.infra.aws.clients)
        return jobs_hook(aws_conn_id, region_name, kms_key_id)

    def _description(self, handle: dict[str, Any], hook: Any, name: str) -> dict[str, Any] | None:
        """The job's description: a trigger's through the process's shared list of changed jobs."""
        if not self.shared_max_age:
            return hook.describe_job(self.kind, name)
        conn, region, kind = handle["aws_conn_id"], handle.get("region_name", ""), self.kind

        def changes() -> shared.ChangedSince:
            def current() -> Any:   # the process's hook for the connection as it is now
                return self._hook(conn, region)

            return shared.ChangedSince(lambda since: current().changed_since(kind, since),
                                       lambda job: current().describe_job(kind, job),
                                       lambda summary, seen: current().still_describes(kind, summary, seen))

        board = shared.board(("sagemaker", kind, conn, region), changes)
        return board.get(name, self.shared_max_age)

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
        description = self._description(handle, hook, handle["job_name"])
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

    def log_budget(self, handle: dict[str, Any]) -> shared.RateBudget:
        """CloudWatch Logs' reads of the process (its account-wide rates: shared.RateBudget)."""
        return shared.cloudwatch_budget(handle["aws_conn_id"], handle.get("region_name", ""))

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
