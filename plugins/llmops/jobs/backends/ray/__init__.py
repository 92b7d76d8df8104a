"""A Ray cluster through the Ray Jobs REST API: the client (ray_hook.py), the backend
(ray_backend.py) and its settings block (ray_settings.py). Below, its entry (ENTRY, registered in
llmops.jobs.backends.BACKENDS): what it requires, its dashboard and the job's link there."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from llmops.jobs.backends.base import BackendEntry


def dashboard(handle: dict[str, Any]) -> str:
    """The dashboard of the job's Ray connection (its Jobs API address), "" without one."""
    if not handle.get("ray_conn_id"):
        return ""
    from llmops.jobs.backends.ray.ray_hook import dashboard_url

    return dashboard_url(handle["ray_conn_id"])


def dashboard_links(handle: dict[str, Any], dashboard: str) -> dict[str, str]:
    job_name = handle.get("job_name", "")
    if not (dashboard and job_name):
        return {}
    return {"Ray job": f"{dashboard.rstrip('/')}/#/jobs/{quote(job_name)}"}


ENTRY = BackendEntry(
    backend="llmops.jobs.backends.ray.ray_backend.RayBackend",
    settings="llmops.jobs.backends.ray.ray_settings.RaySettings",
    required=("staging_uri",), host=dashboard, links=dashboard_links, buttons=("Ray job",))
