"""The provider's SageMakerHook, plus what a retried task and a deferred wait need.

The provider's operators wait at most `max_attempts` x `check_interval` (60 x 30 s) and, on a name
that exists, either fail or append a timestamp: a retried task would start a second training run.
Here a job is looked up by name (None when absent), stopped only while it runs, and its CloudWatch
log is read from a cursor that survives deferral, or only its end (`log_tail`). Every client
(SageMaker, CloudWatch Logs, S3) retries throttling adaptively (llmops.infra.aws.retry); the
provider builds its S3 and Logs hooks without the hook's region, these get it, and the S3 one
encrypts what it writes with `kms_key_id` (llmops.infra.aws.s3). `jobs_hook()` is the process's one
hook per connection, region and key (llmops.infra.aws.clients): a poll reuses its clients.

A job is absent only when SageMaker says so: a ValidationException whose message says the job
was not found. Any other ValidationException (a malformed name, a request SageMaker refuses) is
raised: read as "absent", it would make a retried task start a second job.
"""

from __future__ import annotations

import re
from typing import Any

from airflow.providers.amazon.aws.hooks.logs import AwsLogsHook
from airflow.providers.amazon.aws.hooks.sagemaker import SageMakerHook
from botocore.exceptions import ClientError

from llmops.infra.aws import clients, s3
from llmops.infra.aws.logs import follow, stream_names, tail
from llmops.infra.aws.retry import with_retries

KINDS = {
    # kind: (describe call, name field, status field, stop call, log group)
    "training": ("describe_training_job", "TrainingJobName", "TrainingJobStatus",
                 "stop_training_job", "/aws/sagemaker/TrainingJobs"),
    "processing": ("describe_processing_job", "ProcessingJobName", "ProcessingJobStatus",
                   "stop_processing_job", "/aws/sagemaker/ProcessingJobs"),
}
# kind: (list call, its summaries' key); a summary has the name, status and LastModifiedTime
# fields of the description (and a training job's SecondaryStatus)
LISTS = {"training": ("list_training_jobs", "TrainingJobSummaries"),
         "processing": ("list_processing_jobs", "ProcessingJobSummaries")}
LIST_PAGE = 100   # MaxResults: the most either list call returns a page
RUNNING = {"InProgress"}
# How SageMaker (and moto) word a missing job: "Requested resource not found.",
# "Could not find training job 'arn:...'".
NOT_FOUND = re.compile(r"not found|could not find|does not exist", re.IGNORECASE)


def is_not_found(exc: ClientError) -> bool:
    """Whether SageMaker answered that the job does not exist (and nothing else)."""
    error = exc.response.get("Error", {})
    code, message = error.get("Code", ""), error.get("Message", "")
    return code in ("ResourceNotFound", "ResourceNotFoundException") or (
        code in ("ValidationException", "ValidationError") and bool(NOT_FOUND.search(message)))


class SageMakerJobsHook(with_retries(SageMakerHook)):
    def __init__(self, *args: Any, kms_key_id: str = "", **kwargs: Any):
        super().__init__(*args, **kwargs)
        region = kwargs.get("region_name")
        # The process's S3 and Logs hooks for this connection and region (llmops.infra.aws.clients).
        self.s3_hook = s3.s3_hook(self.aws_conn_id, region, kms_key_id)
        self.logs_hook = clients.hook(with_retries(AwsLogsHook), self.aws_conn_id, region)

    def describe_job(self, kind: str, name: str) -> dict[str, Any] | None:
        """The job's description, or None if no job has this name."""
        describe, field, *_ = KINDS[kind]
        try:
            return getattr(self.get_conn(), describe)(**{field: name})
        except ClientError as exc:
            if is_not_found(exc):
                return None
            raise

    def changed_since(self, kind: str, since: float) -> dict[str, dict[str, Any]]:
        """{name: summary} of every job of `kind` modified after `since` (epoch s), across all
        pages: one call a page, whatever the number of jobs that did not change."""
        from datetime import datetime, timezone

        call, key = LISTS[kind]
        name_field = KINDS[kind][1]
        kwargs: dict[str, Any] = {"LastModifiedTimeAfter": datetime.fromtimestamp(since, timezone.utc),
                                  "MaxResults": LIST_PAGE}
        found: dict[str, dict[str, Any]] = {}
        while True:
            page = getattr(self.get_conn(), call)(**kwargs)
            found.update({s[name_field]: s for s in page.get(key, [])})
            if not page.get("NextToken"):
                return found
            kwargs["NextToken"] = page["NextToken"]

    @staticmethod
    def still_describes(kind: str, summary: dict[str, Any], description: dict[str, Any]) -> bool:
        """Whether a listed job's summary says nothing its description does not already say."""
        fields = [KINDS[kind][2], "LastModifiedTime"] + (["SecondaryStatus"] if kind == "training" else [])
        return all(summary.get(f) == description.get(f) for f in fields)

    def job_tags(self, arn: str) -> dict[str, str]:
        """The tags of a job (DescribeTrainingJob does not return them)."""
        tags: dict[str, str] = {}
        kwargs: dict[str, Any] = {"ResourceArn": arn}
        while True:
            page = self.get_conn().list_tags(**kwargs)
            tags.update({t["Key"]: t["Value"] for t in page.get("Tags", [])})
            if not page.get("NextToken"):
                return tags
            kwargs["NextToken"] = page["NextToken"]

    def status_of(self, kind: str, description: dict[str, Any]) -> str:
        return description[KINDS[kind][2]]

    def stop_job(self, kind: str, name: str) -> bool:
        """Stop the job if it is still running; True if a stop was requested."""
        description = self.describe_job(kind, name)
        if description is None or self.status_of(kind, description) not in RUNNING:
            return False
        _, field, _, stop, _ = KINDS[kind]
        try:
            getattr(self.get_conn(), stop)(**{field: name})
        except ClientError as exc:
            # It ended between the describe and the stop: nothing left to stop.
            if exc.response["Error"]["Code"] != "ValidationException":
                raise
            return False
        return True

    def log_lines(self, kind: str, name: str, cursor: dict[str, str] | None
                  ) -> tuple[list[str], dict[str, str]]:
        """New CloudWatch lines of the first instance's stream (`<job>/algo-1-...`, where rank 0
        logs the steps), and the cursor (its forward token) for the next call. One stream, not
        one per instance: a 64-instance job read 64 streams every poll. A failure's message reads
        the end of every instance's stream (log_tail)."""
        group = KINDS[kind][4]
        logs = self.logs_hook.get_conn()
        prefix = f"{name}/algo-1-"
        # The streams the cursor knows are read without listing them again: DescribeLogStreams
        # has a far lower account-wide rate than GetLogEvents. Only a quiet poll lists them (a
        # stream appears with the container's first line, and a restarted instance logs to a new
        # one, leaving the old one quiet).
        known = sorted(k for k in (cursor or {}) if k.startswith(prefix))
        if known:
            lines, cursor = follow(logs, group, known, cursor)
            if lines:
                return lines, cursor
        fresh = [s for s in stream_names(logs, group, prefix) if s not in known]
        return follow(logs, group, fresh, cursor) if fresh else ([], dict(cursor or {}))

    def log_tail(self, kind: str, name: str, lines: int = 40) -> list[str]:
        """The last `lines` lines over the job's streams, read from their ends."""
        group = KINDS[kind][4]
        logs = self.logs_hook.get_conn()
        return tail(logs, group, stream_names(logs, group, f"{name}/"), lines)


def jobs_hook(aws_conn_id: str | None, region_name: str | None = None, kms_key_id: str = "") -> SageMakerJobsHook:
    """The process's SageMakerJobsHook for this connection, region and KMS key."""
    return clients.hook(SageMakerJobsHook, aws_conn_id, region_name, kms_key_id=kms_key_id)
