"""Inputs: resolve paths and globs (local or s3://) to files, and read each file's documents.

Formats, by file name: JSONL (`.jsonl`, `.ndjson`, `.json`: one object per line with the text
and id fields, every other field kept as metadata), Parquet (`.parquet`: the same fields as
columns), plain text (`.txt`, `.text`, `.md`: one document per block of lines separated by a blank
line). JSONL and text may be gzip-compressed (`.gz`). A directory stands for every such file
under it.

A large file is split so that it spreads over several workers (`plan_splits`): Parquet by row
groups, JSONL and text by byte ranges. A range owns the lines (JSONL) or blocks (text) that
*start* inside it, reading past its end to finish the last one, so every document is read by
exactly one split, whatever the number of splits. Splits depend only on the file's size (or row
groups) and `split_bytes`, never on the number of workers or hosts, so the data set they make is
the same on any cluster. A split's default document ids and lines are counted from its start;
`line_base` (the newlines, or rows, of the splits before it) makes them the file's, once every
split has counted its own. A gzip file is one split: it cannot be read from the middle.

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
import io
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

from tasks.data.markers import read_table
from tasks.data.steps import Doc
from tasks.common.uris import split_s3

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
SUPPORTED_SUFFIXES = (*JSONL_SUFFIXES, *TEXT_SUFFIXES, ".parquet")
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class InputFile:
    path: str  # absolute local path or s3://bucket/key
    source: int  # index of the `inputs` entry (pattern) it matched: its mix weight
    label: str  # short unique name, the prefix of default document ids ("notes.txt:12")


def dropped_record(doc_id: str | None, line: int, step: str, reason: str, **extra: Any) -> dict:
    return {"id": doc_id, "line": line, "step": step, "reason": reason, **extra}


# --------------------------------------------------------------------------------------------
# S3


@lru_cache(maxsize=1)
def s3_client() -> Any:
    import boto3
    from botocore.config import Config

    # "adaptive" retries back off on 503 Slow Down as well as on network errors.
    return boto3.client("s3", config=Config(retries={"max_attempts": 10, "mode": "adaptive"}))


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


def read_range(path: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file (fewer at its end)."""
    if end <= start:
        return b""
    if path.startswith("s3://"):
        bucket, key = split_s3(path)
        return s3_client().get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"].read()
    with open(path, "rb") as fh:
        fh.seek(start)
        return fh.read(end - start)


class _S3File(io.RawIOBase):
    """A seekable read-only view of an S3 object by range GETs: Parquet reads its footer and the
    row groups it needs, not the whole object."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size, self.pos = path, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def readinto(self, buffer: Any) -> int:
        data = read_range(self.path, self.pos, min(self.size, self.pos + len(buffer)))
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def _open_parquet(path: str, size: int) -> Any:
    import pyarrow.parquet as pq

    return pq.ParquetFile(_S3File(path, size) if path.startswith("s3://") else path)


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
# Splitting large files


def plan_splits(path: str, size: int, split_bytes: int) -> list[dict | None]:
    """How one file is read: [None] (whole), or its splits in order, each {"start", "end"} bytes
    (JSONL, text) or {"row_groups": [first, end]} (Parquet), of about `split_bytes` each."""
    name = path[:-3] if path.endswith(".gz") else path
    if path.endswith(".gz") or size <= split_bytes:
        return [None]
    if name.endswith(".parquet"):
        import pyarrow as pa

        try:
            meta = _open_parquet(path, size).metadata
        except (pa.ArrowException, OSError, ValueError):
            return [None]  # read whole, it is quarantined as unreadable with the reason
        splits, first, size_so_far = [], 0, 0
        for group in range(meta.num_row_groups):
            row_group = meta.row_group(group)
            size_so_far += sum(row_group.column(c).total_compressed_size for c in range(row_group.num_columns))
            if size_so_far >= split_bytes or group == meta.num_row_groups - 1:
                splits.append({"row_groups": [first, group + 1]})
                first, size_so_far = group + 1, 0
        return splits if len(splits) > 1 else [None]
    n = -(-size // split_bytes)
    return [{"start": k * size // n, "end": (k + 1) * size // n} for k in range(n)]


_CHUNK = 1 << 16
_WHITESPACE = b" \t\r\x0b\x0c"


def _find_newline(path: str, position: int, limit: int) -> int:
    """The first b"\\n" at or after `position` (before `limit`), or -1."""
    while position < limit:
        chunk = read_range(path, position, min(limit, position + _CHUNK))
        if not chunk:
            return -1
        found = chunk.find(b"\n")
        if found >= 0:
            return position + found
        position += len(chunk)
    return -1


def _line_before_is_blank(path: str, newline: int) -> bool:
    """Whether the line ending at the b"\\n" at `newline` holds only whitespace."""
    end = newline
    while end > 0:
        chunk = read_range(path, max(0, end - _CHUNK), end)
        stripped = chunk.rstrip(_WHITESPACE)
        if stripped:
            return stripped.endswith(b"\n")
        end -= len(chunk)
    return True


def _read_split(path: str, size: int, start: int, end: int, blocks: bool) -> tuple[bytes, int, int, bool]:
    """The bytes holding every line (or, with `blocks`, every blank-line separated block) that
    starts in [start, end), read on to finish the last one. Returns (bytes, the split-relative
    number of their first line, newlines in [start, end), whether the bytes begin inside a block
    that started before `start`: its lines belong to the split before)."""
    first, first_line, continues = 0, 1, False
    if start > 0:
        newline = _find_newline(path, start - 1, end)
        if newline < 0:  # no line starts in this range
            return b"", 1, 0, False
        first, first_line = newline + 1, 2 if newline >= start else 1
        continues = blocks and not _line_before_is_blank(path, newline)
    data = read_range(path, first, end)
    newlines = data.count(b"\n") + (first_line - 1)
    tail = []
    if data and end < size and not data.endswith(b"\n"):  # finish the line that straddles `end`
        stop = _find_newline(path, end, size)
        tail.append(read_range(path, end, size if stop < 0 else stop + 1))
    position = end + sum(map(len, tail))
    last = (data + b"".join(tail)).rsplit(b"\n", 2)
    open_block = blocks and len(last) > 1 and last[-2].strip() != b""
    while open_block and position < size:  # a block goes on until a blank line
        stop = _find_newline(path, position, size)
        line = read_range(path, position, size if stop < 0 else stop + 1)
        tail.append(line)
        position += len(line)
        open_block = line.strip() != b""
    return data + b"".join(tail), first_line, newlines, continues


# --------------------------------------------------------------------------------------------
# Reading one file


@dataclass
class Shard:
    """What one split of a file holds: its documents (or dropped records) in order, and how many
    line numbers it spans (newlines in its byte range, or rows), for the splits after it."""

    documents: Iterator[Doc | dict]
    lines: int


def read_shard(file: InputFile, split: dict | None = None, text_field: str = "text",
               id_field: str = "id", size: int | None = None) -> Shard:
    """The documents of `file` (or of one of its splits), and dropped records where one is
    unreadable. Documents without an id in the data get id None and a split-relative line:
    `default_id` names them once the split's line_base is known."""
    name = file.path[:-3] if file.path.endswith(".gz") else file.path
    whole = file.label if split is None or "start" not in split else \
        f"{file.label}@bytes={split['start']}-{split['end']}"
    try:
        if split is not None and "row_groups" in split:
            return _read_parquet_groups(file, split["row_groups"], text_field, id_field, size)
        if split is not None:
            data, first_line, lines, continues = _read_split(file.path, size, split["start"], split["end"],
                                                             blocks=not name.endswith(JSONL_SUFFIXES))
        else:
            data = read_bytes(file.path)
            if file.path.endswith(".gz"):
                data = gzip.decompress(data)
            first_line, lines, continues = 1, data.count(b"\n"), False
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        return Shard(iter([dropped_record(whole, 0, "parse", "unreadable_file", error=str(exc)[:200])]), 0)
    if split is None and not data.strip():
        return Shard(iter([dropped_record(file.label, 0, "parse", "empty_file")]), lines)
    if name.endswith(".parquet"):
        return _read_parquet(data, file, text_field, id_field)
    if name.endswith(JSONL_SUFFIXES):
        return Shard(_read_jsonl(data, file, text_field, id_field, first_line), lines)
    return Shard(_read_text(data, file, first_line, continues), lines)


def default_id(doc_id: str | None, label: str, line: int) -> str:
    """A document's id: its own, or "<file label>:<line where it starts>"."""
    return doc_id if doc_id is not None else f"{label}:{line}"


def _make_doc(record: dict, file: InputFile, line: int, text_field: str, id_field: str) -> Doc | dict:
    raw_id = record.get(id_field)
    doc_id = str(raw_id) if raw_id is not None else None
    text = record.get(text_field)
    if text is None:
        return dropped_record(doc_id, line, "parse", "missing_text")
    if not isinstance(text, str):
        return dropped_record(doc_id, line, "parse", "non_string_text")
    if not text.strip():
        return dropped_record(doc_id, line, "parse", "empty_text")
    metadata = {k: v for k, v in record.items() if k not in (id_field, text_field)}
    return Doc(doc_id, text, file.source, line, metadata)


def _read_jsonl(data: bytes, file: InputFile, text_field: str, id_field: str,
                first_line: int = 1) -> Iterator[Doc | dict]:
    for line_no, raw in enumerate(data.split(b"\n"), first_line):
        if not raw.strip():  # blank lines separate nothing in JSONL; they are not records
            continue
        default_id = None
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


def _read_text(data: bytes, file: InputFile, first_line: int = 1, continues: bool = False) -> Iterator[Doc | dict]:
    """One document per block of non-blank lines. Bytes are decoded per document, so one bad
    byte sequence costs one document, not the file. With `continues`, the lines before the first
    blank one end a block of the split before, and are skipped."""
    block: list[bytes] = []
    lines = data.split(b"\n")
    for line_no, raw in enumerate([*lines, b""], first_line):
        if raw.strip():
            block.append(raw)
            continue
        if block and not continues:
            start = line_no - len(block)
            try:
                yield Doc(None, b"\n".join(block).decode("utf-8"), file.source, start)
            except UnicodeDecodeError:
                yield dropped_record(None, start, "parse", "invalid_utf8")
        block, continues = [], False


def _read_parquet(data: bytes, file: InputFile, text_field: str, id_field: str) -> Shard:
    import pyarrow as pa

    try:
        table = read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError, ValueError) as exc:
        return Shard(iter([dropped_record(file.label, 0, "parse", "unreadable_file", error=str(exc)[:200])]), 0)
    return Shard(_parquet_rows(table, file, text_field, id_field), table.num_rows)


def _read_parquet_groups(file: InputFile, groups: list[int], text_field: str, id_field: str,
                         size: int | None) -> Shard:
    import pyarrow as pa

    where = f"{file.label}@row_groups={groups[0]}-{groups[1]}"
    try:
        table = _open_parquet(file.path, size).read_row_groups(list(range(*groups)))
    except (pa.ArrowException, OSError, ValueError) as exc:
        return Shard(iter([dropped_record(where, 0, "parse", "unreadable_file", error=str(exc)[:200])]), 0)
    return Shard(_parquet_rows(table, file, text_field, id_field), table.num_rows)


def _parquet_rows(table: Any, file: InputFile, text_field: str, id_field: str) -> Iterator[Doc | dict]:
    columns = {name: table.column(name).to_pylist() for name in table.column_names}
    for row in range(table.num_rows):
        yield _make_doc({name: values[row] for name, values in columns.items()}, file, row + 1,
                        text_field, id_field)
