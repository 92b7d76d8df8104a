"""A client for the Ray Jobs REST API of a running Ray cluster (the dashboard's /api/jobs/).

The Airflow side has no `ray` installed (MWAA workers run no Ray), so jobs are submitted over
HTTP. The cluster comes from an Airflow connection: host = the dashboard URL
(http://ray-head:8265), password = the cluster's auth token if it has one (sent as a bearer
token, never logged).
"""

from __future__ import annotations

import time
from typing import Any

import requests
from airflow.sdk import BaseHook

RETRIES = 3


class RayJobExists(RuntimeError):
    """A job with this submission id exists already."""


class RayJobsHook(BaseHook):
    conn_name_attr = "ray_conn_id"
    default_conn_name = "ray_default"

    conn_type = "http"
    hook_name = "Ray Jobs API"

    def __init__(self, ray_conn_id: str = default_conn_name, timeout: float = 30.0):
        super().__init__()
        self.ray_conn_id = ray_conn_id
        self.timeout = timeout
        self._base: str | None = None
        self._headers: dict[str, str] = {}

    def _connect(self) -> None:
        if self._base is not None:
            return
        conn = self.get_connection(self.ray_conn_id)
        self._base = address(conn)
        if conn.password:
            self._headers = {"Authorization": f"Bearer {conn.password}"}

    def _call(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """One request, retried with backoff on connection errors and 502-504 only."""
        self._connect()
        for attempt in range(RETRIES):
            try:
                response = requests.request(method, f"{self._base}{path}", headers=self._headers,
                                            timeout=self.timeout, **kwargs)
            except requests.ConnectionError:
                if attempt == RETRIES - 1:
                    raise
            else:
                if response.status_code not in (502, 503, 504) or attempt == RETRIES - 1:
                    return response
            time.sleep(2 ** attempt)
        raise AssertionError("unreachable")

    def submit_job(self, entrypoint: str, submission_id: str, runtime_env: dict[str, Any] | None = None,
                   metadata: dict[str, str] | None = None, entrypoint_num_cpus: float = 0,
                   entrypoint_num_gpus: float = 0) -> str:
        body: dict[str, Any] = {"entrypoint": entrypoint, "submission_id": submission_id,
                                "runtime_env": runtime_env or {}, "metadata": metadata or {}}
        if entrypoint_num_cpus:
            body["entrypoint_num_cpus"] = entrypoint_num_cpus
        if entrypoint_num_gpus:
            body["entrypoint_num_gpus"] = entrypoint_num_gpus
        response = self._call("POST", "/api/jobs/", json=body)
        if response.status_code != 200:
            if "already exists" in response.text:
                raise RayJobExists(submission_id)
            raise RuntimeError(f"Ray refused job {submission_id}: HTTP {response.status_code} "
                               f"{response.text[-500:]}")
        return response.json()["submission_id"]

    def get_job(self, submission_id: str) -> dict[str, Any] | None:
        """The job's details (status, message, ...), or None if the cluster has no such job."""
        response = self._call("GET", f"/api/jobs/{submission_id}")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json()

    def stop_job(self, submission_id: str) -> bool:
        response = self._call("POST", f"/api/jobs/{submission_id}/stop")
        if response.status_code == 404:
            return False
        response.raise_for_status()
        return bool(response.json().get("stopped"))

    def get_logs(self, submission_id: str) -> str:
        response = self._call("GET", f"/api/jobs/{submission_id}/logs")
        if response.status_code == 404:
            return ""
        response.raise_for_status()
        return response.json().get("logs", "")


def address(conn: Any) -> str:
    """A Ray connection's Jobs API (and dashboard) address: host, with the connection's scheme
    (default http) and port when the host names none."""
    host = conn.host or ""
    if "://" not in host:
        host = f"{conn.schema or 'http'}://{host}"
    if conn.port and host.count(":") < 2:
        host = f"{host}:{conn.port}"
    return host.rstrip("/")


def dashboard_url(ray_conn_id: str) -> str:
    """The dashboard of a Ray connection; "" when it names no host."""
    conn = BaseHook.get_connection(ray_conn_id)
    return address(conn) if conn.host else ""
