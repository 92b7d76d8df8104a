"""Which code produced a run: the git commit, recorded on every MLflow run."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess

from llmops.core import settings


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


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """The code a job runs, for the step cache and replays: the commit, and in a git checkout
    with changes (uncommitted edits, new files not ignored) also a hash of them
    (`<commit>-dirty-<hash>`), so two edits of one commit are two versions. "unknown" when
    neither the environment, a shipped COMMIT nor git says."""
    commit = source_commit()
    if os.environ.get("LLMOPS_GIT_COMMIT") or (settings.PROJECT_ROOT / "COMMIT").exists():
        return commit

    def git(*args: str) -> bytes:
        return subprocess.run(["git", *args], cwd=settings.PROJECT_ROOT, capture_output=True,
                              timeout=10, check=True).stdout
    try:
        changes = hashlib.sha256(git("diff", "HEAD", "--no-color", "--no-ext-diff", "--binary"))
        for name in sorted(git("ls-files", "--others", "--exclude-standard", "-z").split(b"\0")):
            path = settings.PROJECT_ROOT / name.decode()
            if name and path.is_file():
                changes.update(name + b"\0" + path.read_bytes())
    except (OSError, subprocess.SubprocessError):
        return commit
    base = commit.removesuffix("-dirty")
    clean = hashlib.sha256().hexdigest()
    return base if changes.hexdigest() == clean else f"{base}-dirty-{changes.hexdigest()[:12]}"
