"""Atomic, verifiable checkpoints: <root>/step_{step:06d}/ with a manifest written last.

A checkpoint is written into a hidden temporary directory, every file is fsynced, a manifest with
each file's sha256 and size is written last, and only then is the directory renamed into place.
A reader therefore never sees a half-written step_* directory; one that is damaged afterwards
(a truncated copy from S3, a bad disk) fails its checksum and `latest_valid_checkpoint` falls
back to the one before. Everything loads with torch.load(weights_only=True): no pickled code.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from tasks.common.io import atomic_write, fsync_dir, read_json, sha256_file, write_json

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def _save_tensor_file(obj: Any, path: Path) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write(path, lambda fh: fh.write(buffer.getbuffer()))


def step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """Finished-looking checkpoint directories, newest first (temporary ones are skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def verify_checkpoint(path: str | Path) -> str | None:
    """None when every file the manifest lists is present with its size and sha256, else why not."""
    path = Path(path)
    try:
        manifest = read_json(path / MANIFEST)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest ({exc.__class__.__name__}: {exc})"
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != info["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, manifest says {info['bytes']}"
        if sha256_file(f) != info["sha256"]:
            return f"{name} fails its sha256"
    return None


def latest_valid_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint under root that verifies; partial or corrupt ones are skipped."""
    for step, path in step_dirs(root):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def save_checkpoint(root: str | Path, step: int, tensors: dict[str, Any], config: dict[str, Any],
                    keep: int) -> Path:
    """Write tensors[name] to <name>.pt and the resolved config to config.json under
    root/step_{step:06d}, atomically; then delete all but the newest `keep` checkpoints."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    # leftovers of a job killed mid-save are never read; clear them so they do not pile up
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    try:
        for name, obj in tensors.items():
            _save_tensor_file(obj, tmp / f"{name}.pt")
        write_json(tmp / "config.json", config)
        files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
                 for p in sorted(tmp.iterdir())}
        write_json(tmp / MANIFEST, {"format": FORMAT_VERSION, "step": step, "files": files,
                                    "created": time.time()})
        fsync_dir(tmp)
        if final.exists():
            # a retry that reached the same step again: replace the old copy, which may be the
            # damaged one that sent us back
            trash = root / f".tmp-{final.name}-old-{os.getpid()}"
            os.replace(final, trash)
            shutil.rmtree(trash)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _, old in step_dirs(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Every <name>.pt of a checkpoint by name, plus its config; weights_only, so loading runs no
    code from the file."""
    path = Path(path)
    manifest = read_json(path / MANIFEST)
    out: dict[str, Any] = {"step": manifest["step"], "config": read_json(path / "config.json")}
    for name in manifest["files"]:
        if name.endswith(".pt"):
            out[name[:-3]] = torch.load(path / name, map_location=map_location, weights_only=True)
    return out
