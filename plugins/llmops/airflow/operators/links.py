"""Buttons on a job task's page: its MLflow run, and where its job runs and logs (the SageMaker,
Batch, EKS and CloudWatch consoles, the Ray dashboard); on the pretrain task, "Pause pretraining".

How Airflow 3 shows an extra link: the serialized DAG keeps only each link's name and `xcom_key`,
and the API server shows the XCom stored under that key (it never runs `get_link`). The worker
fills those keys twice:

- `push_links` (called by JobOperator as soon as the job's handle is known, on submit or on
  reattach) stores every URL under its link's key at once, so the buttons work while a
  days-long job runs, and the URLs themselves under `LINKS_KEY`;
- when the try ends, Airflow's task runner calls each link's `get_link`, which reads `LINKS_KEY`
  back and stores the same URL again.

A link that does not apply to the task's backend stays empty (a greyed-out button). A new try
starts with its XComs cleared; its submit or reattach pushes the links again.
"""

from __future__ import annotations

import logging
import os
from typing import Any, ClassVar
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink
from airflow.sdk.execution_time.xcom import XCom  # the configured XCom backend

log = logging.getLogger(__name__)

# XCom key of the dict {link name: URL} that push_links writes and every get_link reads.
LINKS_KEY = "llmops_links"


class _JobLink(BaseOperatorLink):
    """One entry of the LINKS_KEY dict; the subclasses only name it."""

    name: ClassVar[str]

    @property
    def xcom_key(self) -> str:
        return f"_link_{self.__class__.__name__}"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        try:
            links = XCom.get_value(ti_key=ti_key, key=LINKS_KEY)
        except Exception:  # noqa: BLE001 - a link must never fail the task or the page
            log.debug("no %s for %s", LINKS_KEY, ti_key, exc_info=True)
            return ""
        return str((links or {}).get(self.name) or "")


class MLflowRunLink(_JobLink):
    name = "MLflow run"


class SageMakerJobLink(_JobLink):
    name = "SageMaker job"


class CloudWatchLogsLink(_JobLink):
    name = "CloudWatch logs"


class BatchJobLink(_JobLink):
    name = "Batch job"


class EksWorkloadLink(_JobLink):
    name = "HyperPod (EKS) workload"


class RayJobLink(_JobLink):
    name = "Ray job"


class PausePretrainingLink(_JobLink):
    """The lifecycle's pretrain task only: its run's pause page (llmops.airflow.pause_api)."""

    name = "Pause pretraining"


JOB_LINKS: tuple[_JobLink, ...] = (MLflowRunLink(), SageMakerJobLink(), CloudWatchLogsLink(),
                                   BatchJobLink(), EksWorkloadLink(), RayJobLink(),
                                   PausePretrainingLink())


# -- the URLs --------------------------------------------------------------------------------------


def aws_console(region: str) -> str:
    """The console's address for the region's partition (China and GovCloud have their own)."""
    if region.startswith("cn-"):
        return "https://console.amazonaws.cn"
    if region.startswith("us-gov-"):
        return "https://console.amazonaws-us-gov.com"
    return "https://console.aws.amazon.com"


def _cloudwatch_escape(text: str) -> str:
    """CloudWatch's console fragment encodes its own URL-encoding once more: '/' -> '$252F'."""
    return quote(text, safe="").replace("%", "$25")


def cloudwatch_logs_url(region: str, group: str, stream_prefix: str = "") -> str:
    url = (f"{aws_console(region)}/cloudwatch/home?region={region}#logsV2:log-groups/log-group/"
           f"{_cloudwatch_escape(group)}")
    if stream_prefix:
        url += "$3FlogStreamNameFilter$3D" + _cloudwatch_escape(stream_prefix)
    return url


def backend_links(handle: dict[str, Any], *, region: str = "",
                  ray_dashboard: str = "") -> dict[str, str]:
    """The console / dashboard links of one job handle (see llmops.jobs.backends)."""
    backend = handle.get("backend", "")
    job_name = handle.get("job_name", "")
    links: dict[str, str] = {}
    if backend in ("sagemaker", "sagemaker_processing") and region and job_name:
        console = f"{aws_console(region)}/sagemaker/home?region={region}#"
        if backend == "sagemaker":
            links[SageMakerJobLink.name] = f"{console}/jobs/{quote(job_name)}"
            group = "/aws/sagemaker/TrainingJobs"
        else:
            links[SageMakerJobLink.name] = f"{console}/processing-jobs/{quote(job_name)}"
            group = "/aws/sagemaker/ProcessingJobs"
        # one stream per instance, named <job>/algo-<n>-<time>
        links[CloudWatchLogsLink.name] = cloudwatch_logs_url(region, group, f"{job_name}/")
    elif backend == "batch" and region and handle.get("job_id"):
        links[BatchJobLink.name] = (f"{aws_console(region)}/batch/home?region={region}"
                                    f"#jobs/detail/{quote(handle['job_id'])}")
        # the stream name (<definition>/default/<task id>) is known only once the job runs
        links[CloudWatchLogsLink.name] = cloudwatch_logs_url(region, "/aws/batch/job")
    elif backend == "hyperpod" and region and handle.get("eks_cluster_name"):
        cluster = handle["eks_cluster_name"]
        links[EksWorkloadLink.name] = (
            f"{aws_console(region)}/eks/home?region={region}#/clusters/{quote(cluster)}"
            "?selectedTab=cluster-resources-tab")
        # Container Insights (the CloudWatch observability add-on): streams start with the pod name
        links[CloudWatchLogsLink.name] = cloudwatch_logs_url(
            region, f"/aws/containerinsights/{cluster}/application",
            handle.get("k8s_name") or job_name)
    elif backend == "ray" and ray_dashboard and job_name:
        links[RayJobLink.name] = f"{ray_dashboard.rstrip('/')}/#/jobs/{quote(job_name)}"
    return links


# -- the worker side -------------------------------------------------------------------------------


def handle_region(handle: dict[str, Any]) -> str:
    """The job's AWS region: the backend settings', else its AWS connection's, else the
    environment's."""
    if handle.get("region_name"):
        return handle["region_name"]
    if "aws_conn_id" in handle:
        try:
            from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

            region = AwsBaseHook(aws_conn_id=handle["aws_conn_id"] or None,
                                 client_type="sts").conn_region_name
            if region:
                return region
        except Exception:  # noqa: BLE001 - no region, no console link
            log.debug("no region from connection %s", handle["aws_conn_id"], exc_info=True)
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or ""


def ray_dashboard_url(ray_conn_id: str) -> str:
    """The dashboard address of a Ray connection (as llmops.jobs.backends.ray.ray_hook reads it)."""
    from airflow.sdk import BaseHook

    conn = BaseHook.get_connection(ray_conn_id)
    host = conn.host or ""
    if not host:
        return ""
    if "://" not in host:
        host = f"{conn.schema or 'http'}://{host}"
    if conn.port and host.count(":") < 2:
        host = f"{host}:{conn.port}"
    return host.rstrip("/")


def links_for(handle: dict[str, Any], mlflow_run: str = "") -> dict[str, str]:
    """Every link of a job task: `mlflow_run` (a URL) and the backend's."""
    ray_dashboard = ""
    if handle.get("backend") == "ray" and handle.get("ray_conn_id"):
        try:
            ray_dashboard = ray_dashboard_url(handle["ray_conn_id"])
        except Exception:  # noqa: BLE001
            log.debug("no dashboard for %s", handle["ray_conn_id"], exc_info=True)
    region = handle_region(handle) if handle.get("backend") != "local" else ""
    links = backend_links(handle, region=region, ray_dashboard=ray_dashboard)
    if mlflow_run:
        links[MLflowRunLink.name] = mlflow_run
    return links


def push_links(ti: Any, links: dict[str, str]) -> None:
    """Store the links where the UI reads them (see the module docstring)."""
    ti.xcom_push(key=LINKS_KEY, value=links)
    for link in JOB_LINKS:
        if links.get(link.name):
            ti.xcom_push(key=link.xcom_key, value=links[link.name])
