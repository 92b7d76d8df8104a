"""One record schema for job events, and what a job's accelerator-hours and cost are.

A job's life in the ledger is a few events, one row each (see llmops.infra.ledger for the columns):

    submitted    the first try of a task started the job
    retried      a later try of the task started a new attempt of it (the earlier one failed or
                 was stopped; the backend resumes it from its checkpoints)
    reattached   a try found the job an earlier try started, running or finished, and watches it
    continued    the same try started the next attempt after one ended for a reason that attempt
                 fixes by going on from the checkpoint (MaxRuntime, capacity, spot, host, internal
                 error: llmops.jobs.continuation)
    ended        the attempt reached succeeded / failed / stopped, with the reason
    cached       a task reused the outputs of the finished job `job_name` instead of running one
                 (the step cache, or `from_run`); `run_id` / `task_id` are the reusing task's.
                 Nothing ran: no hours, no cost (only `ended` rows are charged)

`event_id` is a hash of (job name, attempt, event, try): recording the same event twice (a task
that defers again, a triggerer restart) replaces the row instead of counting it twice, and an
attempt's `ended` row is unique, so its accelerator-hours are counted once.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
EVENTS = ("submitted", "retried", "reattached", "continued", "ended", "cached")
PRICES_FILE = Path(__file__).with_name("prices.json")


@dataclass(kw_only=True)
class JobEvent:
    event: str                         # one of EVENTS
    job_name: str                      # the spec's name (deterministic per task instance)
    attempt: int = 1                   # the backend's attempt of that name (a new one per resubmit)
    recorded_at: float = 0.0           # epoch seconds; 0 = now
    spec_hash: str = ""                # job_identity: everything that changes what the job computes
    stage: str = ""
    backend: str = ""
    service_job_name: str = ""         # the name the service knows (SageMaker: with the attempt)
    image: str = ""
    image_digest: str = ""             # sha256:... when the image is pinned or the service says
    team: str = ""
    dag_id: str = ""
    run_id: str = ""
    task_id: str = ""
    map_index: int = -1
    try_number: int = 0
    instance_type: str = ""
    instance_count: int = 1
    accelerators_per_instance: int | None = None  # None = the type is not in prices.json
    submitted_at: float | None = None  # epoch seconds, when this attempt was submitted
    started_at: float | None = None    # ... when it started running (the backend's report)
    ended_at: float | None = None      # ... when it ended (ended events)
    queue_seconds: float | None = None  # started_at - submitted_at
    state: str = ""                    # pending, running, succeeded, failed, stopped
    failure_reason: str = ""           # the backend's message for a failed or stopped attempt
    instance_hours: float = 0.0        # running hours x instance count (ended events)
    accelerator_hours: float | None = None  # instance_hours x accelerators; None = count unknown
    usd_per_instance_hour: float | None = None  # from prices.json; None = type not listed
    estimated_cost_usd: float | None = None
    goodput: float | None = None       # the job's reported goodput share (pretraining)
    badput_seconds: float | None = None  # its non-productive seconds, when the result says
    # What the service bills per instance for the attempt, when it says (SageMaker's
    # BillableTimeInSeconds: from Downloading to the end of Uploading, managed spot's discount
    # applied); None: it does not say, and the running time is what is charged.
    billed_seconds: float | None = None
    straggler_hosts: str = ""          # the hosts (ranks) the job named stragglers, comma-separated
    sdc_hosts: str = ""                # ... whose replica checksums disagreed (silent corruption)
    mlflow_run_id: str = ""
    schema_version: int = SCHEMA_VERSION
    event_id: str = ""

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise ValueError(f"JobEvent.event must be one of {EVENTS}, got {self.event!r}.")
        if not self.job_name:
            raise ValueError("JobEvent.job_name is required.")
        self.recorded_at = self.recorded_at or time.time()
        if not self.event_id:
            again = self.try_number if self.event in ("retried", "reattached") else 0
            if self.event == "cached":  # one job reused by many tasks: one row per reusing task
                again = f"{self.dag_id}/{self.run_id}/{self.task_id}/{self.map_index}"
            key = "\x1f".join((self.job_name, str(self.attempt), self.event, str(again)))
            self.event_id = hashlib.sha256(key.encode()).hexdigest()[:32]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def event_time(row: dict[str, Any]) -> float:
    """When the event happened: an attempt's end for `ended` (the same on every re-record, so
    its Parquet file keeps its dt= partition and is replaced), else when it was recorded."""
    if row["event"] == "ended" and row.get("ended_at") is not None:
        return float(row["ended_at"])
    return float(row["recorded_at"])


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(JobEvent))
TIME_FIELDS = ("recorded_at", "submitted_at", "started_at", "ended_at")


def arrow_schema():
    """The Parquet schema (pyarrow, imported here only: the ledger's SQLite side needs none)."""
    import pyarrow as pa

    kinds = {int: pa.int64(), float: pa.float64(), str: pa.string()}
    hints = {f.name: f.type for f in dataclasses.fields(JobEvent)}
    columns = []
    for name in FIELDS:
        if name in TIME_FIELDS:
            columns.append(pa.field(name, pa.timestamp("ms", tz="UTC")))
            continue
        hint = str(hints[name]).split(" |")[0]
        columns.append(pa.field(name, kinds[{"int": int, "float": float, "str": str}[hint]]))
    return pa.schema(columns)


# -- accelerator-hours and cost ----------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def price_table() -> dict[str, Any]:
    return json.loads(PRICES_FILE.read_text())


def instance_rate(instance_type: str) -> tuple[int | None, float | None]:
    """(accelerators per instance, USD per instance-hour) of an instance type; None = unknown.

    EC2 names (Batch, HyperPod without the ml. prefix) take the ml. type's row.
    """
    table = price_table()
    if instance_type in ("", "local"):
        row = table["local"]
    else:
        instances = table["instances"]
        row = instances.get(instance_type) or instances.get(f"ml.{instance_type}")
    if row is None:
        return None, None
    return int(row["accelerators"]), float(row["usd_per_hour"])


def with_usage(event: JobEvent) -> JobEvent:
    """The ended event with its instance-hours, accelerator-hours and estimated cost filled in.

    Running time is started_at..ended_at (queueing is not billed); an attempt whose start is
    unknown (it never ran) counts 0 hours. The cost is the service's billed time where it reports
    one (billed_seconds), else the running time, at the table's on-demand price. Accelerators per instance: the backend's count when the
    caller set one (HyperPod's gpus_per_node), else prices.json's; a type in neither has unknown
    accelerator-hours and cost (None), never a guess.
    """
    accelerators, price = instance_rate(event.instance_type)
    if event.accelerators_per_instance is None:
        event.accelerators_per_instance = accelerators
    if event.submitted_at is not None and event.started_at is not None:
        event.queue_seconds = max(0.0, event.started_at - event.submitted_at)
    elif event.event == "ended" and event.submitted_at is not None and event.ended_at is not None:
        # Never started (stopped at max_queue_seconds, cancelled while queued): all of it queued.
        event.queue_seconds = max(0.0, event.ended_at - event.submitted_at)
    if event.event == "cached":  # nothing ran: explicitly free, not "unknown"
        event.instance_hours, event.accelerator_hours, event.estimated_cost_usd = 0.0, 0.0, 0.0
        return event
    if event.event != "ended":
        return event
    hours = 0.0
    if event.started_at is not None and event.ended_at is not None:
        hours = max(0.0, event.ended_at - event.started_at) / 3600
    event.instance_hours = hours * event.instance_count
    if event.accelerators_per_instance is not None:
        event.accelerator_hours = event.instance_hours * event.accelerators_per_instance
    event.usd_per_instance_hour = price
    billed_hours = (hours if event.billed_seconds is None else event.billed_seconds / 3600) * event.instance_count
    event.estimated_cost_usd = None if price is None else billed_hours * price
    return event


def image_digest(image: str, details: dict[str, Any] | None = None) -> str:
    """sha256:... from the status details (a service that reports it) or a pinned image URI."""
    reported = str((details or {}).get("image_digest") or "")
    if reported:
        return reported
    return image.rpartition("@")[2] if "@sha256:" in image else ""
