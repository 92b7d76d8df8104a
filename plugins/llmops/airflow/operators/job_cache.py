"""The step cache on JobOperator's side (llmops.infra.step_cache): reuse a finished job with the
same identity instead of running one, and record each job that succeeds for later runs.

JobCache is mixed into llmops.airflow.operators.job_operator.JobOperator. The identity it looks up
is llmops.airflow.operators.job_identity.JobIdentity's `cache_key`, the projection of the same
identity the job's name is made from.
"""

from __future__ import annotations

from typing import Any

from llmops.airflow.operators.job_identity import JobIdentity
from llmops.infra import ledger, step_cache, tracking
from llmops.jobs.backends import Backend
from llmops.jobs.spec import JobSpec, cost_allocation_tags


class JobCache:
    """Mixed into JobOperator: needs its `_forced`, `_run_id`, `_ti`, `_cache_ctx` and
    `_push_links` (JobBooks)."""

    def _reuse(self, backend: Backend, spec: JobSpec, started: bool = False) -> dict[str, Any] | None:
        """The result of an earlier job this task reuses instead of running one, or None (then
        `self._cache_ctx` says where the job's record goes once it succeeds). A task that
        already started its job (`started`: an earlier try's, in the task state store) keeps
        it: it reattaches rather than leave that job running unwatched."""
        cache = spec.cache or {}
        if not cache.get("index"):
            return None
        if cache.get("taken"):  # from_run: the earlier run's stage, checked by start_run
            return self._reused(spec, cache["taken"], "from_run")
        identity = JobIdentity(spec, backend.fingerprint(spec))
        parts, key = identity.cache_parts, identity.cache_key
        self._cache_ctx = {"index": cache["index"], "key": key, "identity": parts}
        if self._forced:
            self.log.info("Step cache: force_rerun is set, so %s runs its job afresh (identity %s).",
                          spec.stage, key[:12])
            return None
        if started:
            self.log.info("Step cache: an earlier try of this task started job %s; reattaching to "
                          "it (identity %s).", spec.name, key[:12])
            return None
        if not cache.get("lookup", True):
            self.log.info("Step cache: off for this run (Param cache), so %s runs its job (identity "
                          "%s); it is recorded for later runs.", spec.stage, key[:12])
            return None
        index = step_cache.Index(cache["index"])
        record, why = step_cache.lookup(index, spec.stage, key)
        if record is None:
            self.log.info("Step cache miss for %s (identity %s): %s%s. Running the job.", spec.stage,
                          key[:12], why, self._what_changed(index, spec.stage, parts))
            return None
        return self._reused(spec, record, "cache")

    def _what_changed(self, index: step_cache.Index, stage: str, parts: dict[str, Any]) -> str:
        try:
            latest = index.latest(stage)
        except Exception:  # noqa: BLE001 - only an explanation
            return ""
        if not latest or not latest.get("identity"):
            return ""
        changed = step_cache.differences(latest["identity"], parts)
        return (f"; the newest recorded {stage} job ({latest.get('job_name')}, run "
                f"{latest.get('run_id')}) differs in {', '.join(changed[:8])}") if changed else ""

    def _reused(self, spec: JobSpec, record: dict[str, Any], how: str) -> dict[str, Any]:
        """Hand back `record`'s result as this task's: tag the child run, ledger it, log it."""
        source = {"mlflow_run_id": record.get("mlflow_run_id", ""), "job_name": record["job_name"],
                  "dag_id": record.get("dag_id", ""), "run_id": record.get("run_id", ""),
                  "key": record.get("key", ""), "how": how}
        saved = record.get("job_seconds")
        self.log.info(
            "%s %s: reusing the outputs of job %s (DAG run %s, MLflow run %s), %s; no job submitted%s.",
            "Step cache hit for" if how == "cache" else "from_run: taking", spec.stage,
            source["job_name"], source["run_id"], source["mlflow_run_id"],
            f"identity {source['key'][:12]}, outputs verified" if how == "cache"
            else "its outputs checked by start_run",
            f" (the job took {saved:.0f} s)" if isinstance(saved, (int, float)) else "")
        result = {**record["result"], "cached_from": source}
        self._push_links(self._run_id)   # the task's MLflow link: the child run that says cached_from
        if self._run_id:
            try:
                tracking.mark_reused(self._run_id, source, record)
            except Exception as exc:  # noqa: BLE001 - bookkeeping never decides the task
                self.log.warning("Could not tag MLflow run %s as reused: %s", self._run_id, exc)
        ledger.record_job("cached", {
            "job_name": source["job_name"], "spec_hash": source["key"], "stage": spec.stage,
            "backend": spec.backend, "image": spec.image, "team": cost_allocation_tags(spec)["team"],
            "dag_id": self._ti.dag_id, "run_id": self._ti.run_id, "task_id": self._ti.task_id,
            "map_index": int(self._ti.map_index), "try_number": int(self._ti.try_number),
            "instance_type": spec.instance_type, "instance_count": spec.instance_count,
            "mlflow_run_id": self._run_id}, state="succeeded")
        return result

    def cache_entry(self, result: dict[str, Any]) -> dict[str, Any] | None:
        """What of a succeeded job's result the step cache keeps; None: not reusable. Subclasses
        narrow it (a pruned trial's outcome depended on the other trials)."""
        return result

    def _record_in_cache(self, result: dict[str, Any], ended: dict[str, Any]) -> dict[str, Any]:
        """Record the job that just succeeded (after its result and outputs are complete) and
        return its result with the outputs' content hashes. Never fails the task."""
        ctx = self._cache_ctx
        if not ctx:
            return result
        entry = self.cache_entry(result)
        started, finished = ended.get("started_at"), ended.get("ended_at")
        ti = self._ti
        try:
            if entry is None:
                outputs = step_cache.output_fingerprints(result.get("outputs") or {})
                return {**result, "content_hashes": {n: o["hash"] for n, o in outputs.items()}}
            record = step_cache.make_record(key=ctx["key"], parts=ctx["identity"], result=entry, where={
                "job_name": result["job_name"], "mlflow_run_id": result.get("mlflow_run_id", ""),
                "dag_id": ti.dag_id, "run_id": ti.run_id, "task_id": ti.task_id,
                "map_index": int(ti.map_index),
                "job_seconds": (finished - started) if started and finished else None})
            uri = step_cache.Index(ctx["index"]).put(record)
        except Exception as exc:  # noqa: BLE001
            self.log.warning("Step cache: could not record job %s (%s: %s); later runs will run it "
                             "again.", result.get("job_name"), type(exc).__name__, exc)
            return result
        self.log.info("Step cache: recorded job %s as %s.", result["job_name"], uri)
        if self._run_id:
            try:
                tracking.log_json(self._run_id, record, step_cache.RECORD_ARTIFACT)
                tracking.client().set_tag(self._run_id, "cache_key", ctx["key"])
            except Exception as exc:  # noqa: BLE001
                self.log.warning("Could not log the step record to MLflow run %s: %s", self._run_id, exc)
        return {**result, "content_hashes": record["result"]["content_hashes"]}
