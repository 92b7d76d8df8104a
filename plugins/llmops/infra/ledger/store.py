"""Where ledger events are kept: SQLite under $LLMOPS_HOME, and Parquet under the storage root.

SQLite (`$LLMOPS_HOME/ledger.db`, WAL mode, one writer at a time with a busy timeout) is the
local ledger: every event is written there. When the deployment's storage root is on S3
(`$LLMOPS_STORAGE_ROOT`, llmops.core.settings.storage_root), each event is also one Parquet file,
`<root>/ledger/dt=YYYY-MM-DD/<event_id>.parquet` (dt = the UTC day of the event: an attempt's end
for `ended`, else when it was recorded), so that every
worker's events land in one place Athena or Glue can read (see llmops.infra.ledger for the table).
Rewriting an event (the same event_id) replaces its row and its file.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import sqlite3
from pathlib import Path
from typing import Any, Iterator

from llmops.core import settings
from llmops.infra.aws import s3
from llmops.infra.ledger.events import FIELDS, JobEvent, TIME_FIELDS, arrow_schema, event_time

BUSY_TIMEOUT_SECONDS = 10.0
LEDGER_DIR = "ledger"


def sqlite_path() -> Path:
    return settings.home() / "ledger.db"


def _column_types() -> dict[str, str]:
    ints = {"attempt", "map_index", "try_number", "instance_count", "accelerators_per_instance",
            "schema_version"}
    floats = {*TIME_FIELDS, "queue_seconds", "instance_hours", "accelerator_hours",
              "usd_per_instance_hour", "estimated_cost_usd", "goodput", "badput_seconds", "billed_seconds"}
    return {name: "TEXT PRIMARY KEY" if name == "event_id" else
            "INTEGER" if name in ints else "REAL" if name in floats else "TEXT" for name in FIELDS}


def _columns_sql() -> str:
    return ", ".join(f"{name} {kind}" for name, kind in _column_types().items())


def _add_new_columns(conn: sqlite3.Connection) -> None:
    """A ledger written by an earlier release lacks the columns added since: add them (empty
    for the old rows) rather than fail every write."""
    present = {row[1] for row in conn.execute("PRAGMA table_info(job_events)")}
    for name, kind in _column_types().items():
        if name not in present:
            conn.execute(f"ALTER TABLE job_events ADD COLUMN {name} {kind}")


@contextlib.contextmanager
def connect(path: Path | None = None) -> Iterator[sqlite3.Connection]:
    path = path or sqlite_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_SECONDS)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"CREATE TABLE IF NOT EXISTS job_events ({_columns_sql()})")
        _add_new_columns(conn)
        conn.execute("CREATE INDEX IF NOT EXISTS job_events_team_end ON job_events (team, event, ended_at)")
        conn.execute("CREATE INDEX IF NOT EXISTS job_events_job ON job_events (job_name, attempt)")
        conn.row_factory = sqlite3.Row
        yield conn
        conn.commit()
    finally:
        conn.close()


def write_sqlite(event: JobEvent, path: Path | None = None) -> None:
    row = event.to_dict()
    with connect(path) as conn:
        conn.execute(f"INSERT OR REPLACE INTO job_events ({', '.join(FIELDS)}) "
                     f"VALUES ({', '.join('?' for _ in FIELDS)})", [row[f] for f in FIELDS])


def first_submitted_at(job_name: str, attempt: int, path: Path | None = None) -> float | None:
    """When this worker's ledger saw the attempt submitted (a reattach whose try lost it)."""
    with connect(path) as conn:
        row = conn.execute("SELECT MIN(submitted_at) FROM job_events WHERE job_name = ? AND "
                           "attempt = ? AND submitted_at IS NOT NULL", (job_name, attempt)).fetchone()
    return row[0] if row else None


def read_sqlite(since: float, until: float, path: Path | None = None) -> list[dict[str, Any]]:
    """Events whose time (events.event_time) is in [since, until) (epoch seconds)."""
    if not (path or sqlite_path()).exists():
        return []
    when = "COALESCE(CASE WHEN event = 'ended' THEN ended_at END, recorded_at)"
    with connect(path) as conn:
        rows = conn.execute(f"SELECT * FROM job_events WHERE {when} >= ? AND {when} < ? "
                            "ORDER BY recorded_at", (since, until)).fetchall()
    return [dict(r) for r in rows]


# -- Parquet -----------------------------------------------------------------------------------

def partition(when: float) -> str:
    return f"dt={dt.datetime.fromtimestamp(when, dt.timezone.utc):%Y-%m-%d}"


def parquet_bytes(events: list[JobEvent]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = arrow_schema()
    rows = [_to_arrow_row(e.to_dict()) for e in events]
    table = pa.Table.from_pylist(rows, schema=schema)
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="snappy")
    return sink.getvalue()


def _to_arrow_row(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for name in TIME_FIELDS:
        if out[name] is not None:
            out[name] = dt.datetime.fromtimestamp(out[name], dt.timezone.utc)
    return out


def _from_arrow_row(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for name in TIME_FIELDS:
        if out.get(name) is not None:
            out[name] = out[name].timestamp()
    return out


def parquet_key(root: str, event: JobEvent) -> str:
    return (f"{root.rstrip('/')}/{LEDGER_DIR}/{partition(event_time(event.to_dict()))}/"
            f"{event.event_id}.parquet")


def write_parquet(event: JobEvent, root: str, hook: Any = None) -> str:
    """One event as one Parquet file under `root` (s3://... through an S3 hook, or a local dir)."""
    uri = parquet_key(root, event)
    data = parquet_bytes([event])
    if s3.is_s3(uri):
        hook = hook or s3.s3_hook(settings.aws_conn_id())
        bucket, key = s3.split_s3(uri)
        hook.load_bytes(data, key=key, bucket_name=bucket, replace=True)
    else:
        path = Path(uri)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return uri


def read_parquet(root: str, since: float, until: float, hook: Any = None) -> list[dict[str, Any]]:
    """Events whose time (events.event_time) is in [since, until), from the dt= partitions
    that can hold them."""
    import pyarrow.parquet as pq

    base = f"{root.rstrip('/')}/{LEDGER_DIR}"
    first = partition(since)
    last = partition(max(since, until - 1e-3))
    blobs: list[bytes] = []
    if s3.is_s3(base):
        hook = hook or s3.s3_hook(settings.aws_conn_id())
        bucket, prefix = s3.split_s3(base)
        # The partitions that exist (one listing), then only those in the period.
        parts = [p.rstrip("/").rsplit("/", 1)[-1]
                 for p in hook.list_prefixes(bucket_name=bucket, prefix=f"{prefix}/", delimiter="/") or []]
        for part in sorted(p for p in parts if first <= p <= last):
            for key in hook.list_keys(bucket_name=bucket, prefix=f"{prefix}/{part}/") or []:
                if key.endswith(".parquet"):
                    blobs.append(hook.get_key(key, bucket_name=bucket).get()["Body"].read())
    else:
        for folder in sorted(Path(base).glob("dt=*")):
            if first <= folder.name <= last:
                blobs.extend(p.read_bytes() for p in sorted(folder.glob("*.parquet")))
    rows = [_from_arrow_row(r) for blob in blobs
            for r in pq.read_table(io.BytesIO(blob)).to_pylist()]
    return sorted((r for r in rows if since <= event_time(r) < until), key=lambda r: r["recorded_at"])
