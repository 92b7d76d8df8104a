"""Where local state lives. Everything is overridable by environment, nothing is read at import."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# plugins/llmops/core/settings.py -> the repository root, which holds tasks/ for local jobs.
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


# -- where a run may write and read ---------------------------------------------------------
#
# A run's `storage_root` and its `data_inputs` / `sft_inputs` come from whoever triggers it, and
# the worker writes and reads them with its own permissions. `start_run` refuses any that is not
# under one of these roots (plugins/llmops/stages/lifecycle.py, `check_storage_root`,
# `check_data_path`).
#
#   storage roots  `$LLMOPS_ALLOWED_STORAGE_ROOTS`, else the Airflow Variable
#                  `llmops_allowed_storage_roots` (a JSON list, or comma/space separated), else:
#                  $LLMOPS_HOME, the default storage root ($LLMOPS_STORAGE_ROOT or
#                  $LLMOPS_HOME/storage), the system temp dir (scratch every worker can write
#                  anyway), and the bucket of every `staging_uri` in the `llmops_backends` Variable
#                  (s3://my-bucket/ for s3://my-bucket/llmops).
#   data roots     `$LLMOPS_ALLOWED_DATA_ROOTS`, else the Variable `llmops_allowed_data_roots`,
#                  else: the repository's data/ dir, and every storage root above.
#
# A root given explicitly replaces the defaults (list the default ones too if you want them).
# Entries are absolute local directories or s3://bucket[/prefix]; a local path is compared after
# resolving symlinks, an s3 one by bucket and key prefix.

ALLOWED_STORAGE_ROOTS_ENV = "LLMOPS_ALLOWED_STORAGE_ROOTS"
ALLOWED_STORAGE_ROOTS_VARIABLE = "llmops_allowed_storage_roots"
ALLOWED_DATA_ROOTS_ENV = "LLMOPS_ALLOWED_DATA_ROOTS"
ALLOWED_DATA_ROOTS_VARIABLE = "llmops_allowed_data_roots"
# The remote backends' deployment settings (plugins/llmops/jobs/backends/backend_settings.py).
BACKENDS_VARIABLE = "llmops_backends"
# The Airflow connection `start_run` checks S3 buckets through when no remote stage names one.
AWS_CONN_ENV = "LLMOPS_AWS_CONN_ID"


def variable_text(name: str) -> Any:
    """The Airflow Variable `name` (outside a task: $AIRFLOW_VAR_<NAME>); None when unset."""
    try:
        from airflow.sdk import Variable

        return Variable.get(name, default=None)
    except Exception:  # outside a task (a script, a test): the environment only
        return os.environ.get(f"AIRFLOW_VAR_{name.upper()}")


def variable_json(name: str, error: type[Exception] = ValueError) -> Any:
    """The Airflow Variable `name` parsed as JSON; None when unset or blank. Text that is not
    JSON raises `error` (the caller's own error class), naming the Variable."""
    text = variable_text(name)
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    try:
        return json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as exc:
        raise error(f"The Airflow Variable '{name}' is not valid JSON: {exc}.") from None


def _listed(env: str, variable: str) -> list[str] | None:
    """A list setting from the environment, else the Airflow Variable; None when neither is set."""
    text = os.environ.get(env)
    if text is None:
        text = variable_text(variable)
    if text is None or not str(text).strip():
        return None
    text = str(text).strip()
    if text.startswith("["):
        return [str(v) for v in json.loads(text) if str(v).strip()]
    return [v for v in text.replace(",", " ").split() if v]


def _staging_buckets() -> list[str]:
    """s3://<bucket>/ of every staging_uri in the llmops_backends Variable (unreadable: none)."""
    try:
        blocks = variable_json(BACKENDS_VARIABLE)
    except ValueError:
        return []
    if not isinstance(blocks, dict):
        return []
    buckets = []
    for block in blocks.values():
        if not isinstance(block, dict):
            continue
        uris = [block.get("staging_uri")] + [
            (s or {}).get("staging_uri") for s in (block.get("stages") or {}).values()
            if isinstance(s, dict)]
        for uri in uris:
            if isinstance(uri, str) and uri.startswith("s3://") and uri[5:].split("/")[0]:
                buckets.append(f"s3://{uri[5:].split('/')[0]}/")
    return sorted(set(buckets))


def allowed_storage_roots() -> list[str]:
    """Where a run's `storage_root` may point (see the table above)."""
    import tempfile

    listed = _listed(ALLOWED_STORAGE_ROOTS_ENV, ALLOWED_STORAGE_ROOTS_VARIABLE)
    if listed is not None:
        return listed
    roots = [str(home()), storage_root(), tempfile.gettempdir(), *_staging_buckets()]
    return list(dict.fromkeys(roots))


def allowed_data_roots() -> list[str]:
    """Where a run's `data_inputs` and `sft_inputs` may be read from (see the table above)."""
    listed = _listed(ALLOWED_DATA_ROOTS_ENV, ALLOWED_DATA_ROOTS_VARIABLE)
    if listed is not None:
        return listed
    return list(dict.fromkeys([str(PROJECT_ROOT / "data"), *allowed_storage_roots()]))


def aws_conn_id() -> str:
    """The AWS connection for up-front S3 checks when no remote stage names one."""
    return os.environ.get(AWS_CONN_ENV) or "aws_default"
