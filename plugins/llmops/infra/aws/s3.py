"""S3 transfers for the Airflow side, through the Amazon provider's S3Hook (credentials, region
and endpoint come from the Airflow connection). Used to stage a job's config, to read its result,
and, when a stage's storage is a local directory, to move its inputs up and its outputs back.

SSE-KMS: a bucket policy may refuse every PutObject without `x-amz-server-side-encryption:
aws:kms` (and a given key). A hook made with a KMS key (the backend settings' `kms_key_id`, else
$LLMOPS_S3_KMS_KEY_ID) sends ServerSideEncryption aws:kms and SSEKMSKeyId with every write it
makes (the S3Hook's `extra_args`, which load_string and load_file apply); a write made with the
client itself adds `sse_args(hook)`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

# one parser for every side (tasks/common/uris.py)
from tasks.common.uris import is_s3, split_s3  # noqa: F401

SKIP_DIRS = ("checkpoints",)  # synced by the job itself (SageMaker CheckpointConfig), never copied back
KMS_ENV = "LLMOPS_S3_KMS_KEY_ID"   # the key when no settings block names one; also the jobs' variable


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts if p)])


def kms_key(kms_key_id: str | None = None) -> str:
    """The KMS key S3 writes use: the one given, else $LLMOPS_S3_KMS_KEY_ID, else "" (none)."""
    return kms_key_id or os.environ.get(KMS_ENV, "")


def sse_args(hook_or_key: Any) -> dict[str, str]:
    """PutObject arguments for SSE-KMS with a hook's key (or a key), {} without one."""
    key = hook_or_key if isinstance(hook_or_key, str) else getattr(hook_or_key, "llmops_kms_key_id", "")
    return {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": key} if key else {}


def s3_hook(aws_conn_id: str | None, region_name: str | None = None, kms_key_id: str | None = None):
    """The provider's S3Hook, retrying throttling (SlowDown) and 5xx adaptively, encrypting every
    object it writes with `kms_key(kms_key_id)` when there is one: one per connection, region and
    key in the process (llmops.infra.aws.clients), shared by every poll and trigger."""
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from llmops.infra.aws import clients
    from llmops.infra.aws.retry import with_retries

    key = kms_key(kms_key_id)
    hook = clients.hook(with_retries(S3Hook), aws_conn_id, region_name, extra_args=sse_args(key))
    hook.llmops_kms_key_id = key
    return hook


def write_json(hook: Any, uri: str, data: Any) -> None:
    bucket, key = split_s3(uri)
    hook.load_string(json.dumps(data, indent=2, sort_keys=True, default=str), key=key,
                     bucket_name=bucket, replace=True)


def read_json(hook: Any, uri: str) -> Any | None:
    """The JSON object at `uri`, or None if there is none: one GetObject (not a HeadObject first),
    with the client, which threads may share (the hook's S3 resource must not be)."""
    from botocore.exceptions import ClientError

    bucket, key = split_s3(uri)
    try:
        body = hook.get_conn().get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
            return None
        raise
    return json.loads(body)


def upload_path(hook: Any, local: str | os.PathLike, uri: str) -> int:
    """Upload a file, or a directory tree under the prefix `uri`; returns bytes uploaded."""
    local = Path(local)
    bucket, prefix = split_s3(uri)
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
    total = 0
    for path in files:
        rel = path.name if local.is_file() else path.relative_to(local).as_posix()
        key = f"{prefix.rstrip('/')}/{rel}" if prefix else rel
        hook.load_file(str(path), key=key, bucket_name=bucket, replace=True)
        total += path.stat().st_size
    return total


def download_prefix(hook: Any, uri: str, local: str | os.PathLike,
                    skip_dirs: Iterable[str] = SKIP_DIRS) -> int:
    """Download every object under the prefix `uri` into `local`; returns the number of files."""
    bucket, prefix = split_s3(uri)
    prefix = prefix.rstrip("/") + "/"
    client = hook.get_conn()
    count = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix):]
            if not rel or rel.endswith("/") or rel.split("/", 1)[0] in skip_dirs:
                continue
            target = Path(local, rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.part")
            client.download_file(bucket, obj["Key"], str(tmp))
            os.replace(tmp, target)
            count += 1
    return count


def child_names(hook: Any, uri: str) -> list[str]:
    """The names of the "directories" right under the prefix `uri` (its CommonPrefixes)."""
    bucket, prefix = split_s3(uri)
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    names: list[str] = []
    for page in hook.get_conn().get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix, Delimiter="/"):
        names += [p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", [])]
    return names


def exists(hook: Any, uri: str) -> bool:
    """Whether the object `uri` is there (one ListObjectsV2: no 403 for a missing key without
    s3:ListBucket, as a HeadObject gives)."""
    bucket, key = split_s3(uri)
    listed = hook.get_conn().list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1).get("Contents", [])
    return any(obj["Key"] == key for obj in listed)
