"""Where a run may read and write: the checks of its storage root, data paths and model
references, before any job (the allowed roots themselves: plugins/llmops/core/settings.py).

The lowest layer of the Airflow side: stdlib and llmops.core.settings only, so that the run's checks
(lifecycle), team policy (teams) and model references (model_refs) all share one rule.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

from llmops.core import settings


class LifecycleParamError(ValueError):
    """A run's Params are wrong; the message names the Param and the fix."""


def run_root(storage_root: str, dag_id: str, run_id: str) -> str:
    """Where a DAG run's stage outputs go: <storage_root>/<dag_id>/<run_id, path-safe>."""
    return os.path.join(storage_root, dag_id, re.sub(r"[^A-Za-z0-9_.-]+", "_", run_id))


SHELL_META = re.compile(r"[;|&`$<>\\]|\$\(")
S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def safe_text(name: str, value: Any) -> str:
    """The Param's value as a plain path: non-empty text, no control or shell characters."""
    if not isinstance(value, str) or not value.strip():
        raise LifecycleParamError(f"Param '{name}' must be a non-empty path, got {value!r}.")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise LifecycleParamError(f"Param '{name}' contains a control character (newline, tab, ...): "
                                  f"{value!r}. Give a plain path.")
    if SHELL_META.search(value):
        raise LifecycleParamError(f"Param '{name}' contains a shell metacharacter (one of ; | & ` $ "
                                  f"< > \\): {value!r}. Give a plain path.")
    return value


def under(path: str, roots: list[str]) -> bool:
    """Is `path` (normalised: s3://bucket/key, or a resolved absolute path) inside one of `roots`?"""
    for root in roots:
        if root.startswith("s3://") != path.startswith("s3://"):
            continue
        if root.startswith("s3://"):
            base = root.rstrip("/") + "/"
        else:
            base = os.path.join(os.path.realpath(root), "")
        if path.rstrip("/") + "/" == base or path.startswith(base):
            return True
    return False


def normal_s3(name: str, value: str) -> str:
    """s3://bucket/key with a valid bucket name, empty and '.' components dropped, '..' refused."""
    bucket, _, key = value[len("s3://"):].partition("/")
    if not S3_BUCKET.match(bucket) or ".." in bucket:
        raise LifecycleParamError(f"Param '{name}': {bucket!r} is not an S3 bucket name (3-63 "
                                  f"lowercase letters, digits, . and -), in {value!r}.")
    parts = [p for p in key.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise LifecycleParamError(f"Param '{name}': {value!r} has a '.' or '..' component.")
    return f"s3://{bucket}/" + "/".join(parts)


def check_storage_root(value: Any, *, name: str = "storage_root") -> str:
    """The run's storage root, normalised and inside an allowed root; empty = the default."""
    if value is None or value == "":
        return settings.storage_root()
    value = safe_text(name, value)
    allowed = settings.allowed_storage_roots()
    hint = (f"Use a path under one of {allowed} (set {settings.ALLOWED_STORAGE_ROOTS_ENV} or the "
            f"Airflow Variable {settings.ALLOWED_STORAGE_ROOTS_VARIABLE} to allow others), or leave "
            "it empty for the default.")
    if value.startswith("s3://"):
        root = normal_s3(name, value)
    elif "://" in value:
        raise LifecycleParamError(f"Param '{name}': {value!r} is neither a local path nor s3://. "
                                  + hint)
    else:
        if not os.path.isabs(value):
            raise LifecycleParamError(
                f"Param '{name}': {value!r} is relative, so it would land wherever the worker "
                f"runs (now {os.getcwd()}). Give an absolute path. " + hint)
        if ".." in value.split(os.sep):
            raise LifecycleParamError(f"Param '{name}': {value!r} has a '..' component. " + hint)
        root = os.path.realpath(os.path.normpath(value))
    if not under(root, allowed):
        raise LifecycleParamError(f"Param '{name}': {value!r} is outside the allowed storage roots. "
                                  + hint)
    return root.rstrip("/") if root.startswith("s3://") else root


def check_data_path(name: str, value: Any) -> None:
    """A data input (a file, dir or glob) must be inside an allowed data root, and so must every
    file it matches (a symlink out of the root counts as outside)."""
    value = safe_text(name, value)
    allowed = settings.allowed_data_roots()
    hint = (f"Data is read only from under {allowed} (set {settings.ALLOWED_DATA_ROOTS_ENV} or the "
            f"Airflow Variable {settings.ALLOWED_DATA_ROOTS_VARIABLE} to allow others).")
    if value.startswith("s3://"):
        if not under(normal_s3(name, value), allowed):
            raise LifecycleParamError(f"Param '{name}': {value!r} is outside the allowed data roots. "
                                      + hint)
        return
    if "://" in value:
        raise LifecycleParamError(f"Param '{name}': {value!r} is neither a local path nor s3://. "
                                  + hint)
    if not os.path.isabs(value):
        raise LifecycleParamError(f"Param '{name}': {value!r} is relative, so it would be read from "
                                  f"wherever the worker runs (now {os.getcwd()}). Give an absolute "
                                  "path. " + hint)
    if ".." in value.split(os.sep):
        raise LifecycleParamError(f"Param '{name}': {value!r} has a '..' component. " + hint)
    outside = outside_roots(value, allowed)
    if outside is not None:
        raise LifecycleParamError(f"Param '{name}': {value!r} is outside the allowed data roots"
                                  f"{'' if outside == value else f' ({outside} resolves elsewhere)'}. "
                                  + hint)


def outside_roots(value: str, roots: list[str]) -> str | None:
    """A local file, dir or glob: the first of its fixed base and its matches that resolves outside
    `roots` (the base itself is returned as `value`), or None when all are inside."""
    fixed = re.split(r"[*?\[]", value, maxsplit=1)[0]
    base = fixed if fixed.endswith(os.sep) or fixed == value else os.path.dirname(fixed)
    for match in [base] + glob.glob(value):
        if not under(os.path.realpath(match), roots):
            return value if match == base else match
    return None
