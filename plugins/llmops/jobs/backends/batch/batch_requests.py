"""The AWS Batch requests of one attempt, as pure functions: the stage's job definition, the
SubmitJob request, its fair-share fields (`scheduling`) and tags. How a JobSpec maps onto them:
the docstring of llmops.jobs.backends.batch.batch_backend."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from llmops.jobs.backends import remote
from llmops.jobs.backends.batch.batch_settings import BatchSettings
from llmops.jobs.backends.fabric import fabric_env
from llmops.jobs.spec import JobSpec, JobSpecError

# Rules AWS documents but botocore's Batch model does not carry.
SHARE_IDENTIFIER = re.compile(r"^[A-Za-z0-9]{1,255}\*?$")
DEFAULT_PRIORITY = 0    # a fair-share queue needs a scheduling priority; runs without one get this


def batch_tags(tags: dict[str, str]) -> dict[str, str]:
    """Batch tags: at most 50, keys up to 128 and values up to 256 characters, no `aws:` keys."""
    out = {}
    for key, value in sorted(tags.items()):
        if str(key).lower().startswith("aws:") or not str(key):
            continue
        out[str(key)[:128]] = str(value)[:256]
    return dict(list(out.items())[:50])


def scheduling(spec: JobSpec, share_identifier: str = "", fair_share: bool | None = None) -> dict[str, Any]:
    """shareIdentifier and schedulingPriorityOverride for the job's queue.

    `fair_share` is whether the queue has a fair-share scheduling policy (BatchBackend asks
    DescribeJobQueues): then both are required (the share from `share_identifier`, the team's in
    llmops_teams, else the run's team name; the priority from the run, else DEFAULT_PRIORITY);
    without one Batch refuses a share, so neither is sent. None (not known: rendering without AWS)
    sends the run's team and priority when it names them."""
    out: dict[str, Any] = {}
    if fair_share is False:
        return out
    team = share_identifier or spec.tags.get("team", "")
    if fair_share and not team:
        raise JobSpecError("The Batch job queue has a fair-share scheduling policy, which needs a "
                           "share identifier for every job: run with a team (the 'team' Param, "
                           "llmops_teams) or set share_identifier in the batch settings.")
    if team:
        if not SHARE_IDENTIFIER.match(team):
            raise JobSpecError(f"Team {team!r} is not a valid Batch fair-share identifier "
                               "(letters and digits only, at most 255).")
        out["shareIdentifier"] = team
    priority = spec.tags.get("priority", "")
    if priority == "" and fair_share:
        priority = DEFAULT_PRIORITY
    if priority != "":
        value = int(priority)
        if not 0 <= value <= 9999:
            raise JobSpecError(f"Priority {value} is outside Batch's 0-9999.")
        out["schedulingPriorityOverride"] = value
    return out


def job_definition(spec: JobSpec, settings: BatchSettings, image: str, nodes: int) -> dict[str, Any]:
    """RegisterJobDefinition request for the stage; its content hash is in its tags."""
    resources = [{"type": "VCPU", "value": str(settings.vcpus)},
                 {"type": "MEMORY", "value": str(settings.memory_mib)}]
    if settings.gpus:
        resources.append({"type": "GPU", "value": str(settings.gpus)})
    container: dict[str, Any] = {"image": image, "command": ["python3", settings.entry_script, "--help"],
                                 "resourceRequirements": resources}
    if settings.job_role_arn:
        container["jobRoleArn"] = settings.job_role_arn
    if settings.execution_role_arn:
        container["executionRoleArn"] = settings.execution_role_arn
    linux: dict[str, Any] = {}
    if settings.efa_devices:
        # EFA needs its devices in the container and unlimited locked memory for RDMA buffers.
        linux["devices"] = [{"hostPath": f"/dev/infiniband/uverbs{i}",
                             "containerPath": f"/dev/infiniband/uverbs{i}",
                             "permissions": ["READ", "WRITE", "MKNOD"]}
                            for i in range(settings.efa_devices)]
        container["ulimits"] = [{"name": "memlock", "softLimit": -1, "hardLimit": -1}]
    if settings.shared_memory_mib:
        linux["sharedMemorySize"] = settings.shared_memory_mib
    if linux:
        container["linuxParameters"] = linux
    request: dict[str, Any] = {
        "jobDefinitionName": f"llmops-{spec.stage}".replace("_", "-"),
        "type": "multinode",
        "nodeProperties": {"numNodes": nodes, "mainNode": 0,
                           "nodeRangeProperties": [{"targetNodes": "0:", "container": container}]},
        "platformCapabilities": ["EC2"],
        "propagateTags": settings.propagate_tags,
    }
    fingerprint = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:16]
    request["tags"] = {"llmops:fingerprint": fingerprint, "llmops:stage": spec.stage}
    return request


def submit_request(spec: JobSpec, settings: BatchSettings, staged: remote.Staged, job_name: str,
                   definition_arn: str, fair_share: bool | None = None) -> dict[str, Any]:
    """The SubmitJob request (the keyword arguments BatchOperator would pass); `fair_share`:
    whether the queue has a fair-share scheduling policy (see `scheduling`)."""
    res = remote.merged(spec, settings)
    nodes = res["instance_count"]
    env = {**fabric_env(res["instance_type"], nodes, efa=settings.efa_devices > 0), **res["env"],
           **remote.kms_env(settings)}
    remote.check_environment(env)
    args = remote.entry_args(spec, staged, launcher="torchrun", nproc_per_node=res["nproc_per_node"])
    overrides: dict[str, Any] = {"command": ["python3", settings.entry_script, *args],
                                 "environment": [{"name": k, "value": v} for k, v in sorted(env.items())]}
    if res["instance_type"]:
        if res["instance_type"].startswith("ml."):
            raise JobSpecError(f"{res['instance_type']} is a SageMaker instance type; Batch takes "
                               "EC2 names such as p4d.24xlarge.")
        overrides["instanceType"] = res["instance_type"]
    request: dict[str, Any] = {
        "jobName": job_name,
        "jobQueue": settings.job_queue,
        "jobDefinition": definition_arn,
        "nodeOverrides": {"numNodes": nodes, "nodePropertyOverrides": [
            {"targetNodes": "0:", "containerOverrides": overrides}]},
        "timeout": {"attemptDurationSeconds": max(60, spec.max_run_seconds)},
        "propagateTags": settings.propagate_tags,
        "tags": batch_tags(res["tags"]),
        **scheduling(spec, settings.share_identifier, fair_share),
    }
    if settings.retry_attempts > 1:
        # Retry when the host went away (spot reclaim, hardware), not when the job itself failed.
        request["retryStrategy"] = {"attempts": min(settings.retry_attempts, 10), "evaluateOnExit": [
            {"onStatusReason": "Host EC2*", "action": "RETRY"},
            {"onReason": "*", "action": "EXIT"}]}
    remote.check_name("batch", job_name)
    return request
