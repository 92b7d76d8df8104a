"""A pretraining paused on request (tasks/train/pause.py, from the UI: llmops.pause_api) ends its
task skipped, not failed: the job checkpointed the step and exited with PAUSED_EXIT on purpose.

JobPause is mixed into llmops.operators.job.JobOperator:
- `_pause_links(spec)`, while the job runs: records where the job reads its PAUSE marker (XCom
  pause_api.XCOM_KEY, which the pause endpoint reads) and returns the "Pause pretraining" link;
- `_end_paused(...)`, when the job ended paused: the task log says "paused at step N" and how to
  resume (a run with from_run, start_at pretrain, fork_step N), the MLflow child run ends KILLED,
  and AirflowSkipException ends the task (no retry, no further attempt of the chain; the later
  stages do not run: llmops.lifecycle skips a stage whose pretrained model is missing).
"""

from __future__ import annotations

import re
from typing import Any

from airflow.sdk import conf
from airflow.sdk.exceptions import AirflowSkipException

from llmops import pause_api
from llmops.jobs.backends import JobStatus, remote
from llmops.jobs.spec import JobSpec

PAUSED_EXIT = remote.PAUSED_EXIT  # tasks.train.supervisor's (tests/test_pause_ui.py checks they agree)
_EXIT_77 = re.compile(rf"\bexit(?:ed with)? code {PAUSED_EXIT}\b|\bexitCode\W+{PAUSED_EXIT}\b")


def paused(status: JobStatus) -> tuple[bool, int | None]:
    """(True, the step it paused at, or None when only the exit code says so) for a job that
    paused on request; (False, None) otherwise."""
    result = status.result or {}
    if result.get("paused"):
        step = result.get("paused_at_step")
        return True, int(step) if step is not None else None
    details = status.details or {}
    if details.get("exit_code") == PAUSED_EXIT or _EXIT_77.search(status.message or ""):
        return True, None
    return False, None


def page_url(dag_id: str, run_id: str) -> str:
    """The pause page of a run: absolute under [api] base_url when it is set, else from the
    server's root."""
    from urllib.parse import quote

    base = (conf.get("api", "base_url", fallback="") or "").rstrip("/")
    path = pause_api.PAGE_PATH.format(dag_id=quote(dag_id, safe=""), run_id=quote(run_id, safe=""))
    return f"{base}/{path}"


class JobPause:
    """Mixed into JobOperator: needs its `_ti`, `_handle`, `_run_id`, `_end_run` (JobBooks)."""

    def _pause_links(self, spec: JobSpec) -> dict[str, str]:
        """For the lifecycle's pretrain task: record where its job reads the marker, and return
        the link to the pause page ({} for every other task)."""
        ti = self._ti
        if spec.stage != "pretrain" or ti.task_id != pause_api.TASK_ID or ti.map_index >= 0:
            return {}
        handle = self._handle or {}
        marker, why_not = pause_api.marker_place(spec.backend, str(spec.config.get("output_dir") or ""),
                                                 handle)
        place = {"marker": marker, "why_not": why_not, "backend": spec.backend,
                 "job_name": str(handle.get("job_name") or spec.name),
                 **{k: handle[k] for k in ("aws_conn_id", "region_name", "kms_key_id")
                    if handle.get(k)}}
        try:
            ti.xcom_push(key=pause_api.XCOM_KEY, value=place)
        except Exception as exc:  # noqa: BLE001 - without it the page says it can't pause
            self.log.warning("Could not record where job %s reads its pause marker: %s",
                             place["job_name"], exc)
            return {}
        return {pause_api.LINK_NAME: page_url(ti.dag_id, ti.run_id)}

    def _end_paused(self, context: Any, stage: str, name: str, step: int | None) -> None:
        """End the task of a job that paused on request: skipped, saying where and how to go on."""
        self._end_run(self._run_id, "KILLED")
        ti = context["ti"]
        at = f"step {step}" if step is not None else "a step its log names"
        fork_step = step if step is not None else "N (the step in its log's 'paused at step N')"
        self.log.warning(
            "%s job %s paused at %s on request: that step's checkpoint is committed and no model "
            "was published, so the later stages do not run. To resume, trigger %s with from_run=%s, "
            "start_at=pretrain, fork_step=%s and nothing else changed (it ends bitwise where an "
            "unpaused run ends).", stage, name, at, ti.dag_id, ti.run_id, fork_step)
        raise AirflowSkipException(f"{stage} paused at {at} on request; resume with from_run="
                                   f"{ti.run_id}, start_at=pretrain, fork_step={fork_step}")
