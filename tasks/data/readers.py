"""Inputs: resolve paths and globs (local or s3://) to files, and read each file's documents.

Formats, by file name: JSONL (`.jsonl`, `.ndjson`, `.json`: one object per line with the text
and id fields, every other field kept as metadata), Parquet (`.parquet`: the same fields as
columns), plain text (`.txt`, `.text`, `.md`: one document per block of lines separated by a blank
line). JSONL and text may be gzip-compressed (`.gz`). A directory stands for every such file
under it.

Reading never raises on bad data: an unreadable file, a malformed line, a missing or non-string
text, an empty file or bytes that are not UTF-8 each come back as a dropped record with a reason,
so the run goes on and the audit trail says what happened.

S3 is read with boto3 (endpoint from AWS_ENDPOINT_URL when set); its client retries throttling
with backoff, the only place where retrying belongs.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

from tasks.data.steps import Doc

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
SUPPORTED_SUFFIXES = (*JSONL_SUFFIXES, *TEXT_SUFFIXES, ".parquet")
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class InputFile:
    path: str  # absolute local path or s3://bucket/key
    source: int  # index of the `inputs` entry (pattern) it matched: its mix weight
    label: str  # short unique name, the prefix of default document ids ("notes.txt:12")


def dropped_record(doc_id: str, line: int, step: str, reason: str, **extra: Any) -> dict:
    return {"id": doc_id, "line": line, "step": step, "reason": reason, **extra}


# --------------------------------------------------------------------------------------------
# S3


@lru_cache(maxsize=1)
def s3_client() -> Any:
    import boto3
    from botocore.config import Config

    # "adaptive" retries back off on 503 Slow Down as well as on network errors.
    return boto3.client("s3", config=Config(retries={"max_attempts": 10, "mode": "adaptive"}))


def split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key


def _list_s3(pattern: str) -> list[str]:
    bucket, key_pattern = split_s3(pattern)
    if key_pattern.endswith("/") or not key_pattern:  # a "directory": every supported object
        key_pattern += "**"
    glob_at = _GLOB_CHARS.search(key_pattern)
    prefix = key_pattern[:glob_at.start()] if glob_at else key_pattern
    keys = []
    for page in s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            key = obj["Key"]
            if key.endswith("/"):
                continue
            if glob_at and not fnmatch.fnmatchcase(key, key_pattern):
                continue
            if not glob_at and key != key_pattern:
                continue
            if glob_at and not _supported(key):
                continue
            keys.append(f"s3://{bucket}/{key}")
    return sorted(keys)


def _supported(name: str) -> bool:
    name = name[:-3] if name.endswith(".gz") else name
    return name.endswith(SUPPORTED_SUFFIXES)


def read_bytes(path: str) -> bytes:
    if path.startswith("s3://"):
        bucket, key = split_s3(path)
        return s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
    return Path(path).read_bytes()


def fingerprint(path: str) -> dict:
    """Enough to notice that an input changed between a crashed run and its rerun."""
    if path.startswith("s3://"):
        bucket, key = split_s3(path)
        head = s3_client().head_object(Bucket=bucket, Key=key)
        return {"path": path, "size": head["ContentLength"], "etag": head["ETag"]}
    stat = os.stat(path)
    return {"path": path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


# --------------------------------------------------------------------------------------------
# Resolving inputs


def _list_local(pattern: str) -> list[str]:
    if os.path.isdir(pattern):
        pattern = os.path.join(pattern, "**", "*")
        return sorted(os.path.abspath(p) for p in glob.glob(pattern, recursive=True)
                      if os.path.isfile(p) and _supported(p))
    return sorted(os.path.abspath(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))


def _labels(paths: list[str]) -> list[str]:
    """The shortest trailing part of each path that tells it apart from the others."""
    parts = [p.rstrip("/").split("/") for p in paths]
    depth = [1] * len(paths)
    while True:
        labels = ["/".join(p[-d:]) for p, d in zip(parts, depth)]
        seen: dict[str, list[int]] = {}
        for i, label in enumerate(labels):
            seen.setdefault(label, []).append(i)
        clashes = [i for group in seen.values() if len(group) > 1 for i in group if depth[i] < len(parts[i])]
        if not clashes:
            return labels
        for i in clashes:
            depth[i] += 1


def resolve_inputs(patterns: list[str]) -> list[InputFile]:
    """Each pattern expanded and sorted, in the order given; a pattern matching nothing is an
    error. A file matched by two patterns belongs to the first."""
    found: list[tuple[str, int]] = []
    seen: set[str] = set()
    for source, pattern in enumerate(patterns):
        matches = _list_s3(pattern) if pattern.startswith("s3://") else _list_local(pattern)
        if not matches:
            raise FileNotFoundError(f"DataPrepConfig.inputs: {pattern!r} matches no file. "
                                    "Fix the path or glob, or leave inputs empty for the demo corpus.")
        for path in matches:
            if path not in seen:
                seen.add(path)
                found.append((path, source))
    labels = _labels([path for path, _ in found])
    return [InputFile(path, source, label) for (path, source), label in zip(found, labels)]


# --------------------------------------------------------------------------------------------
# Reading one file


def read_documents(file: InputFile, text_field: str = "text", id_field: str = "id") -> Iterator[Doc | dict]:
    """Yield each document of `file`, or a dropped record where one is unreadable."""
    name = file.path[:-3] if file.path.endswith(".gz") else file.path
    try:
        data = read_bytes(file.path)
        if file.path.endswith(".gz"):
            data = gzip.decompress(data)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        yield dropped_record(file.label, 0, "parse", "unreadable_file", error=str(exc)[:200])
        return
    if not data.strip():
        yield dropped_record(file.label, 0, "parse", "empty_file")
        return
    if name.endswith(".parquet"):
        yield from _read_parquet(data, file, text_field, id_field)
    elif name.endswith(JSONL_SUFFIXES):
        yield from _read_jsonl(data, file, text_field, id_field)
    else:
        yield from _read_text(data, file)


def _make_doc(record: dict, file: InputFile, line: int, text_field: str, id_field: str) -> Doc | dict:
    raw_id = record.get(id_field)
    doc_id = str(raw_id) if raw_id is not None else f"{file.label}:{line}"
    text = record.get(text_field)
    if text is None:
        return dropped_record(doc_id, line, "parse", "missing_text")
    if not isinstance(text, str):
        return dropped_record(doc_id, line, "parse", "non_string_text")
    if not text.strip():
        return dropped_record(doc_id, line, "parse", "empty_text")
    metadata = {k: v for k, v in record.items() if k not in (id_field, text_field)}
    return Doc(doc_id, text, file.source, line, metadata)


def _read_jsonl(data: bytes, file: InputFile, text_field: str, id_field: str) -> Iterator[Doc | dict]:
    for line_no, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():  # blank lines separate nothing in JSONL; they are not records
            continue
        default_id = f"{file.label}:{line_no}"
        try:
            record = json.loads(raw)  # bytes: json detects the encoding, we insist on UTF-8 below
        except UnicodeDecodeError:
            yield dropped_record(default_id, line_no, "parse", "invalid_utf8")
            continue
        except json.JSONDecodeError:
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                yield dropped_record(default_id, line_no, "parse", "invalid_utf8")
                continue
            yield dropped_record(default_id, line_no, "parse", "malformed_json")
            continue
        if not isinstance(record, dict):
            yield dropped_record(default_id, line_no, "parse", "not_an_object")
            continue
        yield _make_doc(record, file, line_no, text_field, id_field)


def _read_text(data: bytes, file: InputFile) -> Iterator[Doc | dict]:
    """One document per block of non-blank lines. Bytes are decoded per document, so one bad
    byte sequence costs one document, not the file."""
    block: list[bytes] = []
    lines = data.split(b"\n")
    for line_no, raw in enumerate([*lines, b""], 1):
        if raw.strip():
            block.append(raw)
            continue
        if block:
            start = line_no - len(block)
            doc_id = f"{file.label}:{start}"
            try:
                yield Doc(doc_id, b"\n".join(block).decode("utf-8"), file.source, start)
            except UnicodeDecodeError:
                yield dropped_record(doc_id, start, "parse", "invalid_utf8")
            block = []


def _read_parquet(data: bytes, file: InputFile, text_field: str, id_field: str) -> Iterator[Doc | dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError, ValueError) as exc:
        yield dropped_record(file.label, 0, "parse", "unreadable_file", error=str(exc)[:200])
        return
    columns = {name: table.column(name).to_pylist() for name in table.column_names}
    for row in range(table.num_rows):
        yield _make_doc({name: values[row] for name, values in columns.items()}, file, row + 1,
                        text_field, id_field)
