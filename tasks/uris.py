"""S3 URIs, parsed and checked one way for every reader: data prep's inputs, model sources, the
container's entry (docker/job_entry.py, with tasks/ on its path) and the Airflow side.

Stdlib only: imported where boto3 is not (DAG parsing on MWAA).
"""

from __future__ import annotations

SCHEME = "s3://"


def is_s3(uri: str) -> bool:
    return isinstance(uri, str) and uri.startswith(SCHEME)


def split_s3(uri: str) -> tuple[str, str]:
    """s3://bucket/some/key -> ("bucket", "some/key"); anything else is refused, naming the URI."""
    if not is_s3(uri):
        raise ValueError(f"Not an S3 URI: {uri!r} (expected s3://bucket/key).")
    bucket, _, key = uri[len(SCHEME):].partition("/")
    if not bucket:
        raise ValueError(f"S3 URI {uri!r} has no bucket.")
    return bucket, key
