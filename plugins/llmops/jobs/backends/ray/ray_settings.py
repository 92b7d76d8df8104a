"""The `ray` block of the backends' settings (llmops.jobs.backends.backend_settings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmops.jobs.backends.remote_settings import RemoteSettings


@dataclass(kw_only=True)
class RaySettings(RemoteSettings):
    ray_conn_id: str = "ray_default"    # HTTP connection: host = dashboard URL, password = token
    python: str = "python"
    runtime_env: dict = field(default_factory=dict)  # extra Ray runtime_env (working_dir, pip, ...)
    entrypoint_num_cpus: float = 0.0
    entrypoint_num_gpus: float = 0.0
