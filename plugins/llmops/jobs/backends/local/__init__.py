"""The local backend: a job as processes on this machine (local_backend), each under a runner that
outlives the Airflow worker and records how the job ended (local_runner). Below, its entry
(ENTRY, registered in llmops.jobs.backends.BACKENDS)."""

from __future__ import annotations

from llmops.jobs.backends.base import BackendEntry

# No settings block, nothing to require, no console: the job runs on this machine.
ENTRY = BackendEntry(backend="llmops.jobs.backends.local.local_backend.LocalBackend", aws=False)
