"""tasks/common/uris.py: the one S3 URI parser the readers share; a malformed URI is refused by name
before any S3 call (a missing bucket would otherwise surface as botocore's ParamValidationError)."""

import pytest

from tasks.common.uris import is_s3, split_s3


def test_a_uri_splits_into_bucket_and_key():
    assert split_s3("s3://corpora/web/part-0.jsonl") == ("corpora", "web/part-0.jsonl")
    assert split_s3("s3://corpora/web/") == ("corpora", "web/")
    assert split_s3("s3://corpora") == ("corpora", "")
    assert is_s3("s3://corpora") and not is_s3("/data/s3://x") and not is_s3(None)


@pytest.mark.parametrize("uri, message", [
    ("/data/corpus.jsonl", r"Not an S3 URI: '/data/corpus.jsonl' \(expected s3://bucket/key\)"),
    ("S3://corpora/x", r"Not an S3 URI"),
    ("s3:///web/part-0.jsonl", r"S3 URI 's3:///web/part-0.jsonl' has no bucket"),
])
def test_anything_else_is_refused_naming_the_uri(uri, message):
    with pytest.raises(ValueError, match=message):
        split_s3(uri)
