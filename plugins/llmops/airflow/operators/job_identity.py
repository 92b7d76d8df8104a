"""What a job is: one identity, from a JobSpec and its backend's settings, with two projections.

- **The job's name** (`JobIdentity.job_name`, with the task instance's parts): everything that
  changes the job, paths included, since a task instance's job writes where its run says. A retry
  or clear of the same task with the same identity finds the same job
  (llmops.airflow.operators.job_operator).
- **The step-cache key** (`JobIdentity.cache_key`, llmops.infra.step_cache): the same job seen
across
  runs: paths relative to its inputs and outputs, inputs by content hash, the code version.

The ledger's `spec_hash` is the name's hash (`JobIdentity.spec_hash`). Both hashes are what they
were before this module existed (tests/test_jobs.py pins them), so existing job names and cache
records stay valid.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from llmops.infra import step_cache
from llmops.jobs.spec import JobSpec, job_name

# Spec fields that do not change what the job computes: left out of the job's identity.
# settings_overrides: the backend's fingerprint hashes the settings they produce
NOT_IDENTITY = ("name", "tags", "mlflow_experiment", "mlflow_parent_run_id", "settings_overrides")


@dataclass(frozen=True)
class JobIdentity:
    """The job `spec` would run with backend settings `backend_settings` (Backend.fingerprint)."""

    spec: JobSpec
    backend_settings: str = ""

    @cached_property
    def spec_hash(self) -> str:
        """The run-scoped hash: in the job's name and the ledger's `spec_hash`."""
        return job_identity(self.spec, self.backend_settings)

    @cached_property
    def cache_parts(self) -> dict[str, Any]:
        """The run-free identity the step cache records (and explains a miss with)."""
        return step_cache.identity(self.spec, self.backend_settings)

    @cached_property
    def cache_key(self) -> str:
        return step_cache.key_of(self.cache_parts)

    def job_name(self, *task: str, salt: str = "", prefix: str = "") -> str:
        """The job's name for the task instance `task` (dag, run, task, map index); `salt` (from
        force_rerun) makes a fresh job."""
        return job_name(*task, self.spec_hash, *([salt] if salt else []), prefix=prefix)


def job_identity(spec: JobSpec, fingerprint: str = "") -> str:
    """A hash of everything that changes what the job is (see JobOperator: "Which job")."""
    data = {k: v for k, v in spec.to_dict().items() if k not in NOT_IDENTITY}
    # The MLFLOW_* variables are added per try (run id, tracking URI); the child run they name is
    # found by the task's identity, which is in the name already.
    data["env"] = {k: v for k, v in spec.env.items() if not k.startswith("MLFLOW_")}
    # The inputs' content (the paths are in the config): where the index is, or whether to
    # look in it, changes nothing the job computes.
    data["cache"] = {n: i.get("hash") for n, i in (spec.cache.get("inputs") or {}).items()}
    data["backend_settings"] = fingerprint
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
