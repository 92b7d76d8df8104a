"""Data prep's completion markers and staging tables (tasks/data/prep.py is the driver).

A step's marker, completions/NAME.json, holds a key, a digest of everything the step was built
from, and the files it wrote. A rerun redoes the step when the key differs, e.g. when a shard it
read was redone after a crash, or when one of its files is gone.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tasks.common.io import atomic_write, read_json, sha256_file, write_json

DROPPED_COLUMNS = ("id", "source", "line", "step", "reason", "duplicate_of", "detail")


def digest(*parts: Any) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(json.dumps(part, sort_keys=True).encode() + b"\0")
    return hasher.hexdigest()


def finished(out_dir: Path, name: str, key: str) -> dict | None:
    """The marker of step `name` if it finished with this key and its files are all there."""
    marker = out_dir / "completions" / f"{name}.json"
    if not marker.exists():
        return None
    done = read_json(marker)
    if done.get("key") != key or not all((out_dir / f).exists() for f in done["files"]):
        return None
    return done


def mark_finished(out_dir: Path, name: str, key: str, files: list[Path], **data: Any) -> dict:
    marker = {"key": key, "files": [str(Path(f).relative_to(out_dir)) for f in files], **data}
    write_json(out_dir / "completions" / f"{name}.json", marker)
    return marker


def write_table(path: Path, columns: dict[str, list], schema: Any) -> str:
    """Write a Parquet file atomically; returns its sha256."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({name: pa.array(columns[name], type=schema.field(name).type) for name in schema.names},
                     schema=schema)
    atomic_write(path, lambda fh: pq.write_table(table, fh, compression="zstd"))
    return sha256_file(path)


def read_table(path: Any, columns: list[str] | None = None) -> Any:
    """One Parquet file as a pyarrow Table (`columns`, or all). Not pq.read_table: that goes
    through pyarrow.dataset, whose import costs ~0.2 s of CPU in every process that first reads a
    file (this one and each pool worker), and one file needs none of it."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).read(columns=columns)


def schemas() -> dict[str, Any]:
    import pyarrow as pa

    string, integer = pa.string(), pa.int64()
    return {
        "staging": pa.schema([("id", string), ("text", string), ("line", integer), ("metadata", string)]),
        "documents": pa.schema([("id", string), ("text", string), ("source", string),
                                ("line", integer), ("split", string), ("metadata", string)]),
        "dropped": pa.schema([(name, integer if name == "line" else string) for name in DROPPED_COLUMNS]),
    }


def shard_files(out_dir: Path, index: int) -> dict[str, Path]:
    staging = out_dir / "staging"
    return {"docs": staging / f"{index:05d}.docs.parquet",
            "exact": staging / f"{index:05d}.exact.npy",
            "near": staging / f"{index:05d}.near.npy",
            "dropped": staging / f"{index:05d}.dropped.parquet",
            "train": staging / f"{index:05d}.train.bin",
            "val": staging / f"{index:05d}.val.bin",
            "documents": out_dir / "documents" / f"{index:05d}.parquet",
            "dropped_out": out_dir / "dropped" / f"{index:05d}.parquet"}
