"""Ray cluster backend (`ray`): a Ray job on an existing cluster, through the Ray Jobs REST API.

    spec.entrypoint / config / result -> the job's entrypoint, `python job_entry.py ...` (one
        shell-quoted command: the Jobs API takes a string); the stage's driver then connects to
        the cluster itself (Ray sets RAY_ADDRESS), so data prep spreads its shards over it
    spec.env + settings.runtime_env   -> runtime_env (env_vars, and e.g. a working_dir)
    spec.name                         -> submission_id: a retried task finds its job by it
    settings.entrypoint_num_cpus/gpus -> where the driver may run

`staging_uri` is an s3:// prefix, or a directory the cluster shares with Airflow (an EFS or FSx
mount; on one machine, any directory): the config and the result JSON live there.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from pathlib import Path
from typing import Any

from llmops.infra.aws import s3
from llmops.jobs.backends import remote
from llmops.jobs.backends.backend_settings import load
from llmops.jobs.backends.base import Backend, JobState, JobStatus
from llmops.jobs.backends.ray.ray_settings import RaySettings
from llmops.jobs.spec import JobSpec, JobSpecError, cost_allocation_tags

log = logging.getLogger(__name__)
STATES = {"PENDING": JobState.PENDING, "RUNNING": JobState.RUNNING, "SUCCEEDED": JobState.SUCCEEDED,
          "FAILED": JobState.FAILED, "STOPPED": JobState.STOPPED}


def shared_plan(spec: JobSpec, job_name: str, staging_dir: str) -> remote.Staged:
    """Where the job reads and writes when staging is a shared directory: paths stay paths."""
    prefix = os.path.join(staging_dir, spec.name, job_name)
    output = str(spec.config.get("output_dir") or spec.output_uri or os.path.join(prefix, "output"))
    return remote.Staged(config=dict(spec.config), inputs=remote.find_inputs(spec.config),
                         output_uri=output, checkpoint_uri=spec.checkpoint_uri,
                         result_uri=os.path.join(prefix, "result.json"),
                         config_uri=os.path.join(prefix, "config.json"), prefix=prefix)


class RayBackend(Backend):
    name = "ray"

    def __init__(self, settings: dict[str, Any] | None = None):
        self._settings = settings

    def _hook(self, conn_id: str):
        from llmops.jobs.backends.ray.ray_hook import RayJobsHook

        return RayJobsHook(ray_conn_id=conn_id)

    def submit(self, spec: JobSpec) -> dict[str, Any]:
        if not spec.name:
            raise JobSpecError("JobSpec.name is required to submit: it makes retries reattach.")
        settings = load("ray", RaySettings, self._settings).for_stage(spec.stage)
        settings.require("staging_uri", backend="ray")
        remote.check_environment(spec.env)
        remote.warn_if_unreachable(spec.env, log)
        hook = self._hook(settings.ray_conn_id)
        attempt, found = remote.latest_attempt(spec.name, hook.get_job, max_len=128)
        shared = not s3.is_s3(settings.staging_uri)
        plan = (lambda name: shared_plan(spec, name, settings.staging_uri)) if shared else (
            lambda name: remote.plan(spec, name, settings.staging_uri))
        if found is not None and found["status"] in ("PENDING", "RUNNING", "SUCCEEDED"):
            job_name = remote.attempt_name(spec.name, attempt, 128)
            return self._handle(spec, settings, plan(job_name), job_name, attempt, True)
        attempt += 1
        job_name = remote.attempt_name(spec.name, attempt, 128)
        staged = plan(job_name)
        if shared:
            Path(staged.config_uri).parent.mkdir(parents=True, exist_ok=True)
            Path(staged.config_uri).write_text(json.dumps(staged.config, indent=2))
        else:
            remote.upload(staged, s3.s3_hook(settings.aws_conn_id, settings.region_name), log)
        res = remote.merged(spec, settings)
        env = dict(res["env"])
        remote.check_environment(env)
        args = remote.entry_args(spec, staged, launcher="none", nproc_per_node=1)
        entrypoint = shlex.join([settings.python, settings.entry_script, *args])
        # The stage's driver may call ray.init with a runtime_env of its own (data prep does):
        # let Ray merge it with the job's instead of refusing the conflict.
        runtime_env = {**settings.runtime_env,
                       "env_vars": {"RAY_OVERRIDE_JOB_RUNTIME_ENV": "1",
                                    **settings.runtime_env.get("env_vars", {}), **env}}
        from llmops.jobs.backends.ray.ray_hook import RayJobExists

        try:
            hook.submit_job(entrypoint, job_name, runtime_env=runtime_env,
                            # with the cost-allocation tags: dag_id, run_id, team, stage
                            metadata={"llmops_job": spec.name, **cost_allocation_tags(spec)},
                            entrypoint_num_cpus=settings.entrypoint_num_cpus,
                            entrypoint_num_gpus=settings.entrypoint_num_gpus)
        except RayJobExists:  # another try of this task submitted it a moment ago
            return self._handle(spec, settings, staged, job_name, attempt, True)
        log.info("Submitted Ray job %s", job_name)
        return self._handle(spec, settings, staged, job_name, attempt, False)

    def _handle(self, spec, settings, staged, job_name, attempt, reattached) -> dict[str, Any]:
        return {"backend": self.name, "name": spec.name, "job_name": job_name, "attempt": attempt,
                "ray_conn_id": settings.ray_conn_id, "aws_conn_id": settings.aws_conn_id,
                "region_name": settings.region_name, "result_uri": staged.result_uri,
                "copy_back": staged.copy_back, "reattached": reattached}

    def status(self, handle: dict[str, Any]) -> JobStatus:
        job = self._hook(handle["ray_conn_id"]).get_job(handle["job_name"])
        if job is None:
            return JobStatus(JobState.FAILED, f"the Ray cluster has no job {handle['job_name']} "
                                              "(was the cluster restarted?)")
        state = STATES.get(job["status"], JobState.RUNNING)
        details = {"status": job["status"], "driver_exit_code": job.get("driver_exit_code")}
        if state is JobState.SUCCEEDED:
            result, why = self._result(handle)
            if result is None:
                return JobStatus(JobState.FAILED, why, details=details)
            return JobStatus(state, result=result, details=details)
        return JobStatus(state, job.get("message") or job["status"], details=details)

    def _result(self, handle: dict[str, Any]) -> tuple[dict | None, str]:
        if s3.is_s3(handle["result_uri"]):
            return remote.fetch_result(handle, s3.s3_hook(handle["aws_conn_id"],
                                                          handle.get("region_name", "")), log)
        path = Path(handle["result_uri"])
        if not path.exists():
            return None, f"the Ray job succeeded but wrote no result at {path}"
        return json.loads(path.read_text()), ""

    def stop(self, handle: dict[str, Any]) -> None:
        if self._hook(handle["ray_conn_id"]).stop_job(handle["job_name"]):
            log.info("Stopped Ray job %s", handle["job_name"])

    def read_logs(self, handle: dict[str, Any], cursor: Any = None) -> tuple[list[str], Any]:
        offset = int(cursor or 0)
        text = self._hook(handle["ray_conn_id"]).get_logs(handle["job_name"])
        end = text.rfind("\n", offset) + 1 if "\n" in text[offset:] else offset
        return text[offset:end].splitlines(), end
