"""AWS Batch: the hook (batch_hook.py), the requests as pure functions (batch_requests.py),
the backend (batch_backend.py) and its settings block (batch_settings.py). Below, its entry
(ENTRY, registered in llmops.jobs.backends.BACKENDS): what it requires, its console links."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from llmops.jobs.backends.base import BackendEntry
from llmops.jobs.backends.consoles import aws_console, cloudwatch_logs_url, handle_region


def console_links(handle: dict[str, Any], region: str) -> dict[str, str]:
    """The job in the Batch console, by id, and its log group (the stream name,
    <definition>/default/<task id>, is known only once the job runs)."""
    if not (region and handle.get("job_id")):
        return {}
    return {"Batch job": (f"{aws_console(region)}/batch/home?region={region}"
                          f"#jobs/detail/{quote(handle['job_id'])}"),
            "CloudWatch logs": cloudwatch_logs_url(region, "/aws/batch/job")}


ENTRY = BackendEntry(
    backend="llmops.jobs.backends.batch.batch_backend.BatchBackend",
    settings="llmops.jobs.backends.batch.batch_settings.BatchSettings",
    required=("job_queue", "staging_uri", "image"),
    host=handle_region, links=console_links, buttons=("Batch job", "CloudWatch logs"))
