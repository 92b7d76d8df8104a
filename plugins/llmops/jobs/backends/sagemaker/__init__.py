"""SageMaker Training and Processing: the hook (sagemaker_hook.py), the requests as pure
functions (sagemaker_requests.py), the backends (sagemaker_backend.py) and their settings blocks
(sagemaker_settings.py). Below, their entries (TRAINING, PROCESSING, registered in
llmops.jobs.backends.BACKENDS): what each requires, their console links."""

from __future__ import annotations

from typing import Any, Callable
from urllib.parse import quote

from llmops.jobs.backends.base import BackendEntry
from llmops.jobs.backends.consoles import aws_console, cloudwatch_logs_url, handle_region

BUTTONS = ("SageMaker job", "CloudWatch logs")
HERE = "llmops.jobs.backends.sagemaker"


def console_links(page: str, log_group: str) -> Callable[[dict[str, Any], str], dict[str, str]]:
    """The job's page in the SageMaker console (`page`: jobs, processing-jobs) and its log
    streams, one per instance, named <job>/algo-<n>-<time>."""
    def links(handle: dict[str, Any], region: str) -> dict[str, str]:
        job_name = handle.get("job_name", "")
        if not (region and job_name):
            return {}
        console = f"{aws_console(region)}/sagemaker/home?region={region}#"
        return {"SageMaker job": f"{console}/{page}/{quote(job_name)}",
                "CloudWatch logs": cloudwatch_logs_url(region, log_group, f"{job_name}/")}
    return links


TRAINING = BackendEntry(
    backend=f"{HERE}.sagemaker_backend.SageMakerTrainingBackend",
    settings=f"{HERE}.sagemaker_settings.SageMakerSettings",
    required=("role_arn", "staging_uri", "image"),
    host=handle_region, links=console_links("jobs", "/aws/sagemaker/TrainingJobs"), buttons=BUTTONS,
    no_pause=("a SageMaker training job syncs its checkpoints one way (to S3), so it never sees a "
              "marker written there; stop it from the SageMaker console instead"))
PROCESSING = BackendEntry(
    backend=f"{HERE}.sagemaker_backend.SageMakerProcessingBackend",
    settings=f"{HERE}.sagemaker_settings.ProcessingSettings",
    required=("role_arn", "staging_uri", "image", "instance_type"),
    host=handle_region, links=console_links("processing-jobs", "/aws/sagemaker/ProcessingJobs"),
    buttons=BUTTONS)
