"""S3 URIs, parsed and checked one way for every reader: data prep's inputs, model sources, the
container's entry (docker/job_entry.py, with tasks/ on its path) and the Airflow side.

Stdlib only: imported where boto3 is not (DAG parsing on MWAA).
"""

from __future__ import annotations

SCHEME = "s3://"

# Inputs a stage reads from S3 itself while it runs, by entrypoint: the config keys whose
# s3:// prefix docker/job_entry.py leaves as it is instead of downloading it before the stage
# starts (pretraining's token shards stream block by block: tasks/train/stream.py), and which a
# SageMaker job mounts FastFile, not File (llmops.jobs.backends.sagemaker.sagemaker_requests).
STREAMED_INPUTS: dict[str, tuple[str, ...]] = {"tasks.pretrain": ("data_dir",)}


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
