"""Where local state lives. Everything is overridable by environment, nothing is read at import."""

from __future__ import annotations

import os
from pathlib import Path

# plugins/llmops/settings.py -> the repository root, which holds tasks/ for local jobs.
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def home() -> Path:
    """Local state: job directories, stage outputs, the MLflow store. `$LLMOPS_HOME` wins."""
    return Path(os.environ.get("LLMOPS_HOME") or PROJECT_ROOT / ".llmops")


def tasks_root() -> Path:
    """The directory that holds the `tasks` package, put on PYTHONPATH for local jobs."""
    return Path(os.environ.get("LLMOPS_TASKS_ROOT") or PROJECT_ROOT)


def storage_root() -> str:
    """Where stage outputs go: a local directory, or an s3:// prefix on AWS backends."""
    return os.environ.get("LLMOPS_STORAGE_ROOT") or str(home() / "storage")
