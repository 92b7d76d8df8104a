"""A pretraining paused on request (tasks/train/pause.py, from the UI: llmops.airflow.pause_api)
ends its task skipped, not failed: the job checkpointed the step and exited with PAUSED_EXIT on
purpose.

JobPause is mixed into llmops.airflow.operators.job_operator.JobOperator:
- `_pause_links(spec)`, while the job runs: records where the job reads its PAUSE marker (XCom
  pause_api.XCOM_KEY, which the pause endpoint reads) and returns the "Pause pretraining" link;
- `_end_paused(...)`, when the job ended paused: the task log says "paused at step N" and how to
  resume (a run with from_run, start_at pretrain, fork_step N), the MLflow child run gets the
  pause record a resume is checked against (llmops.stages.reuse.pause_record) and ends KILLED, the
  parent run is tagged `paused_at_step` and `resume` and ends KILLED, the DAG run's note says
  "paused at step N of M" with the resume (the XCom llmops.airflow.run_note copies when the run
  ends), and AirflowSkipException ends the task (no retry, no further attempt of the chain; the
  later stages do not run: llmops.stages.specs skips a stage whose pretrained model is missing).
"""

from __future__ import annotations

import json
import re
from typing import Any

from airflow.sdk import conf
from airflow.sdk.exceptions import AirflowSkipException

from llmops.airflow import pause_api
from llmops.infra import tracking
from llmops.jobs.backends import JobStatus, remote
from llmops.jobs.spec import JobSpec
from llmops.stages import reuse
from llmops.stages.run_summary import NOTE_XCOM

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
    """Mixed into JobOperator: needs its `_ti`, `_handle`, `_run_id`, `_parent_run_id`,
    `_cache_ctx` (JobCache) and `_end_run` (JobBooks)."""

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

    def _end_paused(self, context: Any, stage: str, name: str, step: int | None,
                    result: dict[str, Any] | None = None) -> None:
        """End the task of a job that paused on request: skipped, saying where and how to go on;
        with the step known, leave what the resume needs and mark the run paused."""
        ti = context["ti"]
        result = result or {}
        at = f"step {step}" if step is not None else "a step its log names"
        fork_step = step if step is not None else "N (the step in its log's 'paused at step N')"
        conf = ""
        if step is not None:
            self._leave_pause_record(result, ti, name)
            triggered = getattr(context.get("dag_run"), "conf", None)
            conf = f": {json.dumps(reuse.resume_conf(triggered, ti.run_id, step))}"
            total = result.get("max_steps")
            self._mark_run_paused(ti, step, (
                f"paused at step {step}{f' of {total}' if total else ''}: {stage} checkpointed "
                f"that step and stopped on request; no model, so the later stages were skipped. "
                f"Resume with from_run={ti.run_id}, start_at=pretrain, fork_step={step} and the "
                f"run's other Params unchanged{conf}"))
        self._end_run(self._run_id, "KILLED")
        self.log.warning(
            "%s job %s paused at %s on request: that step's checkpoint is committed and no model "
            "was published, so the later stages do not run. To resume, trigger %s with from_run=%s, "
            "start_at=pretrain, fork_step=%s and nothing else changed%s (it ends bitwise where an "
            "unpaused run ends).", stage, name, at, ti.dag_id, ti.run_id, fork_step, conf)
        raise AirflowSkipException(f"{stage} paused at {at} on request; resume with from_run="
                                   f"{ti.run_id}, start_at=pretrain, fork_step={fork_step}")

    def _leave_pause_record(self, result: dict[str, Any], ti: Any, name: str) -> None:
        """The pause record (llmops.stages.reuse.pause_record) on the job's MLflow child run."""
        if not self._run_id:
            return
        ctx = self._cache_ctx or {}
        try:
            record = reuse.pause_record(result, identity=ctx.get("identity") or {},
                                        key=ctx.get("key", ""), where={
                                            "job_name": name, "mlflow_run_id": self._run_id,
                                            "dag_id": ti.dag_id, "run_id": ti.run_id,
                                            "task_id": ti.task_id})
            tracking.log_json(self._run_id, record, reuse.PAUSE_ARTIFACT)
        except Exception as exc:  # noqa: BLE001 - the pause itself stands; its resume is refused
            self.log.warning("Could not leave the pause record on MLflow run %s (%s: %s): a resume "
                             "through from_run will be refused; clearing this task resumes the job "
                             "in place.", self._run_id, type(exc).__name__, exc)

    def _mark_run_paused(self, ti: Any, step: int, note: str) -> None:
        """The DAG run cannot pass for a finished one: its note (llmops.airflow.run_note), and its
        MLflow parent run tagged paused_at_step and resume (the resume Params) and ended KILLED."""
        try:
            ti.xcom_push(key=NOTE_XCOM, value=note)
        except Exception as exc:  # noqa: BLE001 - the task log says it too
            self.log.warning("Could not leave the run's note: %s", exc)
        if not self._parent_run_id:
            return
        try:
            client = tracking.client()
            client.set_tag(self._parent_run_id, reuse.PAUSED_TAG, str(step))
            client.set_tag(self._parent_run_id, reuse.RESUME_TAG,
                           json.dumps(reuse.resume_params(ti.run_id, step)))
        except Exception as exc:  # noqa: BLE001
            self.log.warning("Could not tag MLflow run %s paused: %s", self._parent_run_id, exc)
        self._end_run(self._parent_run_id, "KILLED")
