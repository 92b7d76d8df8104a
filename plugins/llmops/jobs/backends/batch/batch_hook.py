"""The provider's BatchClientHook with what a watched multi-node job needs, one per process.

Batch's client retries throttling adaptively (llmops.infra.aws.retry); its CloudWatch Logs client is
the process's one for the job's log region (the awslogs driver may name another region than the
job's). `jobs_hook()` gives the process's hook for a connection and region
(llmops.infra.aws.clients): a poll, a trigger and the next trigger reuse its clients and its rate
limiter.
"""

from __future__ import annotations

from typing import Any

from airflow.providers.amazon.aws.hooks.batch_client import BatchClientHook
from airflow.providers.amazon.aws.hooks.logs import AwsLogsHook

from llmops.infra.aws import clients
from llmops.infra.aws.retry import with_retries


class BatchJobsHook(with_retries(BatchClientHook)):
    """BatchClientHook retrying throttling adaptively, one per connection and region."""


def logs_client(aws_conn_id: str | None, region_name: str | None = None) -> Any:
    """The process's CloudWatch Logs client for this connection in `region_name` (a job's
    awslogs-region, else its own)."""
    return clients.hook(with_retries(AwsLogsHook), aws_conn_id, region_name).get_conn()


def jobs_hook(aws_conn_id: str | None, region_name: str | None = None) -> BatchJobsHook:
    """The process's BatchJobsHook for this connection and region."""
    return clients.hook(BatchJobsHook, aws_conn_id, region_name)
