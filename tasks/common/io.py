"""Atomic file writes and content hashes: a reader never sees a half-written file."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
import shutil
from typing import Any, Callable


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside `path` durable (a crash after rename must not undo it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None], mode: str = "wb") -> Path:
    """Call `write(fileobj)` on a temporary file beside `path`, fsync it, then rename into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_json(path: str | os.PathLike, data: Any) -> Path:
    text = json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"
    return atomic_write(path, lambda fh: fh.write(text), mode="w")


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as fh:
        return json.load(fh)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def publish_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Make a fully written directory `tmp` appear as `final` in one rename, replacing an older
    `final` (a retry that reached the same point again). Readers see the old or the new
    directory, never a mix; on any error `tmp` is removed and `final` is left as it was."""
    tmp, final = Path(tmp), Path(final)
    try:
        fsync_dir(tmp)
        if final.exists():
            trash = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, trash)
            shutil.rmtree(trash)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
