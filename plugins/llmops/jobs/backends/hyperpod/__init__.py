"""SageMaker HyperPod on EKS: the Kubernetes client (hyperpod_hook.py), the job resource as pure
functions (hyperpod_manifest.py, validated against crds/), the backend (hyperpod_backend.py) and
its settings block (hyperpod_settings.py). Below, its entry (ENTRY, registered in
llmops.jobs.backends.BACKENDS): what it requires, its console links."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from llmops.jobs.backends.base import BackendEntry
from llmops.jobs.backends.consoles import aws_console, cloudwatch_logs_url, handle_region


def console_links(handle: dict[str, Any], region: str) -> dict[str, str]:
    """The EKS cluster's workloads and Container Insights' log streams (the CloudWatch
    observability add-on), which start with the pod's name. A cluster reached through a
    Kubernetes connection names no EKS cluster: no console to link to."""
    cluster = handle.get("eks_cluster_name")
    if not (region and cluster):
        return {}
    eks = f"{aws_console(region)}/eks/home?region={region}#/clusters/{quote(cluster)}"
    return {"HyperPod (EKS) workload": f"{eks}?selectedTab=cluster-resources-tab",
            "CloudWatch logs": cloudwatch_logs_url(
                region, f"/aws/containerinsights/{cluster}/application",
                handle.get("k8s_name") or handle.get("job_name", ""))}


ENTRY = BackendEntry(
    backend="llmops.jobs.backends.hyperpod.hyperpod_backend.HyperPodBackend",
    settings="llmops.jobs.backends.hyperpod.hyperpod_settings.HyperPodSettings",
    required=("staging_uri", "image"), one_of=("eks_cluster_name", "kubernetes_conn_id"),
    host=handle_region, links=console_links, buttons=("HyperPod (EKS) workload", "CloudWatch logs"))
