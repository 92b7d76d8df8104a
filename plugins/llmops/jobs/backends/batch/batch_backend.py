"""AWS Batch backend (`batch`): a multi-node parallel job per stage.

    spec.image + settings (vCPUs, memory, GPUs, EFA devices, roles) -> a job definition
        `llmops-<stage>` of type multinode; a revision is registered only when they change
    spec.instance_count                  -> nodeOverrides.numNodes (node 0 is the main node)
    spec.instance_type                   -> the nodes' instanceType (EC2 names, e.g. p4d.24xlarge)
    spec.entrypoint/config/outputs       -> containerOverrides.command: docker/job_entry.py with
        `--launcher torchrun`, which starts torchrun on every node with the node index and the
        main node's address Batch provides (AWS_BATCH_JOB_*)
    spec.env (+ EFA/NCCL with EFA)       -> containerOverrides.environment (secrets refused)
    the queue's schedulingPolicyArn      -> whether the job carries shareIdentifier and
                                            schedulingPriorityOverride: a fair-share queue
                                            requires both, a FIFO queue refuses a share (checked
                                            with DescribeJobQueues before anything is claimed)
    settings.share_identifier or spec.tags["team"] -> shareIdentifier (fair-share queues only;
                                            one without either is refused before submission)
    spec.tags["priority"]                -> schedulingPriorityOverride (0-9999, higher runs first;
                                            DEFAULT_PRIORITY on a fair-share queue without one)
    spec.max_run_seconds                 -> timeout.attemptDurationSeconds (per attempt, from
                                            its startedAt; for a multi-node job, the whole job)
    settings.retry_attempts              -> retryStrategy (retry host failures, not job errors)
    the queue's compute environments     -> refused when one is SPOT or FARGATE_SPOT (Batch
                                            cannot run multi-node parallel jobs on Spot)

Submitted through the provider's BatchClientHook, with the arguments of BatchOperator, its
clients retrying throttling adaptively (llmops.infra.aws.retry), one hook per connection and region
in the process (llmops.jobs.backends.batch.batch_hook). One live job per attempt, whatever the
network loses: see BatchBackend.submit (a claim per attempt, a token on the job, copies of a
resent SubmitJob terminated after every submit and while the handle is young). A status's details
carry `started_at` (the current attempt's startedAt) once the job runs; the handle carries
`poll_interval` and `deadline_grace_seconds`. A multi-node job's log is the streams of its node
jobs (`<id>#<node>`): the parent job has none of its own while it runs.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from llmops.infra.aws import s3
from llmops.infra.aws.logs import follow, tail
from llmops.infra.aws.validation import validate_request
from llmops.jobs.backends import remote, shared
from llmops.jobs.backends.backend_settings import load
from llmops.jobs.backends.base import Backend, JobState, JobStatus
from llmops.jobs.backends.batch.batch_requests import job_definition, submit_request
from llmops.jobs.backends.batch.batch_settings import BatchSettings
from llmops.jobs.spec import JobSpec, JobSpecError

log = logging.getLogger(__name__)

STOP_REASON = "Stopped by its Airflow task (llmops)"
PENDING = {"SUBMITTED", "PENDING", "RUNNABLE", "STARTING"}
INTENT = "batch-job.json"          # an attempt's claim, then its job id (see BatchBackend.submit)
TOKEN_TAG = "llmops:submit-token"  # the claim's token, on the job it submitted
UNSUBMITTED = "UNSUBMITTED"        # a claim that led to no job
# After a claim, how long a job it submitted may take to show in ListJobs: the SubmitJob call
# (botocore's timeouts and retries) plus ListJobs' eventual consistency, with room for skew.
SUBMIT_WINDOW_SECONDS = 180.0
LIST_INTERVAL_SECONDS = 5.0
# After a submit, how long to wait for ListJobs to show the job SubmitJob answered with (so that a
# copy submitted before it, whose answer was lost, is listed too). status() keeps looking for
# copies until SUBMIT_WINDOW_SECONDS after the submit.
SETTLE_SECONDS = 60.0
FINISHED = ("SUCCEEDED", "FAILED")
DESCRIBE_BATCH = 100    # DescribeJobs takes at most 100 job ids a call
NOT_FOUND_RETRIES = 4   # a job just submitted may not be visible to DescribeJobs yet
MAIN_NODE = 0           # job_definition's mainNode: rank 0, which logs the steps
FAILED_NODE_LINES = 40  # the end of a node that failed while the others ran, shown once


class BatchBackend(Backend):
    name = "batch"
    poll_interval = 30.0     # seconds; the handle's `poll_interval` (settings) takes precedence
    log_lag_seconds = 10.0   # CloudWatch: a job's last lines can arrive this long after its end

    def __init__(self, settings: dict[str, Any] | None = None):
        self._settings = settings

    def _hook(self, aws_conn_id: str, region_name: str = ""):
        from llmops.jobs.backends.batch.batch_hook import jobs_hook

        return jobs_hook(aws_conn_id, region_name)   # one per process (llmops.infra.aws.clients)

    def _board(self, handle: dict[str, Any]) -> shared.SharedReads:
        """The process's shared DescribeJobs for the handle's connection and region."""
        conn, region = handle["aws_conn_id"], handle.get("region_name", "")

        def describe(ids: list[str]) -> dict[str, dict[str, Any]]:
            found = self._hook(conn, region).client.describe_jobs(jobs=ids).get("jobs", [])
            return {j["jobId"]: j for j in found if j.get("jobId") in ids}

        return shared.board(("batch", conn, region), lambda: shared.SharedReads(describe, DESCRIBE_BATCH))

    def _described(self, handle: dict[str, Any], hook: Any, ids: list[str]) -> list[dict[str, Any]]:
        """DescribeJobs for `ids`: through the process's shared read when this is a trigger's
        (a value at most a third of a poll interval old), what it lacks read here."""
        found: list[dict[str, Any]] = []
        if self.shared_max_age:
            board = self._board(handle)
            found = [job for job in (board.get(i, self.shared_max_age) for i in ids) if job is not None]
            ids = [i for i in ids if i not in {j["jobId"] for j in found}]
        for start in range(0, len(ids), DESCRIBE_BATCH):
            found += hook.client.describe_jobs(jobs=ids[start:start + DESCRIBE_BATCH]).get("jobs", [])
        return found

    def _find(self, hook: Any, queue: str, name: str) -> dict[str, Any] | None:
        """The newest job of this name in the queue (Batch names are not unique), or None."""
        jobs = hook.client.list_jobs(jobQueue=queue, filters=[{"name": "JOB_NAME", "values": [name]}])
        matches = [j for j in jobs.get("jobSummaryList", []) if j["jobName"] == name]
        return max(matches, key=lambda j: j.get("createdAt", 0)) if matches else None

    def _definition(self, hook: Any, request: dict[str, Any]) -> str:
        """An ACTIVE revision with the same content, else a newly registered one."""
        wanted = request["tags"]["llmops:fingerprint"]
        found = hook.client.describe_job_definitions(jobDefinitionName=request["jobDefinitionName"],
                                                     status="ACTIVE")
        for definition in sorted(found.get("jobDefinitions", []), key=lambda d: -d["revision"]):
            if definition.get("tags", {}).get("llmops:fingerprint") == wanted:
                return definition["jobDefinitionArn"]
        validate_request("batch", "RegisterJobDefinition", request)
        return hook.client.register_job_definition(**request)["jobDefinitionArn"]

    def submit(self, spec: JobSpec) -> dict[str, Any]:
        """Submit the spec's next attempt, or reattach to the one that is running or succeeded.

        Batch job names are not unique and ListJobs is eventually consistent, so a worker that
        died right after SubmitJob (before anything recorded the job id) would, on a name lookup
        alone, submit a second multi-node job. Each attempt is therefore claimed before it is
        submitted, with a conditional S3 write (PutObject If-None-Match: *) of an intent record
        at `<staging>/<spec name>/<job name>/batch-job.json` holding a fresh token; the job is
        submitted with that token as a tag, and its id is written into the record right after.
        A retry reads the record of each attempt:

        - with a job id: the job is described (strongly consistent) and reattached to;
        - a claim without a job id: the crash window, between the claim and the id being
          written. The job may or may not exist. Jobs of that name are listed (ListJobs with a
          JOB_NAME filter returns every status, SUBMITTED to FAILED) and described to find the
          one tagged with the claim's token, retrying until SUBMIT_WINDOW_SECONDS after the claim
          (SubmitJob's own time plus ListJobs' lag), so a job that was submitted is seen; only
          then is the claim taken over (a conditional overwrite, If-Match its ETag, with a new
          token) and the job submitted;
        - no record: nothing was claimed (or it was submitted before intent records existed:
          the old name lookup in the queue, `_find`, still finds it).

        Two tries claiming one attempt at once: one conditional write wins, the other reads the
        winner's record and waits for its job (a claim whose own response was lost is recognised
        by its token). botocore resends a SubmitJob whose response was lost (a read timeout, a
        reset): AWS may have accepted the first, and then two multi-node jobs run. Every copy
        carries the claim's token, so after every submit the jobs of the attempt's name are
        listed until the one SubmitJob answered with shows (SETTLE_SECONDS), and any other job
        with the token is terminated; status() looks again until SUBMIT_WINDOW_SECONDS after the
        submit, for a copy ListJobs showed late. What remains: a worker that stalls for longer
        than the window between its last check of the record and SubmitJob (it re-reads the
        record just before submitting to keep that gap small); its copy carries the token too,
        and the crash-window resolution keeps the first and terminates the others.

        The queue is described first (DescribeJobQueues): a fair-share queue needs a share
        identifier and a priority on every job, a FIFO queue refuses a share (`scheduling`).
        """
        if not spec.name:
            raise JobSpecError("JobSpec.name is required to submit: it makes retries reattach.")
        settings = load("batch", BatchSettings, self._settings).for_job(spec)
        settings.require("job_queue", "staging_uri", backend="batch")
        remote.check_environment(spec.env)
        remote.warn_if_unreachable(spec.env, log)
        res = remote.merged(spec, settings)
        if not res["image"]:
            raise JobSpecError(f"No image for the {spec.stage} job: set stage_resources."
                               f"{spec.stage}.image or `image` in the batch settings.")
        hook = self._hook(settings.aws_conn_id, settings.region_name)
        s3_hook = s3.s3_hook(settings.aws_conn_id, settings.region_name, settings.kms_key_id)
        queue = self._queue(hook, settings.job_queue)
        fair_share = bool(queue.get("schedulingPolicyArn"))
        self._refuse_spot(hook, queue, res["instance_count"])
        # Rendered once before anything is claimed: a request Batch would refuse fails here.
        submit_request(spec, settings, remote.plan(spec, spec.name, settings.staging_uri),
                       remote.attempt_name(spec.name, 1, 128), "placeholder", fair_share)
        while True:
            attempt, found = remote.latest_attempt(
                spec.name, lambda name: self._attempt(hook, s3_hook, settings, spec, name), max_len=128)
            job_name = remote.attempt_name(spec.name, max(attempt, 1), 128)
            staged = remote.plan(spec, job_name, settings.staging_uri)
            if found is not None and found["status"] not in ("FAILED", UNSUBMITTED):
                return {**self._handle(spec, settings, staged, job_name, found["jobId"], attempt, True),
                        **({"submitted_at": found["submitted_at"]} if "submitted_at" in found else {})}
            if found is not None and found["status"] == UNSUBMITTED:
                token = self._claim(s3_hook, staged.prefix, job_name, if_match=found["etag"])
            else:
                attempt += 1
                job_name = remote.attempt_name(spec.name, attempt, 128)
                staged = remote.plan(spec, job_name, settings.staging_uri)
                token = self._claim(s3_hook, staged.prefix, job_name)
            if token:
                break
            # Another try claimed this attempt a moment ago: look again, and reattach to its job.
        definition = job_definition(spec, settings, res["image"], res["instance_count"])
        # Checked before anything is registered or uploaded.
        validate_request("batch", "RegisterJobDefinition", definition)
        request = submit_request(spec, settings, staged, job_name, "placeholder", fair_share)
        request["tags"] = {**request["tags"], TOKEN_TAG: token}
        validate_request("batch", "SubmitJob", request)
        remote.upload(staged, s3_hook, log)
        request["jobDefinition"] = self._definition(hook, definition)
        s3.write_json(s3_hook, s3.join(staged.prefix, "request.json"), request)
        record, _ = _read_intent(s3_hook, staged.prefix)
        if (record or {}).get("token") != token:   # taken over while this worker stalled
            raise JobSpecError(f"Batch attempt {job_name} was claimed by another try while this one "
                               "was preparing it; retry the task to reattach to that try's job.")
        job_id = hook.client.submit_job(**request)["jobId"]
        submitted_at = time.time()
        s3.write_json(s3_hook, _intent_uri(staged.prefix), {**record, "job_id": job_id,
                                                             "submitted_at": submitted_at})
        log.info("Submitted Batch job %s (%s) to queue %s, %d node(s)%s", job_name, job_id,
                 settings.job_queue, res["instance_count"],
                 f", share {request['shareIdentifier']}" if "shareIdentifier" in request else "")
        try:
            self._settle(hook, settings.job_queue, job_name, token, job_id)
        except Exception as exc:  # noqa: BLE001 - the job runs and is recorded; status() looks again
            log.warning("Could not look for copies of Batch job %s yet: %s", job_id, exc)
        return self._handle(spec, settings, staged, job_name, job_id, attempt, False,
                            token=token, submitted_at=submitted_at)

    def _queue(self, hook: Any, queue: str) -> dict[str, Any]:
        """The queue as DescribeJobQueues tells it (its schedulingPolicyArn is "" for FIFO)."""
        found = hook.client.describe_job_queues(jobQueues=[queue]).get("jobQueues", [])
        if not found:
            raise JobSpecError(f"AWS Batch has no job queue {queue!r} in this region: check job_queue "
                               f"in the batch settings (and the connection's region).")
        return found[0]

    def _refuse_spot(self, hook: Any, queue: dict[str, Any], nodes: int) -> None:
        """Multi-node parallel jobs cannot run on Spot compute environments (AWS Batch documents
        it), and every job here is one (type multinode, even on 1 node): on such a queue it would
        sit RUNNABLE. Refused before anything is claimed."""
        order = sorted(queue.get("computeEnvironmentOrder") or [], key=lambda e: e.get("order", 0))
        arns = [e["computeEnvironment"] for e in order if e.get("computeEnvironment")]
        if not arns:
            return
        described = hook.client.describe_compute_environments(computeEnvironments=arns)
        for env in described.get("computeEnvironments", []):
            kind = (env.get("computeResources") or {}).get("type", "")
            if kind in ("SPOT", "FARGATE_SPOT"):
                raise JobSpecError(
                    f"Batch job queue {queue.get('jobQueueName')!r} draws on compute environment "
                    f"{env.get('computeEnvironmentName')!r} of type {kind}, and multi-node parallel "
                    f"jobs (this backend submits every job as one; {nodes} node(s) here) cannot run "
                    "on Spot: AWS Batch would leave the job RUNNABLE. Point job_queue (per stage in "
                    "the batch settings) at a queue whose compute environments are all EC2 "
                    "on-demand, or run the stage on SageMaker with spot.")

    def _tagged(self, hook: Any, queue: str, name: str, token: str) -> list[dict[str, Any]]:
        """Every job named `name` in the queue tagged with `token`, oldest first."""
        ids, kwargs = [], {"jobQueue": queue, "filters": [{"name": "JOB_NAME", "values": [name]}]}
        while True:
            page = hook.client.list_jobs(**kwargs)
            ids += [j["jobId"] for j in page.get("jobSummaryList", []) if j["jobName"] == name]
            if not page.get("nextToken"):
                break
            kwargs["nextToken"] = page["nextToken"]
        mine = []
        for i in range(0, len(ids), DESCRIBE_BATCH):
            mine += [j for j in hook.client.describe_jobs(jobs=ids[i:i + DESCRIBE_BATCH]).get("jobs", [])
                     if (j.get("tags") or {}).get(TOKEN_TAG) == token]
        return sorted(mine, key=lambda j: j.get("createdAt", 0))

    def _terminate_copies(self, hook: Any, jobs: list[dict[str, Any]], keep: str) -> list[str]:
        """Terminate every job of `jobs` but `keep` that has not finished; their ids."""
        copies = [j for j in jobs if j["jobId"] != keep and j.get("status") not in FINISHED]
        for copy in copies:
            log.warning("Terminating Batch job %s (%s): a copy of %s from one submission (a SubmitJob "
                        "resent after its response was lost)", copy.get("jobName"), copy["jobId"], keep)
            hook.client.terminate_job(jobId=copy["jobId"], reason=f"{STOP_REASON}: duplicate submission")
        return [c["jobId"] for c in copies]

    def _settle(self, hook: Any, queue: str, name: str, token: str, job_id: str) -> None:
        """After a submit: list the attempt's jobs until `job_id` shows (at most SETTLE_SECONDS),
        terminating any other job with the token (a copy botocore's resend made)."""
        deadline = time.monotonic() + SETTLE_SECONDS
        while True:
            jobs = self._tagged(hook, queue, name, token)
            self._terminate_copies(hook, jobs, keep=job_id)
            if any(j["jobId"] == job_id for j in jobs) or time.monotonic() >= deadline:
                return
            time.sleep(LIST_INTERVAL_SECONDS)

    def _claim(self, s3_hook: Any, prefix: str, job_name: str, if_match: str = "") -> str:
        """Write this try's intent record for the attempt, only if there is none (or, taking over
        a claim that never led to a job, only if it is still the one read). The token, or "" when
        another try's write came first."""
        from botocore.exceptions import ClientError

        token = uuid.uuid4().hex
        bucket, key = s3.split_s3(_intent_uri(prefix))
        condition = {"IfMatch": if_match} if if_match else {"IfNoneMatch": "*"}
        body = json.dumps({"job_name": job_name, "token": token, "claimed_at": time.time()})
        try:
            s3_hook.get_conn().put_object(Bucket=bucket, Key=key, Body=body.encode(),
                                          ContentType="application/json", **condition,
                                          **s3.sse_args(s3_hook))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict") \
                    or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412):
                # botocore resends a write whose response was lost; the resend finds the record
                # this try's first send wrote.
                record, _ = _read_intent(s3_hook, prefix)
                return token if (record or {}).get("token") == token else ""
            raise
        return token

    def _attempt(self, hook: Any, s3_hook: Any, settings: BatchSettings, spec: JobSpec,
                 job_name: str) -> dict[str, Any] | None:
        """The job of one attempt ({"jobId", "status"}), {"status": UNSUBMITTED, "etag"} for a
        claim that led to no job, or None when the attempt was never claimed nor submitted."""
        prefix = remote.plan(spec, job_name, settings.staging_uri).prefix
        record, etag = _read_intent(s3_hook, prefix)
        if record is None:
            return self._find(hook, settings.job_queue, job_name)
        if record.get("job_id"):
            job = self._describe(hook, record["job_id"])
            if job is None and remote.not_visible_yet(record, "") is not None:
                # Submitted a moment ago and not shown yet: it is this attempt's live job, not a
                # failed one (a new attempt would run beside it).
                return {"jobId": record["job_id"], "status": "SUBMITTED", "submitted_at": record["submitted_at"]}
            # Batch forgets finished jobs after about a week: treat it as done with, not running.
            return job or {"jobId": record["job_id"], "status": "FAILED"}
        deadline = float(record.get("claimed_at", 0)) + SUBMIT_WINDOW_SECONDS
        while True:
            job = self._by_token(hook, settings.job_queue, job_name, record["token"])
            if job is not None:
                s3.write_json(s3_hook, _intent_uri(prefix), {**record, "job_id": job["jobId"]})
                return job
            if time.time() >= deadline:
                return {"status": UNSUBMITTED, "etag": etag}
            time.sleep(min(LIST_INTERVAL_SECONDS, max(0.0, deadline - time.time())))

    def _by_token(self, hook: Any, queue: str, name: str, token: str) -> dict[str, Any] | None:
        """The first job named `name` in the queue tagged with `token`; any later copies (a
        resent SubmitJob) are terminated."""
        mine = self._tagged(hook, queue, name, token)
        if not mine:
            return None
        self._terminate_copies(hook, mine, keep=mine[0]["jobId"])
        return mine[0]

    def _handle(self, spec, settings, staged, job_name, job_id, attempt, reattached, token="",
                submitted_at=0.0) -> dict[str, Any]:
        handle = {"backend": self.name, "name": spec.name, "job_name": job_name, "job_id": job_id,
                  "attempt": attempt, "aws_conn_id": settings.aws_conn_id,
                  "region_name": settings.region_name, "result_uri": staged.result_uri,
                  "checkpoint_uri": staged.checkpoint_uri, "staging_prefix": staged.prefix,
                  "copy_back": staged.copy_back,
                  "output_uri": staged.output_uri, "reattached": reattached,
                  "kms_key_id": settings.kms_key_id,
                  **remote.resource_fields(spec, settings), **remote.watch_fields(settings)}
        if token:   # status() looks for copies of this submission until the window has passed
            handle.update(job_queue=settings.job_queue, submit_token=token, submitted_at=submitted_at,
                          settle_until=submitted_at + SUBMIT_WINDOW_SECONDS)
        return handle

    def fingerprint(self, spec: JobSpec) -> str:
        """A short hash of the stage's resolved batch settings block; no network I/O."""
        return remote.settings_fingerprint(load("batch", BatchSettings, self._settings).for_job(spec))

    def _describe(self, hook: Any, job_id: str) -> dict[str, Any] | None:
        """The job's description, or None. Throttling is retried by the client; a job that is not
        visible yet (DescribeJobs is eventually consistent after SubmitJob) is asked for again with
        the provider's own backoff (BatchClientHook.exponential_delay, with jitter)."""
        for tries in range(NOT_FOUND_RETRIES):
            if tries:
                hook.delay(hook.exponential_delay(tries))
            jobs = [j for j in hook.client.describe_jobs(jobs=[job_id]).get("jobs", [])
                    if j.get("jobId", job_id) == job_id]
            if jobs:
                return jobs[0]
        return None

    def status(self, handle: dict[str, Any]) -> JobStatus:
        hook = self._hook(handle["aws_conn_id"], handle.get("region_name", ""))
        if handle.get("submit_token") and time.time() < float(handle.get("settle_until") or 0):
            try:   # a copy of a resent SubmitJob that ListJobs showed only now
                self._terminate_copies(hook, self._tagged(hook, handle["job_queue"], handle["job_name"],
                                                          handle["submit_token"]), keep=handle["job_id"])
            except Exception as exc:  # noqa: BLE001 - the job's own status matters more
                log.warning("Could not look for copies of Batch job %s: %s", handle["job_id"], exc)
        job = None
        if self.shared_max_age:   # not listed yet (a new job): asked on its own, with its retries
            job = self._board(handle).get(handle["job_id"], self.shared_max_age)
        job = job or self._describe(hook, handle["job_id"])
        if job is None:
            return remote.not_visible_yet(handle, f"Batch job {handle['job_id']}") or JobStatus(
                JobState.FAILED, f"AWS Batch has no job {handle['job_id']}")
        state, reason = job["status"], job.get("statusReason", "")
        details = {"status": state, "job_id": handle["job_id"], "reason": reason}
        if job.get("createdAt"):
            details["submitted_at"] = remote.epoch(job["createdAt"])
        # The current attempt's start: attemptDurationSeconds counts from it.
        starts = [remote.epoch(t) for t in [job.get("startedAt"),
                                            *(a.get("startedAt") for a in job.get("attempts") or [])]]
        starts = [t for t in starts if t]
        if starts and state not in PENDING:
            details["started_at"] = max(starts)
        if job.get("stoppedAt") and state in ("SUCCEEDED", "FAILED"):
            details["ended_at"] = remote.epoch(job["stoppedAt"])
        if state in PENDING:
            return JobStatus(JobState.PENDING, f"{state} {reason}".strip(), details=details)
        if state == "RUNNING":
            return JobStatus(JobState.RUNNING, state, details=details)
        if state == "SUCCEEDED":
            s3_hook = s3.s3_hook(handle["aws_conn_id"], handle.get("region_name", ""))
            result, why = remote.fetch_result(handle, s3_hook, log)
            if result is None:
                return JobStatus(JobState.FAILED, why, details=details)
            return JobStatus(JobState.SUCCEEDED, result=result, details=details)
        if reason.startswith(STOP_REASON):
            return JobStatus(JobState.STOPPED, f"Batch job {handle['job_name']} was stopped", details=details)
        # a multi-node job has no container of its own: its main node's is the last attempt's
        exit_code = (job.get("container") or {}).get("exitCode")
        if exit_code is None and job.get("attempts"):
            exit_code = (job["attempts"][-1].get("container") or {}).get("exitCode")
        result = None
        if exit_code is not None:
            details["exit_code"] = exit_code
            if exit_code == remote.PAUSED_EXIT:
                result = remote.paused_result(handle, s3.s3_hook(handle["aws_conn_id"],
                                                                 handle.get("region_name", "")))
        return JobStatus(JobState.FAILED, f"Batch job {handle['job_name']} failed: {reason or state}"
                         + (f" (exit code {exit_code})" if exit_code is not None else ""),
                         result=result, details=details)

    def log_budget(self, handle: dict[str, Any]) -> shared.RateBudget:
        """CloudWatch Logs' reads of the process (its account-wide rates: shared.RateBudget)."""
        return shared.cloudwatch_budget(handle["aws_conn_id"], handle.get("region_name", ""))

    def stop(self, handle: dict[str, Any]) -> None:
        hook = self._hook(handle["aws_conn_id"], handle.get("region_name", ""))
        # TerminateJob also cancels jobs that have not started; it is a no-op on finished ones.
        hook.client.terminate_job(jobId=handle["job_id"], reason=STOP_REASON)
        log.info("Terminating Batch job %s (%s)", handle["job_name"], handle["job_id"])
        if handle.get("submit_token") and time.time() < float(handle.get("settle_until") or 0):
            self._terminate_copies(hook, self._tagged(hook, handle["job_queue"], handle["job_name"],
                                                      handle["submit_token"]), keep=handle["job_id"])

    def _log_streams(self, handle: dict[str, Any], main_only: bool = False) -> tuple[Any, str, list[str]]:
        """(CloudWatch Logs client, group, streams) of the job's current attempt: one stream per
        node of a multi-node job, read from its node jobs in batches of DESCRIBE_BATCH; with
        `main_only`, the main node's alone (one DescribeJobs)."""
        hook = self._hook(handle["aws_conn_id"], handle.get("region_name", ""))
        job = self._describe(hook, handle["job_id"])
        if job is None:
            return None, "", []
        nodes = job.get("nodeProperties") or {}
        if nodes:
            ranges = nodes.get("nodeRangeProperties") or [{}]
            config = (ranges[0].get("container") or {}).get("logConfiguration") or {}
            ids = [f"{handle['job_id']}#{i}" for i in range(int(nodes.get("numNodes", 0)))]
            if main_only:
                ids = [f"{handle['job_id']}#{int(nodes.get('mainNode', 0))}"]
            containers = []
            for start in range(0, len(ids), DESCRIBE_BATCH):
                found = hook.client.describe_jobs(jobs=ids[start:start + DESCRIBE_BATCH]).get("jobs", [])
                containers += [j.get("container") or {} for j in sorted(found, key=lambda j: j["jobId"])]
        else:
            containers = [job.get("container") or {}]
            config = containers[0].get("logConfiguration") or {}
        if config.get("logDriver", "awslogs") != "awslogs":
            return None, "", []   # logs go elsewhere (splunk, fluentd, ...): nothing to show here
        options = config.get("options") or {}
        streams = list(dict.fromkeys(c["logStreamName"] for c in containers if c.get("logStreamName")))
        if not streams:
            return None, "", []   # no container has started yet
        from llmops.jobs.backends.batch.batch_hook import logs_client

        logs = logs_client(handle["aws_conn_id"], options.get("awslogs-region") or handle.get("region_name"))
        return logs, options.get("awslogs-group", "/aws/batch/job"), streams

    def read_logs(self, handle: dict[str, Any], cursor: Any = None) -> tuple[list[str], Any]:
        """The main node's new lines, and the end of any node that failed while the others run.

        Rank 0 logs the steps on the main node: reading every node's stream on every poll cost a
        64-node job 64 GetLogEvents calls each time, against CloudWatch's account-wide limits.
        A node that failed on its own is what the user needs to see, so its last
        FAILED_NODE_LINES lines are read once, when its node job says so, and its stream is
        followed from there (lines CloudWatch delivers late). Node jobs are described directly
        by id (`<id>#<node>`, at most DESCRIBE_BATCH a call: one DescribeJobs up to 100 nodes),
        not through their parent, whose describe status() makes anyway. A failure's message
        reads the end of every node's stream (log_tail)."""
        # A cursor is {stream: forward token}; keys with a leading "_" came from older releases.
        tokens = {k: v for k, v in cursor.items() if not k.startswith("_")} if isinstance(cursor, dict) else {}
        count = int(handle.get("instance_count") or 0)
        if not count:   # a handle from before it carried its node count: ask the parent
            logs, group, streams = self._log_streams(handle, main_only=True)
            return follow(logs, group, streams, tokens) if streams else ([], tokens)
        hook = self._hook(handle["aws_conn_id"], handle.get("region_name", ""))
        nodes = {}
        for job in self._described(handle, hook, [f"{handle['job_id']}#{i}" for i in range(count)]):
            index = (job.get("nodeDetails") or {}).get("nodeIndex")
            if index is not None:
                nodes[int(index)] = job
        main = (nodes.get(MAIN_NODE) or {}).get("container") or {}
        config = main.get("logConfiguration") or {}
        if not main.get("logStreamName") or config.get("logDriver", "awslogs") != "awslogs":
            return [], tokens   # not started yet, or its logs go elsewhere (splunk, fluentd, ...)
        from llmops.jobs.backends.batch.batch_hook import logs_client

        options = config.get("options") or {}
        logs = logs_client(handle["aws_conn_id"], options.get("awslogs-region") or handle.get("region_name"))
        group = options.get("awslogs-group", "/aws/batch/job")
        failed = [((job.get("container") or {}).get("logStreamName"), index)
                  for index, job in sorted(nodes.items()) if index != MAIN_NODE and _node_failed(job)]
        failed = [(stream, index) for stream, index in failed if stream]
        lines = []
        for stream, index in failed:
            if stream not in tokens:
                lines += [f"[node {index} failed] {line}"
                          for line in tail(logs, group, [stream], FAILED_NODE_LINES, cursor=tokens)]
        more, tokens = follow(logs, group, [main["logStreamName"], *(s for s, _ in failed)], tokens)
        return lines + more, tokens

    def log_tail(self, handle: dict[str, Any], lines: int = 40) -> list[str]:
        """The job's last `lines` log lines, reading only the end of each node's stream."""
        logs, group, streams = self._log_streams(handle)
        return tail(logs, group, streams, lines) if streams else []


def _node_failed(job: dict[str, Any]) -> bool:
    """Whether a node job has failed (its container exited non-zero), whatever the parent says."""
    code = (job.get("container") or {}).get("exitCode")
    return job.get("status") == "FAILED" or (code is not None and code != 0)


def _intent_uri(prefix: str) -> str:
    return s3.join(prefix, INTENT)


def _read_intent(s3_hook: Any, prefix: str) -> tuple[dict[str, Any] | None, str]:
    """The attempt's intent record and its ETag, or (None, "")."""
    from botocore.exceptions import ClientError

    bucket, key = s3.split_s3(_intent_uri(prefix))
    try:
        got = s3_hook.get_conn().get_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None, ""
        raise
    return json.loads(got["Body"].read()), got["ETag"]
