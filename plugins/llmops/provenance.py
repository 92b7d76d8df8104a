"""Which code produced a run: the git commit, recorded on every MLflow run."""

from __future__ import annotations

import functools
import os
import subprocess

from llmops import settings


@functools.lru_cache(maxsize=1)
def source_commit() -> str:
    """`$LLMOPS_GIT_COMMIT`, else a COMMIT file shipped in a bundle, else `git rev-parse HEAD`."""
    if commit := os.environ.get("LLMOPS_GIT_COMMIT"):
        return commit
    shipped = settings.PROJECT_ROOT / "COMMIT"
    if shipped.exists():
        return shipped.read_text().strip()
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=settings.PROJECT_ROOT,
                             capture_output=True, text=True, timeout=5)
        commit = out.stdout.strip()
        if out.returncode == 0 and commit:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                   cwd=settings.PROJECT_ROOT, capture_output=True, text=True,
                                   timeout=5).stdout.strip()
            return f"{commit}-dirty" if dirty else commit
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"
