"""The job ledger: every job the platform started, across runs, for cost and failure analysis.

The JobOperator records an event (llmops.infra.ledger.events.JobEvent, schema version 1) when a try
submits a job (`submitted`), submits a new attempt of it (`retried`), finds one an earlier try
started (`reattached`), and when an attempt ends (`ended`: succeeded / failed / stopped, with the
reason); a task that reuses a finished job's outputs records `cached` (charged nothing). Each row carries the job (name, spec hash, stage, backend, image and digest, team, the
Airflow dag_id / run_id / task_id / map_index / try_number, instance type and count), its times
(submitted, started, ended: epoch seconds in SQLite, UTC timestamps in Parquet), queue seconds,
state and failure reason, and on `ended` rows the attempt's instance-hours, accelerator-hours and
estimated cost from the price table in the repo (llmops/infra/ledger/prices.json, with its source
and date; local jobs cost 0; where the service reports its billed time, SageMaker's
BillableTimeInSeconds, the cost is that: `billed_seconds`). `ended` rows of pretraining jobs also
carry the job's goodput and the hosts it named stragglers or caught computing wrong results.

Writing to the ledger never fails a task or stops a job: errors are logged and counted
(`write_errors`). Kept in SQLite locally and as Parquet on S3 when the storage root is s3://
(llmops.infra.ledger.store). A daily DAG, `llm_platform_report`, turns it into tables and plots in
MLflow (llmops.infra.ledger.platform_report). `spend_hours(team, since)` is the budget check's
question.

Athena / Glue (Hive-style partitions, one small file per event):

    CREATE EXTERNAL TABLE llmops_job_events (
      event string, job_name string, attempt bigint, recorded_at timestamp, spec_hash string,
      stage string, backend string, service_job_name string, image string, image_digest string,
      team string, dag_id string, run_id string, task_id string, map_index bigint,
      try_number bigint, instance_type string, instance_count bigint,
      accelerators_per_instance bigint, submitted_at timestamp, started_at timestamp,
      ended_at timestamp, queue_seconds double, state string, failure_reason string,
      instance_hours double, accelerator_hours double, usd_per_instance_hour double,
      estimated_cost_usd double, goodput double, badput_seconds double, billed_seconds double,
      straggler_hosts string, sdc_hosts string, mlflow_run_id string,
      schema_version bigint, event_id string)
    PARTITIONED BY (dt string)
    STORED AS PARQUET
    LOCATION 's3://<bucket>/<storage root>/ledger/';
    MSCK REPAIR TABLE llmops_job_events;   -- or partition projection on dt

    -- accelerator-hours and cost per team last month
    SELECT team, sum(accelerator_hours), sum(estimated_cost_usd) FROM llmops_job_events
    WHERE event = 'ended' AND dt >= '2026-11-01' GROUP BY team;
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any

from llmops.core import settings
from llmops.infra.ledger import store
from llmops.infra.ledger.events import JobEvent, with_usage

log = logging.getLogger(__name__)
# Failed ledger writes in this process (the ledger is best effort; tests and the report read it).
write_errors = 0


def parquet_root() -> str:
    """Where Parquet goes: the deployment's storage root when it is on S3, else "" (none)."""
    root = settings.storage_root()
    return root if root.startswith("s3://") else ""


def record(event: JobEvent) -> bool:
    """Write one event (SQLite, and Parquet on S3); never raises. True when every write worked."""
    global write_errors

    ok = True
    try:
        event = with_usage(event)
        if event.submitted_at is None and event.event not in ("submitted", "cached"):
            event.submitted_at = store.first_submitted_at(event.job_name, event.attempt)
            event = with_usage(event)
        store.write_sqlite(event)
    except Exception as exc:  # noqa: BLE001 - the ledger must never decide a task
        write_errors += 1
        ok = False
        log.warning("Could not record %s of job %s in the ledger: %s: %s", event.event,
                    event.job_name, type(exc).__name__, exc)
    root = parquet_root()
    if root:
        try:
            store.write_parquet(event, root)
        except Exception as exc:  # noqa: BLE001
            write_errors += 1
            ok = False
            log.warning("Could not write %s of job %s to the ledger under %s: %s: %s", event.event,
                        event.job_name, root, type(exc).__name__, exc)
    return ok


def _epoch(value: dt.datetime | float | int) -> float:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            raise ValueError("give `since` as an aware datetime (e.g. pendulum's, or with tz=UTC)")
        return value.timestamp()
    return float(value)


def read_events(since: dt.datetime | float, until: dt.datetime | float | None = None,
                source: str = "") -> list[dict[str, Any]]:
    """Events recorded in [since, until): from Parquet when the storage root is on S3 (every
    worker's events), else from this machine's SQLite. `source` forces "sqlite" or a root."""
    start, end = _epoch(since), _epoch(until) if until is not None else time.time() + 1
    root = parquet_root() if not source else "" if source == "sqlite" else source
    return store.read_parquet(root, start, end) if root else store.read_sqlite(start, end)


def spend_hours(team: str, since: dt.datetime | float) -> float:
    """Accelerator-hours of `team`'s job attempts that ended at or after `since` (an aware
    datetime or epoch seconds), from the ledger. Attempts still running are not counted (their
    end is not known yet); attempts whose instance type has no known accelerator count 0.

    The budget check (llmops.policy.teams) calls this before starting a run; keep the signature.
    """
    start = _epoch(since)
    total = 0.0
    for row in read_events(start):
        if (row["event"] == "ended" and row["team"] == team and row["ended_at"] is not None
                and row["ended_at"] >= start):
            total += row["accelerator_hours"] or 0.0
    return total


def record_job(event: str, job: dict[str, Any], **fields: Any) -> bool:
    """Record `event` of the job described by `job` (the operator's fields, see
    JobOperator._ledger_job) with `fields` on top; never raises, a bad field is counted too."""
    global write_errors
    try:
        known = {k: v for k, v in {**job, **fields}.items() if k in _FIELD_NAMES}
        return record(JobEvent(event=event, **known))
    except Exception as exc:  # noqa: BLE001
        write_errors += 1
        log.warning("Could not record %s of job %s in the ledger: %s: %s", event,
                    job.get("job_name"), type(exc).__name__, exc)
        return False


def end_fields(status: Any, started_at: float | None) -> dict[str, Any]:
    """An `ended` event's fields from the attempt's final JobStatus (llmops.jobs.backends)."""
    details = status.details or {}
    state = getattr(status.state, "value", str(status.state))
    metrics = (status.result or {}).get("metrics") or {}
    goodput = metrics.get("goodput")
    billed = details.get("billed_seconds")
    health = (status.result or {}).get("health") or {}
    return {"state": state, "failure_reason": "" if state == "succeeded" else status.message,
            "started_at": details.get("started_at", started_at),
            "ended_at": details.get("ended_at") or time.time(),
            "goodput": float(goodput) if isinstance(goodput, (int, float)) else None,
            "billed_seconds": float(billed) if isinstance(billed, (int, float)) else None,
            "straggler_hosts": _named_hosts(health.get("stragglers")),
            "sdc_hosts": _named_hosts(health.get("sdc_mismatches"))}


def _named_hosts(found: Any) -> str:
    """"host (rank N), ..." of the ranks a job's health checks named (tasks/train/health.py),
    each once, in the order first named."""
    named: list[str] = []
    for item in found if isinstance(found, list) else []:
        if not isinstance(item, dict):
            continue
        ranks, hosts = item.get("ranks") or [item.get("rank")], list(item.get("hosts") or [item.get("host")])
        for rank, host in zip(ranks, hosts + [""] * (len(ranks) - len(hosts))):
            label = f"{host or '?'} (rank {rank})"
            if rank is not None and label not in named:
                named.append(label)
    return ", ".join(named)


_FIELD_NAMES = frozenset(JobEvent.__dataclass_fields__)
