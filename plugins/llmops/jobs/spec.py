"""A backend-neutral description of one job.

Every backend maps the same spec: the local backend runs `python -m <entrypoint>` (torchrun for
several processes), SageMaker renders CreateTrainingJob, HyperPod a PyTorchJob, Batch a multi-node
job. Arguments are a list, never a shell string, so no user value is ever interpreted by a shell.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

# SageMaker's rule for job names, the strictest of our backends: 1-63 chars of [a-zA-Z0-9-],
# starting and ending alphanumeric, no double hyphen issues; Batch and Kubernetes accept it too.
JOB_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class JobSpecError(ValueError):
    """The spec is invalid; the message names the field."""


class NothingToRun(ValueError):
    """A build_spec has no job to build (say, the model it would train was never made because
    pretraining paused): JobOperator ends the task skipped with this message."""


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    stage: str                                   # data_prep, sweep, pretrain, finetune, distill, evaluate
    entrypoint: str                              # python module run as `python -m`, e.g. tasks.pretrain
    config: dict = field(default_factory=dict)   # the stage config; handed over as --config FILE
    argv: tuple = ()                             # extra arguments, one list element per argument
    name: str = ""                               # unique and deterministic per task: a retry reattaches
    backend: str = "local"
    image: str = ""                              # container image URI (remote backends)
    instance_type: str = "local"
    instance_count: int = 1
    nproc_per_node: int = 1                      # >1: torchrun launches that many processes per node
    env: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)   # channel name -> URI
    output_uri: str = ""
    checkpoint_uri: str = ""
    max_run_seconds: int = 24 * 3600
    tags: dict = field(default_factory=dict)
    mlflow_experiment: str = ""
    mlflow_parent_run_id: str = ""
    # The step cache (llmops.infra.step_cache.for_spec): the index's root, each input's path and
    # content hash, whether to look up, and a record taken from an earlier run. {}: never cached.
    cache: dict = field(default_factory=dict)
    # Backend settings this job must run with, over the deployment's blocks and their stage
    # overrides (the run's policy decides them: its team's role, fair share, namespace, queue):
    # settings class name -> field -> value, e.g. {"BatchSettings": {"job_role_arn": "arn:..."}}.
    settings_overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.stage:
            raise JobSpecError("JobSpec.stage is required (e.g. 'pretrain').")
        if not ENTRYPOINT_RE.match(self.entrypoint):
            raise JobSpecError(f"JobSpec.entrypoint must be a dotted module name, got {self.entrypoint!r}.")
        if self.name and not JOB_NAME_RE.match(self.name):
            raise JobSpecError(f"JobSpec.name {self.name!r} must be 1-63 letters, digits or hyphens, "
                               "starting and ending with a letter or digit.")
        if not all(isinstance(a, str) for a in self.argv):
            raise JobSpecError("JobSpec.argv must be a list of strings (one per argument, no shell).")
        for key, value in self.env.items():
            if not ENV_NAME_RE.match(str(key)) or not isinstance(value, str):
                raise JobSpecError(f"JobSpec.env entry {key!r} must map a valid name to a string.")
        if not all(isinstance(v, dict) for v in self.settings_overrides.values()):
            raise JobSpecError("JobSpec.settings_overrides must map a settings class name to "
                               "{field: value}, e.g. {'BatchSettings': {'job_role_arn': '...'}}.")
        for label, number in (("instance_count", self.instance_count),
                              ("nproc_per_node", self.nproc_per_node),
                              ("max_run_seconds", self.max_run_seconds)):
            if not isinstance(number, int) or number < 1:
                raise JobSpecError(f"JobSpec.{label} must be a positive integer, got {number!r}.")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["argv"] = list(self.argv)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise JobSpecError(f"Unknown JobSpec field(s): {unknown}.")
        data = dict(data)
        data["argv"] = tuple(data.get("argv", ()))
        return cls(**data)

    def replace(self, **changes: Any) -> "JobSpec":
        return dataclasses.replace(self, **changes)


# The cost-allocation tags every backend puts on every job (SageMaker and Batch tags, HyperPod
# labels, Ray job metadata): activate them in AWS Billing to split the bill by pipeline and run.
# The operator sets dag_id and run_id in spec.tags from the task instance; team defaults like
# HyperPod's namespace does.
COST_TAGS = ("dag_id", "run_id", "team", "stage")
DEFAULT_TEAM = "default"


def cost_allocation_tags(spec: JobSpec) -> dict[str, str]:
    """{dag_id, run_id, team, stage} of the job ("" for dag_id / run_id outside a DAG run)."""
    return {"dag_id": str(spec.tags.get("dag_id", "")), "run_id": str(spec.tags.get("run_id", "")),
            "team": str(spec.tags.get("team") or DEFAULT_TEAM), "stage": spec.stage}


def job_name(*parts: str, prefix: str = "") -> str:
    """A valid, deterministic job name: readable prefix + hash of the identifying parts.

    The same (dag, run, task, map index) always gives the same name, so a retried task finds the
    job its earlier try submitted instead of starting a duplicate.
    """
    digest = hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:12]
    readable = re.sub(r"[^a-zA-Z0-9]+", "-", prefix).strip("-")[: 63 - 13] or "job"
    return f"{readable}-{digest}"
