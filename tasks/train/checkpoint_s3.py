"""Checkpoints mirrored to S3: s3://bucket/prefix/step_{step:06d}/<the checkpoint's files>.

The local checkpoint directory is the unit: its files go up first (large ones as multipart
uploads, parts in parallel) and its manifest.json last, so a step prefix without a manifest is an
upload that never finished and is never read. Reading back downloads a step and checks every file
against the manifest's sha256, exactly like a local checkpoint.

Only global rank 0 writes checkpoints (a DDP replica or an FSDP state gathered to it), so there is
one uploader per job, hence at most one per node: the per-prefix request rate S3 allows
(3,500 writes/s) is never the limit, but 503 Slow Down still happens under load on a shared
prefix, so every request is retried with exponential backoff and jitter — here, at the network
boundary, and nowhere else. botocore's own retries are turned off so the two do not multiply.
A request is tried `max_attempts` times and then on for as long as `retry_seconds` since its
first try: S3 can answer SlowDown for minutes while it scales a prefix, and an upload that gave
up after half a minute would fail the training job (the upload runs beside training, which waits
for it only at the next checkpoint).

The endpoint comes from boto3's usual settings (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, a local
moto server in tests), credentials from the usual chain.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Collection

from tasks.common.io import read_json, sha256_file
from tasks.train.retention import prunable
from tasks.common.uris import split_s3

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
BytesMoved = Callable[[int], None]  # n more bytes moved (the watchdog's I/O beat)
_RETRY_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
                "ThrottlingException", "RequestTimeTooSkewed", "500", "502", "503", "504"}


def split_uri(uri: str) -> tuple[str, str]:
    """s3://bucket/prefix/ -> ("bucket", "prefix"): tasks.common.uris's parse, the prefix
    unslashed."""
    bucket, prefix = split_s3(uri)
    return bucket, prefix.strip("/")


def _no_progress(nbytes: int) -> None:
    pass


def _retryable(exc: Exception) -> bool:
    from botocore.exceptions import (ClientError, ConnectionClosedError, ConnectTimeoutError,
                                     EndpointConnectionError, ReadTimeoutError)

    if isinstance(exc, (ConnectionClosedError, ConnectTimeoutError, EndpointConnectionError,
                        ReadTimeoutError)):
        return True
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return error.get("Code") in _RETRY_CODES or status in (500, 502, 503, 504)
    return False


def mirror_for(uri: str) -> "S3Mirror | None":
    """The write-through of a stage's checkpoints to its `checkpoint_uri`; None without one."""
    return S3Mirror(uri) if uri else None


class S3Mirror:
    def __init__(self, uri: str, *, part_size: int = 8 << 20, max_attempts: int = 8,
                 base_delay: float = 0.2, max_delay: float = 20.0, parallel_parts: int = 4,
                 retry_seconds: float = 900.0) -> None:
        if part_size < 5 << 20:
            raise ValueError("S3 multipart parts must be at least 5 MiB (all but the last).")
        self.uri = uri
        self.bucket, self.prefix = split_uri(uri)
        self.part_size, self.max_attempts = part_size, max_attempts
        self.base_delay, self.max_delay, self.parallel_parts = base_delay, max_delay, parallel_parts
        self.retry_seconds = retry_seconds
        self.retries = 0  # requests that were retried, for the log and the tests
        self._client = None
        # SSE-KMS on every object written, when the backend named a key (a bucket policy may
        # refuse a PutObject without it): docker/job_entry.py's variable.
        key = os.environ.get("LLMOPS_S3_KMS_KEY_ID", "")
        self.sse = {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": key} if key else {}

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.client("s3", config=Config(
                retries={"total_max_attempts": 1},
                max_pool_connections=max(10, self.parallel_parts * 2)))
        return self._client

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def call(self, what: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """fn(**kwargs), retried with exponential backoff and equal jitter on throttling and
        transient server or connection errors: `max_attempts` tries, then on until
        `retry_seconds` have passed since the first."""
        give_up_at = time.monotonic() + self.retry_seconds
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn(**kwargs)
            except Exception as exc:  # noqa: BLE001 - classified just below
                if not _retryable(exc) or (attempt >= self.max_attempts and time.monotonic() >= give_up_at):
                    raise
                cap = min(self.max_delay, self.base_delay * 2 ** min(attempt - 1, 30))
                delay = cap / 2 + random.uniform(0, cap / 2)
                self.retries += 1
                log.warning("s3 %s failed (%s); retry %d in %.2fs (giving up after %d tries and %.0fs)",
                            what, getattr(exc, "response", {}).get("Error", {}).get("Code", exc),
                            attempt, delay, self.max_attempts, self.retry_seconds)
                time.sleep(delay)

    # -- write -------------------------------------------------------------------------------
    def upload_checkpoint(self, local: Path, progress: BytesMoved | None = None,
                          skip: Collection[str] = ()) -> str:
        """Upload one local checkpoint directory, manifest last; returns its s3:// prefix.
        progress(n): n more bytes are up (per object or multipart part), for the watchdog.
        skip: files already uploaded (a sharded checkpoint's shards, by their own ranks)."""
        step_name = local.name
        self._clear_unfinished(keep=step_name)
        names = sorted(set(read_json(local / MANIFEST)["files"]) - set(skip))
        for name in names:
            self.upload_file(local / name, self._key(step_name, name), progress)
        self.upload_file(local / MANIFEST, self._key(step_name, MANIFEST), progress)  # the commit
        return f"s3://{self.bucket}/{self._key(step_name)}"

    def upload_files(self, local: Path, step_name: str, names: list[str],
                     progress: BytesMoved | None = None) -> None:
        """Upload some files of a checkpoint not yet committed (no manifest: not a checkpoint
        until upload_checkpoint adds it), e.g. one rank's shards from its node."""
        for name in names:
            self.upload_file(local / name, self._key(step_name, name), progress)

    def upload_file(self, path: Path, key: str, progress: BytesMoved | None = None) -> None:
        progress = progress or _no_progress
        size = path.stat().st_size
        if size <= self.part_size:
            self.call(f"put {key}", self.client.put_object, Bucket=self.bucket, Key=key, **self.sse,
                      Body=path.read_bytes())
            progress(size)
            return
        upload_id = self.call(f"create multipart {key}", self.client.create_multipart_upload,
                              Bucket=self.bucket, Key=key, **self.sse)["UploadId"]

        def part(number: int) -> dict[str, Any]:
            with open(path, "rb") as fh:
                fh.seek((number - 1) * self.part_size)
                body = fh.read(self.part_size)
            etag = self.call(f"upload part {number} of {key}", self.client.upload_part,
                             Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number,
                             Body=body)["ETag"]
            progress(len(body))
            return {"PartNumber": number, "ETag": etag}

        n_parts = -(-size // self.part_size)
        try:
            with ThreadPoolExecutor(self.parallel_parts) as pool:
                parts = list(pool.map(part, range(1, n_parts + 1)))
            self.call(f"complete multipart {key}", self.client.complete_multipart_upload,
                      Bucket=self.bucket, Key=key, UploadId=upload_id,
                      MultipartUpload={"Parts": parts})
        except BaseException:
            # an abandoned multipart upload is billed storage until aborted
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except Exception:  # noqa: BLE001 - the original error matters more
                log.warning("could not abort multipart upload of %s", key)
            raise

    # -- read --------------------------------------------------------------------------------
    def _list(self, prefix: str, delimiter: str = "") -> tuple[list[str], list[str]]:
        keys, prefixes, token = [], [], None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            if delimiter:
                kwargs["Delimiter"] = delimiter
            if token:
                kwargs["ContinuationToken"] = token
            page = self.call(f"list {prefix}", self.client.list_objects_v2, **kwargs)
            keys += [o["Key"] for o in page.get("Contents", [])]
            prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
            if not page.get("IsTruncated"):
                return keys, prefixes
            token = page["NextContinuationToken"]

    def _step_prefixes(self) -> dict[str, bool]:
        """step_NNNNNN -> whether its manifest (the commit marker) is there."""
        base = self._key("step_")
        _, prefixes = self._list(base, delimiter="/")
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in prefixes}
        keys, _ = self._list(base)
        committed = {k.split("/")[-2] for k in keys if k.endswith("/" + MANIFEST)}
        return {name: name in committed for name in names}

    def steps(self) -> list[int]:
        """Committed steps, newest first."""
        return sorted((int(name[5:]) for name, ok in self._step_prefixes().items()
                       if ok and name[5:].isdigit()), reverse=True)

    def download(self, step: int, dest: Path, progress: BytesMoved | None = None) -> Path:
        """Fetch step's files into dest (a fresh directory); the caller verifies them.
        progress(n): n more bytes are down (per MiB), for the watchdog."""
        name = f"step_{step:06d}"
        dest.mkdir(parents=True)
        manifest = dest / MANIFEST
        self._get(self._key(name, MANIFEST), manifest, progress)
        for file in read_json(manifest)["files"]:
            self._get(self._key(name, file), dest / file, progress)
        return dest

    def download_files(self, step: int, dest: Path, names: list[str],
                       progress: BytesMoved | None = None,
                       expected: dict[str, dict[str, Any]] | None = None) -> None:
        """Fetch some files of a step into dest, several at once: one rank's shards of a sharded
        checkpoint, or the small files every rank reads. Each goes to a temporary name and is
        renamed into place only after it matches its `expected` manifest entry (size, sha256),
        so a reader never sees a partial or corrupt file under its own name."""
        name = f"step_{step:06d}"
        dest.mkdir(parents=True, exist_ok=True)

        def one(file: str) -> None:
            tmp = dest / f".{file}.{os.getpid()}.{threading.get_ident()}.download"
            try:
                self._get(self._key(name, file), tmp, progress)
                entry = (expected or {}).get(file)
                if entry is not None and (tmp.stat().st_size != entry["bytes"]
                                          or sha256_file(tmp) != entry["sha256"]):
                    raise ValueError(f"{self.uri}/{name}/{file} does not match its manifest entry "
                                     "(size or sha256): the mirror's copy is bad.")
                os.replace(tmp, dest / file)
            finally:
                tmp.unlink(missing_ok=True)

        with ThreadPoolExecutor(max(1, min(self.parallel_parts, len(names)))) as pool:
            list(pool.map(one, names))

    def _get(self, key: str, path: Path, progress: BytesMoved | None = None) -> None:
        progress = progress or _no_progress

        def fetch() -> None:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
            with open(path, "wb") as fh:
                for chunk in iter(lambda: body.read(1 << 20), b""):
                    fh.write(chunk)
                    progress(len(chunk))

        self.call(f"get {key}", fetch)

    def read_object(self, name: str) -> bytes | None:
        """The object <prefix>/<name> (a small one, such as the pause marker), or None if absent."""
        from botocore.exceptions import ClientError

        def get() -> bytes | None:
            try:
                return self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None
                raise

        return self.call(f"get {self._key(name)}", get)

    # -- delete ------------------------------------------------------------------------------
    def delete_object(self, name: str) -> None:
        self.call(f"delete {self._key(name)}", self.client.delete_object, Bucket=self.bucket,
                  Key=self._key(name))

    def delete_step(self, name: str) -> None:
        keys, _ = self._list(self._key(name) + "/")
        # the manifest first: from that moment the step is no longer a checkpoint
        keys.sort(key=lambda k: not k.endswith("/" + MANIFEST))
        for i in range(0, len(keys), 1000):
            self.call(f"delete {name}", self.client.delete_objects, Bucket=self.bucket,
                      Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})

    def prune(self, keep: int, *, every: int = 0, newest: int | None = None) -> None:
        """Delete committed steps beyond the retention policy (tasks/train/retention.py): the
        newest `keep`, the multiples of `every` and `newest` (the step just uploaded) stay."""
        for step in prunable(self.steps(), keep_last=keep, keep_every=every, newest=newest):
            self.delete_step(f"step_{step:06d}")

    def _clear_unfinished(self, keep: str) -> None:
        """Step prefixes without a manifest are uploads a killed worker left behind."""
        for name, committed in self._step_prefixes().items():
            if not committed and name != keep:
                self.delete_step(name)
