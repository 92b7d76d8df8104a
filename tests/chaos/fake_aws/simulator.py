"""AWS that fails: a fault-injecting proxy and a job-lifecycle simulator in front of moto.

    python -m tests.chaos.fake_aws --port 4566 --workdir /tmp/fake-aws [--moto-port 4567]

One process, two servers: moto (5.2.5, `ThreadedMotoServer`) on the moto port, and in front of it
on `--port` an HTTP proxy that every AWS client (Airflow, the backends) is pointed at through its
connection's `endpoint_url`. Control calls live on the same port under `/_chaos/`; `ChaosClient`
below wraps them.

What is real moto, untouched: every request and answer that no fault rule and no simulated
operation below touches, byte for byte (S3, IAM, STS, job definitions and queues, CloudWatch Logs
reads, request validation and storage of every Create/Submit call). botocore signs requests for
the proxy's host; moto does not check signatures, so forwarding needs no re-signing.

What is simulated here, because moto does not do it:
- Faults (`POST /_chaos/faults`): throttling, 500, 503, connection resets (RST via SO_LINGER 0)
  and read timeouts, all before the request goes on, and lost responses (`lost`: the request is
  handled, a job is created, submitted or stopped, then the connection is reset without an
  answer, so botocore sends the same request again, as after a read timeout on AWS), on
  operations picked by name or glob, with a rate, a window and a count;
  `origin` ("clients", the default; "jobs"; "*") says whose calls it touches (see below);
  `jobs` (globs) narrows a rule to calls about jobs whose name or a tag `key=value` matches
  (`"llmops:stage=pretrain"`): the job a Describe/Stop/Terminate names, the jobs a Batch
  DescribeJobs lists, the job whose log stream GetLogEvents reads, the job a
  CreateTrainingJob/SubmitJob makes (by the tags in its request); a call about no known job
  (S3, a ListJobs without a name) never fires such a rule, so a row can throttle its own jobs
  while others run beside it. Resets are not logged as errors (no traceback per reset).
  Error bodies are in each service's protocol (JSON: SageMaker, Logs; REST-JSON: Batch; REST-XML:
  S3; query: STS/IAM), so botocore's retry handler classifies them as it would AWS's.
- SageMaker training jobs: moto stores the job (and says Completed at once); the simulator keeps
  the real lifecycle. InProgress/Starting for `pending_seconds`, Downloading (channels from S3
  into an /opt/ml layout on each instance's own disk, tests/aws_fixtures.training_container),
  Training (the image's entry, docker/job_entry.py, one subprocess per instance with its own
  process group; several instances with torch_distributed under torchrun, as the toolkit runs
  it), Uploading (every instance's checkpoints back to CheckpointConfig.S3Uri), then Completed
  (every instance done), Failed (FailureReason from the log's tail) or Stopped. StopTrainingJob (moto: HTTP 500) and MaxRuntimeInSeconds are handled
  here; a duplicate job name is refused with ResourceInUse as SageMaker does (moto accepts it).
  Describe/ListTrainingJobs answers are moto's with the status fields rewritten.
- AWS Batch jobs: moto stores the job (finished at once with use_docker false); the simulator
  runs SUBMITTED -> RUNNABLE (`pending_seconds`) -> STARTING -> RUNNING -> SUCCEEDED/FAILED,
  one entry process per node (AWS_BATCH_JOB_* set as Batch sets them, node 0 the main node on
  127.0.0.1), enforces timeout.attemptDurationSeconds, and handles TerminateJob/CancelJob.
  DescribeJobs/ListJobs are rewritten with the status, times, exit code and log streams.
- CloudWatch Logs lines: the containers' stdout/stderr are written, as they come, into moto's
  Logs (`/aws/sagemaker/TrainingJobs` `<job>/algo-1-<epoch>`; `/aws/batch/job`
  `<definition>/default/<job id>-node<i>`), so GetLogEvents through the proxy sees them live.
- Late log lines (`log_delay_seconds`, config): each line reaches CloudWatch that long after the
  container printed it, so a job's last lines arrive after Describe* already says it ended, as
  the awslogs driver's and SageMaker's batched delivery do.
- Capacity waits (`capacity_wait_seconds`): a job first stays queued that long for want of
  instances, saying so as the services do (Batch RUNNABLE with statusReason
  `CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY - ...`, SageMaker Starting with the StatusMessage
  "Insufficient capacity error from EC2 while launching instances, retrying!").
- Eventual consistency (`consistency_seconds`, config): for that long after its create/submit a
  job is unknown to DescribeTrainingJob (ValidationException "Requested resource not found."),
  left out of Batch DescribeJobs (as an unknown id is: an empty list) and missing from
  ListTrainingJobs / ListJobs. Its Stop/Terminate and the create's name check see it at once.
- Spot reclaims (`/_chaos/jobs/<name>/reclaim`): a SageMaker managed spot job gets SIGTERM,
  shows SecondaryStatus Interrupted and restarts inside the same job on fresh disks with its
  synced checkpoints, while MaxWaitTimeInSeconds allows (else Stopped, MaxWaitTimeExceeded); a
  Batch job's main node's host is terminated (Batch runs multi-node jobs on on-demand only).
- Service-side events: `/_chaos/jobs/<name>/fail` (the container crashes), `/stop` (stopped from
  the console), `/host` (node N's host dies: its container killed, the attempt failed),
  `fail_first_attempt` (the host of a job's first attempt dies).
- Disks: every node of a job (Batch node, SageMaker instance) has its own work dir and TMPDIR,
  and every new attempt starts on empty ones: only S3 (and MLflow) outlive a node.
The containers' own AWS calls (their checkpoint uploads, result writes) go through a second proxy
port (`FakeAws.jobs_url`, their AWS_ENDPOINT_URL): a rule touches them only when its `origin` is
"jobs" (or "*"), e.g. `{"operations": ["PutObject", "UploadPart"], "kind": "throttle",
"origin": "jobs", "seconds": 30}` answers S3's 503 SlowDown to their uploads; rules without an
origin touch only the clients' port, as before. A rule narrowed to `jobs` may time its window
per job instead (`"per_job_seconds": 60`): each job meets it for that long from the first call
about that job the rule matched. Their calls are counted apart (the report's
`job_operations`). SageMaker's own checkpoint sync (the service's traffic) reaches moto directly.
HyperPod pods (fake_eks) get the endpoint their harness passes. Jobs belong to
this process, not to the client: they keep running when Airflow dies, and end when this stops.

Not simulated: SageMaker Processing jobs (moto's Completed-at-once), RetryStrategy/retryStrategy,
waiting for spot capacity after a reclaim (the restart follows at once), warm pools, model.tar.gz upload, Batch fair-share scheduling, pagination
changes, eventual consistency of Stop/Terminate/ListTags (they see a new job at once), a lag on
the jobs' own S3 reads after their writes.
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import functools
import http.client
import json
import logging
import math
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from tests.aws_fixtures import (CONTAINER_ENV, ENTRY, REGION, ROOT, free_port, image_root, kill_container,
                                sync_checkpoints, training_container)

log = logging.getLogger("fake_aws")
KINDS = ("throttle", "500", "503", "reset", "timeout", "lost")
ORIGINS = ("clients", "jobs", "*")   # whose calls a rule touches (see FakeAws.jobs_url)
DEFAULT_CONFIG = {"pending_seconds": 2.0,      # Starting / RUNNABLE before a container runs
                  "stop_grace_seconds": 5.0,   # SIGTERM, then SIGKILL after this
                  "stopping_seconds": 1.0,     # Stopping lasts this long after the container ended
                  "fail_first_attempt": False,  # the first job of each name (without -rN) dies
                  "fail_after_seconds": 1.0,   # ... this long after it started running
                  "capacity_wait_seconds": 0.0,  # queued this long first, held for capacity
                  "consistency_seconds": 0.0,  # Describe*/List* do not see a new job this long
                  "log_delay_seconds": 0.0}  # a log line reaches CloudWatch this long after it was printed
# What the services say while a job waits for instances (AWS Batch's statusReason on RUNNABLE,
# SageMaker's StatusMessage on the Starting transition).
BATCH_CAPACITY = ("CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY - Service cannot fulfill the capacity "
                  "requested for instance type [p4d.24xlarge]")
SM_CAPACITY = "Insufficient capacity error from EC2 while launching instances, retrying!"
SM_GROUP, BATCH_GROUP = "/aws/sagemaker/TrainingJobs", "/aws/batch/job"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION}


# -- which operation is this ---------------------------------------------------------------------

@dataclass(frozen=True)
class Call:
    service: str      # signing name: sagemaker, logs, batch, s3, sts, ...
    operation: str    # the API's operation name (S3: classified coarsely by method and path)
    protocol: str     # json | rest-json | rest-xml | query


@functools.cache
def _batch_paths() -> dict[str, str]:
    """Batch's REST paths (`/v1/describejobs`) to operation names, from botocore's model."""
    import botocore.session

    model = botocore.session.get_session().get_service_model("batch")
    return {model.operation_model(op).http["requestUri"].lower(): op for op in model.operation_names}


def identify(method: str, path: str, query: str, headers: Any, body: bytes) -> Call:
    scope = re.search(r"Credential=[^/]+/\d+/[^/]+/([^/]+)/", headers.get("Authorization", "") + query)
    service = scope.group(1) if scope else ""
    target = headers.get("X-Amz-Target", "")
    if target:  # JSON protocol: "SageMaker.DescribeTrainingJob", "Logs_20140328.GetLogEvents"
        prefix, _, operation = target.rpartition(".")
        return Call(service or prefix.split("_")[0].lower(), operation, "json")
    if path.startswith("/moto-api"):
        return Call("moto", "moto-api", "rest-json")
    if service == "batch" or path.lower() in _batch_paths():
        return Call("batch", _batch_paths().get(path.lower().rstrip("/"), path), "rest-json")
    if body.startswith(b"Action=") or b"&Action=" in body or "Action=" in query:
        action = parse_qs(body.decode(errors="replace") + "&" + query).get("Action", ["?"])[0]
        return Call(service or "sts", action, "query")
    return Call("s3", _s3_operation(method, path, parse_qs(query, keep_blank_values=True), headers),
                "rest-xml")


def _s3_operation(method: str, path: str, q: dict, headers: Any) -> str:
    bucket, _, key = path.lstrip("/").partition("/")
    if not bucket:
        return "ListBuckets"
    if key:
        if "uploadId" in q:
            return {"PUT": "UploadPart", "POST": "CompleteMultipartUpload",
                    "DELETE": "AbortMultipartUpload"}.get(method, "ListParts")
        if "uploads" in q:
            return "CreateMultipartUpload"
        if method == "PUT":
            return "CopyObject" if "x-amz-copy-source" in headers else "PutObject"
        return {"GET": "GetObject", "HEAD": "HeadObject", "DELETE": "DeleteObject"}.get(method, method)
    if method == "POST" and "delete" in q:
        return "DeleteObjects"
    if method == "GET":
        return "ListObjectsV2" if q.get("list-type") == ["2"] else (
            "GetBucketLocation" if "location" in q else "ListObjects")
    return {"HEAD": "HeadBucket", "PUT": "CreateBucket", "DELETE": "DeleteBucket"}.get(method, method)


# -- answers in each protocol's error shape ------------------------------------------------------

Answer = tuple[int, list[tuple[str, str]], bytes]
ERRORS = {  # kind -> protocol -> (HTTP status, error code, message), as AWS sends them
    "throttle": {"json": (400, "ThrottlingException", "Rate exceeded"),
                 "rest-json": (429, "TooManyRequestsException", "Too Many Requests"),
                 "rest-xml": (503, "SlowDown", "Please reduce your request rate."),
                 "query": (400, "Throttling", "Rate exceeded")},
    "500": {"*": (500, "InternalFailure", "We encountered an internal error. Please try again."),
            "rest-xml": (500, "InternalError", "We encountered an internal error. Please try again.")},
    "503": {"*": (503, "ServiceUnavailable", "Service is unavailable. Please try again later.")},
}


def error(protocol: str, status: int, code: str, message: str) -> Answer:
    request_id = str(uuid.uuid4())
    if protocol in ("json", "rest-json"):
        ctype = "application/x-amz-json-1.1" if protocol == "json" else "application/json"
        return status, [("Content-Type", ctype), ("x-amzn-RequestId", request_id),
                        ("x-amzn-ErrorType", code)], json.dumps({"__type": code, "message": message}).encode()
    if protocol == "rest-xml":
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}'
                f"</Message><RequestId>{request_id}</RequestId><HostId>fake</HostId></Error>")
        return status, [("Content-Type", "application/xml"), ("x-amz-request-id", request_id)], body.encode()
    body = (f"<ErrorResponse><Error><Type>{'Sender' if status < 500 else 'Receiver'}</Type><Code>{code}"
            f"</Code><Message>{message}</Message></Error><RequestId>{request_id}</RequestId></ErrorResponse>")
    return status, [("Content-Type", "text/xml"), ("x-amzn-RequestId", request_id)], body.encode()


def fault_answer(call: Call, kind: str) -> Answer:
    table = ERRORS[kind]
    return error(call.protocol, *table.get(call.protocol, table.get("*")))


def json_answer(call: Call, payload: Any, status: int = 200) -> Answer:
    ctype = "application/x-amz-json-1.1" if call.protocol == "json" else "application/json"
    return status, [("Content-Type", ctype), ("x-amzn-RequestId", str(uuid.uuid4()))], \
        json.dumps(payload, default=str).encode()


# -- fault rules ---------------------------------------------------------------------------------

@dataclass
class Rule:
    operations: list[str]
    kind: str
    rate: float = 1.0
    until: float | None = None          # time.time() after which the rule is inactive
    remaining: int | None = None        # injections left
    services: list[str] | None = None   # optional: only these services (signing names)
    jobs: list[str] | None = None       # optional: only calls about jobs whose name or tag matches
    hold_seconds: float = 70.0          # "timeout": how long the connection is held
    origin: str = "clients"             # whose calls: clients (the proxy port), jobs (the jobs' port), *
    rng: random.Random = field(default_factory=random.Random)
    # "per_job_seconds" (with "jobs"): each job meets the fault for that long from the first call
    # about it the rule matched, however late the job comes (a loaded machine can start a job
    # after a window counted from the row's start has closed, and the fault would not land).
    per_job_seconds: float | None = None
    first_call: dict[str, float] = field(default_factory=dict)   # job name -> when its window opened
    signature: str = ""                 # the rule minus its timing: its windows outlive a re-push

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Rule:
        allowed = {"operations", "kind", "rate", "seconds", "count", "seed", "services", "hold_seconds",
                   "jobs", "origin", "per_job_seconds"}
        if unknown := set(raw) - allowed:
            raise ValueError(f"unknown fault rule keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        if str(raw.get("kind")) not in KINDS:
            raise ValueError(f"fault kind {raw.get('kind')!r} is not one of {list(KINDS)}")
        if not raw.get("operations"):
            raise ValueError('a fault rule needs "operations": names or globs, "*" for all')
        if raw.get("origin", "clients") not in ORIGINS:
            raise ValueError(f"fault origin {raw.get('origin')!r} is not one of {list(ORIGINS)}")
        if raw.get("per_job_seconds") is not None and not raw.get("jobs"):
            raise ValueError('"per_job_seconds" needs "jobs": the window is counted per job')
        return cls(operations=list(raw["operations"]), kind=str(raw["kind"]),
                   rate=float(raw.get("rate", 1.0)),
                   until=time.time() + float(raw["seconds"]) if raw.get("seconds") is not None else None,
                   remaining=int(raw["count"]) if raw.get("count") is not None else None,
                   services=raw.get("services"), hold_seconds=float(raw.get("hold_seconds", 70.0)),
                   jobs=list(raw["jobs"]) if raw.get("jobs") else None,
                   origin=str(raw.get("origin", "clients")), rng=random.Random(raw.get("seed")),
                   per_job_seconds=(float(raw["per_job_seconds"]) if raw.get("per_job_seconds") is not None
                                    else None),
                   signature=json.dumps({k: v for k, v in raw.items() if k != "seconds"}, sort_keys=True,
                                        default=str))

    def fires(self, call: Call, keys: Callable[[], set[str]] = set, origin: str = "clients") -> bool:
        """`keys`: the names and `tag=value`s of the jobs the call is about (asked only when
        the rule has `jobs`); `origin`: whose call it is (clients or jobs)."""
        if self.until is not None and time.time() > self.until or self.remaining == 0:
            return False
        if self.origin not in ("*", origin):
            return False
        if self.services and call.service not in self.services:
            return False
        if not any(fnmatch.fnmatchcase(call.operation, pattern) for pattern in self.operations):
            return False
        if self.jobs and not any(fnmatch.fnmatchcase(k, g) for k in keys() for g in self.jobs):
            return False
        if self.per_job_seconds is not None:
            now = time.time()
            names = sorted(k for k in keys() if "=" not in k) or sorted(keys())
            opened = [self.first_call.setdefault(name, now) for name in names]
            if all(now > start + self.per_job_seconds for start in opened):
                return False
        return self.rng.random() < self.rate


class Faults:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rules: list[Rule] = []
        self.injections: list[dict[str, Any]] = []
        self.first_calls: dict[str, dict[str, float]] = {}   # rule signature -> its per-job windows

    def set(self, raw_rules: list[dict[str, Any]]) -> None:
        rules = [Rule.parse(r) for r in raw_rules]   # all or nothing: a bad rule changes nothing
        with self.lock:
            # the same rule pushed again (another row's rules changed) keeps its jobs' windows
            for rule in rules:
                rule.first_call = self.first_calls.setdefault(rule.signature, {})
            self.rules = rules

    def pick(self, call: Call, keys: Callable[[], set[str]] = set, origin: str = "clients") -> Rule | None:
        """The first rule that fires for this call (counted and recorded), or None."""
        keys = functools.cache(keys)
        with self.lock:
            for index, rule in enumerate(self.rules):
                if rule.fires(call, keys, origin):
                    if rule.remaining is not None:
                        rule.remaining -= 1
                    # "about": the jobs a narrowed rule matched the call to (which half of a
                    # row an S3 upload belongs to cannot be told by its service)
                    self.injections.append({"at": time.time(), "service": call.service,
                                            "operation": call.operation, "kind": rule.kind, "rule": index,
                                            "origin": origin,
                                            "about": sorted(k for k in keys() if "=" not in k) if rule.jobs else []})
                    log.info("injecting %s into %s %s", rule.kind, call.service, call.operation)
                    return rule
        return None


# -- the job simulator ---------------------------------------------------------------------------

BILLED_STATUSES = ("Downloading", "Training", "Uploading")   # SageMaker's billed secondary statuses
SPOT_BILLED_SHARE = 0.3    # a managed spot job's billed share of its on-demand time (simulated)

@dataclass
class Job:
    service: str                         # sagemaker | batch
    name: str
    job_id: str                          # TrainingJobArn | Batch jobId
    request: dict[str, Any]
    workdir: Path
    status: str
    secondary: str = ""
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None      # training / RUNNING began
    ended_at: float | None = None
    exit_code: int | None = None
    reason: str = ""                     # FailureReason / statusReason
    end_request: tuple[str, str] | None = None  # (why, reason): client|service|deadline|crash|host
    stop_requests: list[dict[str, Any]] = field(default_factory=list)
    stopped_by: str | None = None
    streams: list[str] = field(default_factory=list)
    log_lines: int = 0
    procs: list[subprocess.Popen] = field(default_factory=list)   # one per node (SageMaker: algo-1)
    pumps: list[threading.Thread] = field(default_factory=list)     # their log readers
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=15))
    wake: threading.Event = field(default_factory=threading.Event)
    transitions: list[dict[str, Any]] = field(default_factory=list)   # SageMaker's secondary ones
    synced: dict = field(default_factory=dict)   # checkpoint files already synced to S3 (SageMaker)
    node_ended_at: dict = field(default_factory=dict)   # node index -> when its container exited
    reclaims: int = 0                    # spot interruptions (SageMaker: the job restarted inside)

    def move(self, status: str, secondary: str = "") -> None:
        """Change the status (the simulator's lock held), keeping SecondaryStatusTransitions."""
        self.status = status
        if self.service == "sagemaker" and secondary != self.secondary:
            now = time.time()
            if self.transitions:
                self.transitions[-1]["EndTime"] = now
            self.transitions.append({"Status": secondary, "StartTime": now,
                                     "StatusMessage": f"{secondary} (simulated by fake_aws)"})
            self.secondary = secondary

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    def billing(self) -> dict[str, int]:
        """An ended SageMaker job's TrainingTimeInSeconds and BillableTimeInSeconds: whole seconds
        in Downloading, Training and Uploading (instance start-up and spot interruptions are not
        billed); managed spot billed at SPOT_BILLED_SHARE of that (simulated: AWS's savings vary
        by instance type and hour)."""
        seconds = sum((t.get("EndTime") or self.ended_at or time.time()) - t["StartTime"]
                      for t in self.transitions if t["Status"] in BILLED_STATUSES)
        spot = bool(self.request.get("EnableManagedSpotTraining"))
        return {"TrainingTimeInSeconds": math.ceil(seconds),
                "BillableTimeInSeconds": math.ceil(seconds * (SPOT_BILLED_SHARE if spot else 1.0))}

    def report(self) -> dict[str, Any]:
        return {"service": self.service, "name": self.name, "job_id": self.job_id, "status": self.status,
                "secondary": self.secondary, "reason": self.reason, "created_at": self.created_at,
                "started_at": self.started_at, "ended_at": self.ended_at, "exit_code": self.exit_code,
                "stop_requests": list(self.stop_requests), "stopped_by": self.stopped_by,
                "log_lines": self.log_lines, "streams": list(self.streams), "reclaims": self.reclaims,
                "node_ended_at": [self.node_ended_at.get(i) for i in range(len(self.procs))]}


class LogSink:
    """One CloudWatch stream in moto, fed line by line; flushed every 0.25 s by the simulator."""

    def __init__(self, logs: Any, group: str, stream: str):
        self.logs, self.group, self.stream = logs, group, stream
        self.buffer: list[dict[str, Any]] = []
        self.closed = False   # its container has exited: nothing more will be added
        self.lock = threading.Lock()
        try:
            logs.create_log_group(logGroupName=group)
        except logs.exceptions.ResourceAlreadyExistsException:
            pass
        logs.create_log_stream(logGroupName=group, logStreamName=stream)

    def add(self, line: str) -> None:
        with self.lock:  # CloudWatch refuses empty messages
            self.buffer.append({"timestamp": int(time.time() * 1000), "message": line.rstrip("\n") or " "})

    def flush(self, min_age: float = 0.0) -> None:
        """Put the lines printed at least `min_age` seconds ago into CloudWatch."""
        cut = int((time.time() - min_age) * 1000)
        with self.lock:
            events = [e for e in self.buffer if e["timestamp"] <= cut]
            self.buffer = self.buffer[len(events):]
        for start in range(0, len(events), 1000):
            self.logs.put_log_events(logGroupName=self.group, logStreamName=self.stream,
                                     logEvents=events[start:start + 1000])


class Simulator:
    def __init__(self, moto_url: str, workdir: Path):
        import boto3

        self.moto_url, self.workdir = moto_url, workdir
        kw = dict(endpoint_url=moto_url, region_name=REGION, aws_access_key_id="testing",
                  aws_secret_access_key="testing")
        self.s3, self.logs = boto3.client("s3", **kw), boto3.client("logs", **kw)
        self.config = dict(DEFAULT_CONFIG)
        self.lock = threading.RLock()
        self.jobs: dict[str, Job] = {}           # SageMaker name or Batch jobId -> Job
        self.first_attempts: set[str] = set()    # names whose first attempt was seen
        self.sinks: list[LogSink] = []
        self.jobs_url = ""   # the proxy port the containers use (FakeAws.jobs_url)
        # Jobs another simulator runs whose containers' S3 traffic comes through the jobs port
        # (tests/chaos/fake_eks.py's pods): (name, its `tag=value`s), so a rule narrowed to a
        # run's jobs reaches their checkpoint uploads too.
        self.foreign_jobs: Callable[[], list[tuple[str, set[str]]]] = list
        self.closing = threading.Event()
        threading.Thread(target=self._flush_logs, daemon=True, name="fake-aws-logs").start()

    # -- control ---------------------------------------------------------------------------------
    def configure(self, **changes: Any) -> dict[str, Any]:
        if unknown := set(changes) - set(DEFAULT_CONFIG):
            raise ValueError(f"unknown config keys {sorted(unknown)}; allowed: {sorted(DEFAULT_CONFIG)}")
        with self.lock:
            self.config.update({k: type(DEFAULT_CONFIG[k])(v) for k, v in changes.items()})
            return dict(self.config)

    def find(self, name: str) -> Job | None:
        with self.lock:
            found = [j for j in self.jobs.values() if name in (j.name, j.job_id)]
            return max(found, key=lambda j: j.created_at) if found else None

    def end(self, job: Job, why: str, reason: str = "", user_agent: str | None = None,
            operation: str = "") -> bool:
        """Ask a job to end (client stop, console stop, crash, deadline); False if it had ended."""
        with self.lock:
            if user_agent is not None:
                job.stop_requests.append({"at": time.time(), "user_agent": user_agent,
                                          "operation": operation, "reason": reason})
            if job.ended or job.end_request:
                return False
            job.end_request = (why, reason)
            if job.service == "sagemaker" and why in ("client", "service"):
                job.move("Stopping", "Stopping")
        job.wake.set()
        return True

    def lose_host(self, job: Job, node: int) -> bool:
        """Node `node`'s host dies now: its container is killed without a signal to catch, and
        the attempt ends as the service ends it (Batch: FAILED, host terminated; SageMaker:
        Failed, internal error). Its disk goes with it: a new attempt gets fresh ones."""
        with self.lock:
            procs = list(job.procs)
        if not 0 <= node < len(procs):
            raise ValueError(f"job {job.name} has {len(procs)} running nodes, not node {node}")
        _kill_group(procs[node], 0)
        return self.end(job, "host", f"node {node}'s host terminated")

    def reclaim(self, job: Job) -> bool:
        """EC2 takes the job's spot capacity back now. SageMaker managed spot: the containers get
        SIGTERM (the two-minute notice, here stop_grace_seconds), what they checkpointed is synced,
        the job shows SecondaryStatus Interrupted and restarts inside the same job on fresh disks
        with its checkpoints downloaded, while MaxWaitTimeInSeconds (from its creation) allows;
        else it ends Stopped, MaxWaitTimeExceeded. Batch (on-demand only: multi-node parallel
        jobs cannot run on Spot): the main node's host is terminated (lose_host)."""
        if job.service == "batch":
            return self.lose_host(job, 0)
        if not job.request.get("EnableManagedSpotTraining"):
            raise ValueError(f"training job {job.name} is not a managed spot job: nothing to reclaim")
        with self.lock:
            if job.ended or job.end_request or not job.procs:
                return False
            job.end_request = ("reclaim", "")
            job.reclaims += 1
        job.wake.set()
        return True

    def report(self) -> list[dict[str, Any]]:
        with self.lock:
            return [j.report() for j in sorted(self.jobs.values(), key=lambda j: j.created_at)]

    def keys(self, call: Call, body: bytes, path: str = "") -> set[str]:
        """Names and `tag=value`s of the known jobs a call is about (for rules with `jobs`). An S3
        call is about the jobs whose staging prefix (`.../<job name>/...`, shared by a job's
        attempts, where its checkpoints live) its path is under."""
        if call.service == "s3":
            with self.lock:
                known = [(job.name, _tag_pairs(job.request)) for job in self.jobs.values()]
            return {item for name, tags in known + self.foreign_jobs()
                    if f"/{re.sub(r'-r[0-9]+$', '', name)}/" in path for item in (name, *tags)}
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            return set()
        if not isinstance(request, dict):
            return set()
        refs: set[str] = set()
        streams: set[str] = set()
        if call.service == "sagemaker":
            refs.update(str(request[k]) for k in ("TrainingJobName",) if request.get(k))
            if request.get("NameContains"):
                with self.lock:
                    refs.update(j.name for j in self.jobs.values() if request["NameContains"] in j.name)
        elif call.service == "batch":
            refs.update(str(i).split("#")[0] for i in request.get("jobs") or [])
            refs.update(str(request[k]) for k in ("jobId", "jobName") if request.get(k))
            for flt in request.get("filters") or []:
                if flt.get("name") == "JOB_NAME":
                    refs.update(str(v).rstrip("*") for v in flt.get("values") or [])
        elif call.service == "logs":
            streams.update(str(v) for v in request.get("logStreamNames") or [])
            streams.update(str(request[k]) for k in ("logStreamName", "logStreamNamePrefix") if request.get(k))
        out: set[str] = set()
        with self.lock:
            for job in self.jobs.values():
                if job.name in refs or job.job_id in refs or any(
                        s == t or (len(s) > 8 and t.startswith(s)) for s in streams for t in job.streams):
                    out.add(job.name)
                    out.update(_tag_pairs(job.request))
        if call.operation in ("CreateTrainingJob", "SubmitJob"):
            # A create is about the job it makes, which is not known yet: its own tags say whose
            # it is (so that a row can lose the answers to its own creates only).
            out.update(_tag_pairs(request))
        return out | {r for r in refs if r}

    def shutdown(self) -> None:
        self.closing.set()
        with self.lock:
            jobs = list(self.jobs.values())
        for job in jobs:
            for proc in job.procs:
                _kill_group(proc, 0)

    # -- the API ---------------------------------------------------------------------------------
    def handle(self, call: Call, body: bytes, forward: Callable[[bytes], Answer], user_agent: str) -> Answer:
        handler = getattr(self, f"_{call.service}_{call.operation}", None)
        return handler(call, body, forward, user_agent) if handler else forward(body)

    def _sagemaker_CreateTrainingJob(self, call, body, forward, user_agent):
        request = json.loads(body)
        name = request["TrainingJobName"]
        if name in self.jobs:  # moto would accept a second job of the same name
            return error("json", 400, "ResourceInUse",
                         f"Training job names must be unique within an AWS account and region, and a "
                         f"training job with this name already exists ({name})")
        answer = forward(body)
        if answer[0] == 200:
            arn = json.loads(answer[2])["TrainingJobArn"]
            job = Job("sagemaker", name, arn, request, self._jobdir(name), "InProgress")
            job.move("InProgress", "Starting")
            self._start(job)
        return answer

    def unseen(self, job: Job | None) -> bool:
        """A job too new for Describe*/List* to show (`consistency_seconds`): the services' reads
        are eventually consistent after a create or submit."""
        return job is not None and time.time() < job.created_at + self.config["consistency_seconds"]

    def _sagemaker_DescribeTrainingJob(self, call, body, forward, user_agent):
        job = self.jobs.get(json.loads(body).get("TrainingJobName", ""))
        if self.unseen(job):   # SageMaker's answer for a job it does not know
            return error("json", 400, "ValidationException", "Requested resource not found.")
        status, headers, data = forward(body)
        if status != 200 or job is None:
            return status, headers, data
        described = json.loads(data)
        with self.lock:
            described.update(TrainingJobStatus=job.status, SecondaryStatus=job.secondary,
                             LastModifiedTime=time.time(),
                             SecondaryStatusTransitions=[dict(t) for t in job.transitions])
            for key, value in (("TrainingStartTime", job.started_at), ("TrainingEndTime", job.ended_at),
                               ("FailureReason", job.reason)):
                if value:
                    described[key] = value
                else:
                    described.pop(key, None)
            if job.ended:
                described.update(job.billing())
        return status, headers, json.dumps(described, default=str).encode()

    def _sagemaker_ListTrainingJobs(self, call, body, forward, user_agent):
        # moto filters by its own status (Completed): filter by the simulated one instead.
        request = json.loads(body or b"{}")
        wanted = request.pop("StatusEquals", None)
        status, headers, data = forward(json.dumps(request).encode())
        if status != 200:
            return status, headers, data
        listed = json.loads(data)
        summaries = []
        with self.lock:
            for summary in listed.get("TrainingJobSummaries", []):
                if self.unseen(job := self.jobs.get(summary["TrainingJobName"])):
                    continue
                if job:
                    summary.update(TrainingJobStatus=job.status, SecondaryStatus=job.secondary)
                    if job.ended_at:
                        summary["TrainingEndTime"] = job.ended_at
                    else:
                        summary.pop("TrainingEndTime", None)
                if wanted is None or summary["TrainingJobStatus"] == wanted:
                    summaries.append(summary)
        listed["TrainingJobSummaries"] = summaries
        return status, headers, json.dumps(listed, default=str).encode()

    def _sagemaker_StopTrainingJob(self, call, body, forward, user_agent):
        name = json.loads(body).get("TrainingJobName", "")
        job = self.jobs.get(name)
        if job is None:
            return error("json", 400, "ValidationException", "Requested resource not found.")
        with self.lock:
            status = job.status
            job.stop_requests.append({"at": time.time(), "user_agent": user_agent,
                                      "operation": "StopTrainingJob", "reason": ""})
        if status == "Stopping":
            return json_answer(call, {})  # SageMaker accepts a repeated stop while stopping
        if status != "InProgress":
            return error("json", 400, "ValidationException",
                         f"The request was rejected because the training job is in status {status}.")
        self.end(job, "client")
        return json_answer(call, {})

    def _batch_SubmitJob(self, call, body, forward, user_agent):
        answer = forward(body)
        if answer[0] == 200:
            request, submitted = json.loads(body), json.loads(answer[2])
            self._start(Job("batch", request["jobName"], submitted["jobId"], request,
                            self._jobdir(submitted["jobId"]), "SUBMITTED"))
        return answer

    def _batch_DescribeJobs(self, call, body, forward, user_agent):
        request = json.loads(body)
        # A job too new to be seen is left out of the answer, as Batch leaves out unknown ids.
        request["jobs"] = [i for i in request.get("jobs", []) if not self.unseen(self.jobs.get(i.split("#")[0]))]
        # A multi-node job's nodes are jobs of their own, `<id>#<node>`, which moto does not have.
        nodes = [n for n in (self._node_job(i) for i in request.get("jobs", []) if "#" in i) if n]
        rest = [i for i in request.get("jobs", []) if i not in {n["jobId"] for n in nodes}]
        if not rest:
            status, headers, described = 200, json_answer(call, {})[1], {"jobs": []}
        else:
            status, headers, data = forward(json.dumps({**request, "jobs": rest}).encode())
            if status != 200:
                return status, headers, data
            described = json.loads(data)
        for item in described.get("jobs", []):
            self._rewrite_batch(item, detail=True)
        described["jobs"] = described.get("jobs", []) + nodes
        return status, headers, json.dumps(described).encode()

    def _node_job(self, node_id: str) -> dict[str, Any] | None:
        parent_id, _, index = node_id.partition("#")
        job = self.jobs.get(parent_id)
        if job is None or not index.isdigit() or int(index) >= self._nodes(job):
            return None
        node = int(index)
        item = {"jobArn": f"arn:aws:batch:{REGION}:123456789012:job/{node_id}", "jobId": node_id,
                "jobName": job.name, "jobQueue": job.request.get("jobQueue", ""),
                "jobDefinition": job.request.get("jobDefinition", ""), "createdAt": int(job.created_at * 1000),
                "nodeDetails": {"nodeIndex": node, "isMainNode": node == 0}, "tags": {}}
        self._rewrite_batch(item, detail=False, job=job)
        with self.lock:
            container = {}
            if node < len(job.streams):
                container["logStreamName"] = job.streams[node]
            if node < len(job.procs) and job.procs[node].returncode is not None:
                code = job.procs[node].returncode
                container["exitCode"] = 128 - code if code < 0 else code
            item["container"] = container
        return item

    @staticmethod
    def _nodes(job: Job) -> int:
        return int(job.request.get("nodeOverrides", {}).get("numNodes", 1))

    def _batch_ListJobs(self, call, body, forward, user_agent):
        request = json.loads(body or b"{}")
        wanted = request.pop("jobStatus", None) if not request.get("filters") else None
        status, headers, data = forward(json.dumps(request).encode())
        if status != 200:
            return status, headers, data
        listed = json.loads(data)
        listed["jobSummaryList"] = [j for j in listed.get("jobSummaryList", [])
                                    if not self.unseen(self.jobs.get(j.get("jobId", "")))]
        for item in listed["jobSummaryList"]:
            self._rewrite_batch(item, detail=False)
        if wanted:
            listed["jobSummaryList"] = [j for j in listed["jobSummaryList"] if j["status"] == wanted]
        return status, headers, json.dumps(listed).encode()

    def _batch_TerminateJob(self, call, body, forward, user_agent, cancel: bool = False):
        answer = forward(body)   # moto checks the job and the reason
        request = json.loads(body)
        job = self.jobs.get(request.get("jobId", ""))
        if answer[0] == 200 and job is not None:
            reason = request.get("reason", "")
            # CancelJob only reaches jobs that have not started (a no-op after); TerminateJob all.
            if not cancel or job.status in ("SUBMITTED", "PENDING", "RUNNABLE"):
                self.end(job, "client", reason, user_agent, call.operation)
            else:
                with self.lock:
                    job.stop_requests.append({"at": time.time(), "user_agent": user_agent,
                                              "operation": call.operation, "reason": reason})
        return answer

    def _batch_CancelJob(self, call, body, forward, user_agent):
        return self._batch_TerminateJob(call, body, forward, user_agent, cancel=True)

    def _rewrite_batch(self, item: dict[str, Any], detail: bool, job: Job | None = None) -> None:
        job = job or self.jobs.get(item.get("jobId", ""))
        if job is None:
            return
        with self.lock:
            item["status"] = job.status
            item["statusReason"] = job.reason or item.get("statusReason", "")
            for key, value in (("startedAt", job.started_at), ("stoppedAt", job.ended_at)):
                if value:
                    item[key] = int(value * 1000)
                else:
                    item.pop(key, None)
            container = {**item.get("container", {})}
            container.pop("exitCode", None)
            if job.exit_code is not None:
                container["exitCode"] = job.exit_code
            if detail and job.streams:
                container["logStreamName"] = job.streams[0]
                # What BatchClientHook.get_job_all_awslogs_info reads for multi-node jobs: one
                # container per node in the attempt's taskProperties.
                attempt = {"taskProperties": [{"containers": [{"logStreamName": s}]} for s in job.streams],
                           "startedAt": int((job.started_at or job.created_at) * 1000)}
                if job.ended_at:
                    attempt.update(stoppedAt=int(job.ended_at * 1000), statusReason=job.reason)
                item["attempts"] = [attempt]
            elif detail:
                item["attempts"] = []
            item["container"] = container

    # -- running a job -----------------------------------------------------------------------------
    def _jobdir(self, key: str) -> Path:
        path = self.workdir / "jobs" / re.sub(r"[^\w.-]", "_", key)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _start(self, job: Job) -> None:
        (job.workdir / "request.json").write_text(json.dumps(job.request, indent=2))
        with self.lock:
            self.jobs[job.name if job.service == "sagemaker" else job.job_id] = job
        log.info("%s job %s (%s) registered", job.service, job.name, job.job_id)
        threading.Thread(target=self._run, args=(job,), daemon=True, name=f"job-{job.name}").start()

    def _set(self, job: Job, status: str, secondary: str = "") -> None:
        with self.lock:
            if job.end_request and job.service == "sagemaker" and job.end_request[0] in ("client", "service"):
                return  # a stop request keeps Stopping until the job has ended
            job.move(status, secondary)
        log.info("%s job %s: %s %s", job.service, job.name, status, secondary)

    def _run(self, job: Job) -> None:
        sagemaker = job.service == "sagemaker"
        try:
            if not sagemaker:
                job.wake.wait(0.2)
                self._set(job, "RUNNABLE")
            held = self.config["capacity_wait_seconds"]
            woke = False
            if held > 0:   # no capacity for it yet: the service says so and keeps it queued
                self._hold_for_capacity(job, True)
                woke = job.wake.wait(held)
                self._hold_for_capacity(job, False)
            while not woke and not job.wake.wait(self.config["pending_seconds"]):
                self._set(job, *(("InProgress", "Downloading") if sagemaker else ("STARTING",)))
                commands = self._prepare_sagemaker(job) if sagemaker else self._prepare_batch(job)
                if not job.end_request:
                    self._execute(job, commands)
                if not self._restart_after_reclaim(job):
                    break
        except Exception as exc:  # a broken request or S3 layout: the job fails, the server lives
            log.exception("%s job %s could not run", job.service, job.name)
            job.tail.append(f"{type(exc).__name__}: {exc}")
            job.exit_code = job.exit_code if job.exit_code is not None else 1
        if sagemaker:
            with self.lock:
                job.move(job.status, "Uploading")
            try:
                sync_checkpoints(self.s3, job.request, job.workdir, job.synced)
            except Exception:
                log.exception("checkpoint sync of %s failed", job.name)
        self._finish(job)

    def _restart_after_reclaim(self, job: Job) -> bool:
        """After a spot reclaim (SageMaker): Interrupted, then True when the job starts again
        (fresh disks, Starting), False when MaxWaitTimeInSeconds is spent (it ends Stopped)."""
        if not job.end_request or job.end_request[0] != "reclaim":
            return False
        sync_checkpoints(self.s3, job.request, job.workdir, job.synced)   # what it saved goes up
        wait = job.request.get("StoppingCondition", {}).get("MaxWaitTimeInSeconds") or 0
        with self.lock:
            job.move("InProgress", "Interrupted")
            if time.time() >= job.created_at + wait:
                return False
            job.end_request, job.procs, job.pumps, job.synced, job.node_ended_at = None, [], [], {}, {}
            job.workdir = job.workdir.parent / f"{job.name}-spot{job.reclaims}"   # a new instance's disk
            job.workdir.mkdir(parents=True, exist_ok=True)
            job.wake.clear()
            job.move("InProgress", "Starting")
        log.info("sagemaker job %s: spot capacity reclaimed, restarting (%d)", job.name, job.reclaims)
        return True

    def _hold_for_capacity(self, job: Job, held: bool) -> None:
        """The service's own words while a job waits for instances (Batch's statusReason on a
        RUNNABLE job, SageMaker's StatusMessage on the Starting transition), or none."""
        with self.lock:
            if job.service == "sagemaker":
                if job.transitions:
                    job.transitions[-1]["StatusMessage"] = SM_CAPACITY if held else "Starting"
            elif not job.end_request:
                job.reason = BATCH_CAPACITY if held else ""

    def _prepare_sagemaker(self, job: Job) -> list[tuple[list[str], dict[str, str], LogSink]]:
        """One container per instance, each on its own disk (channels and checkpoints downloaded
        to each), as SageMaker runs a multi-instance job."""
        port, out = free_port(), []
        for host in range(job.request["ResourceConfig"]["InstanceCount"]):
            cmd, env = training_container(self.s3, job.request, job.workdir, self.moto_url,
                                          self._aws_env(), host=host, master_port=port)
            epoch = int(time.time())
            while any(s.endswith(f"/algo-{host + 1}-{epoch}") for s in job.streams):
                epoch += 1   # a restart within the same second (a spot reclaim)
            stream = f"{job.name}/algo-{host + 1}-{epoch}"
            out.append((cmd, env, self._sink(job, SM_GROUP, stream)))
        return out

    def _prepare_batch(self, job: Job) -> list[tuple[list[str], dict[str, str], LogSink]]:
        request = job.request
        nodes = self._nodes(job)
        overrides = dict(request.get("containerOverrides", {}))
        for node_override in request.get("nodeOverrides", {}).get("nodePropertyOverrides", []):
            overrides.update(node_override.get("containerOverrides", {}))
        command = list(overrides.get("command") or [])
        if not command:
            raise ValueError("the simulator needs the command in containerOverrides")
        # The image's /opt/llmops/job_entry.py is the repository's docker/job_entry.py.
        if len(command) > 1 and command[1].endswith("job_entry.py"):
            command[1] = str(image_root() / ENTRY.relative_to(ROOT))
        if command[0].startswith("python"):
            command[0] = sys.executable
        definition = request["jobDefinition"].rsplit("/", 1)[-1].split(":")[0]
        port = str(free_port())
        out = []
        for node in range(nodes):
            env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW_CONN_")}
            env.update(self._aws_env())
            env.update({e["name"]: e["value"] for e in overrides.get("environment", [])})
            env.update({"AWS_BATCH_JOB_ID": job.job_id + (f"#{node}" if nodes > 1 else ""),
                        "AWS_BATCH_JOB_ATTEMPT": "1", "AWS_BATCH_JQ_NAME": request.get("jobQueue", ""),
                        "AWS_BATCH_CE_NAME": "fake-aws", "AWS_BATCH_JOB_NUM_NODES": str(nodes),
                        "AWS_BATCH_JOB_NODE_INDEX": str(node), "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0",
                        "MASTER_PORT": port, "PYTHONPATH": str(image_root()),
                        # each node its own disk: nothing it writes is seen by another node
                        "LLMOPS_WORKDIR": str(job.workdir / f"node{node}"),
                        "TMPDIR": str(job.workdir / f"node{node}" / "tmp")})
            (job.workdir / f"node{node}" / "tmp").mkdir(parents=True, exist_ok=True)
            # Batch tells the other nodes the main node's address, and the main node nothing.
            env["AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS" if node else "MASTER_ADDR"] = "127.0.0.1"
            stream = f"{definition}/default/{job.job_id}-node{node}"
            out.append((command, env, self._sink(job, BATCH_GROUP, stream)))
        return out

    def _aws_env(self) -> dict[str, str]:
        # The containers' own calls (their checkpoints' S3 traffic) go through the jobs' proxy
        # port, where only rules with origin "jobs" touch them.
        url = self.jobs_url or self.moto_url
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": url, "AWS_ENDPOINT_URL_S3": url}

    def _sink(self, job: Job, group: str, stream: str) -> LogSink:
        sink = LogSink(self.logs, group, stream)
        with self.lock:
            job.streams.append(stream)
            self.sinks.append(sink)
        return sink

    def _execute(self, job: Job, commands: list[tuple[list[str], dict[str, str], LogSink]]) -> None:
        sagemaker = job.service == "sagemaker"
        with self.lock:
            for cmd, env, sink in commands:
                # Own session: a stop reaches the entry, the stage and anything they spawned; the
                # marker lets the container's end take what left the session too.
                marker = uuid.uuid4().hex
                proc = subprocess.Popen(cmd, env={**env, CONTAINER_ENV: marker}, cwd=str(job.workdir),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, errors="replace",
                                        bufsize=1, start_new_session=True)
                proc.container = marker
                job.procs.append(proc)
                job.pumps.append(threading.Thread(target=self._pump, args=(job, proc, sink), daemon=True))
                job.pumps[-1].start()
            job.started_at = time.time()
        self._set(job, *(("InProgress", "Training") if sagemaker else ("RUNNING",)))
        if sagemaker and job.request.get("CheckpointConfig"):
            threading.Thread(target=self._sync_checkpoints, args=(job,), daemon=True,
                             name=f"sync-{job.name}").start()
        runtime = (job.request.get("StoppingCondition", {}).get("MaxRuntimeInSeconds") if sagemaker
                   else job.request.get("timeout", {}).get("attemptDurationSeconds"))
        deadline = job.started_at + runtime if runtime else None
        first = re.sub(r"-r\d+$", "", job.name)
        with self.lock:
            doomed = self.config["fail_first_attempt"] and first == job.name and first not in self.first_attempts
            self.first_attempts.add(first)
        host_death = job.started_at + self.config["fail_after_seconds"] if doomed else None
        main = job.procs[0]

        def running() -> bool:
            # Batch ends a multi-node job with its main node; SageMaker when every host is done.
            return any(p.poll() is None for p in job.procs) if sagemaker else main.poll() is None

        while running() and not self.closing.is_set():
            now = time.time()
            if deadline and now > deadline:
                self.end(job, "deadline")
            if host_death and now > host_death:
                self.end(job, "host")
            if job.end_request:
                break
            job.wake.wait(0.2)
        if job.end_request:
            crash = job.end_request[0] in ("crash", "host")   # no grace: the container just dies
            for proc in job.procs:
                _kill_group(proc, 0 if crash else self.config["stop_grace_seconds"])
        else:
            # The main process ended by itself. Batch ends the job with its main node: the others
            # get the grace to finish. Whatever the entry left behind dies with its container.
            for proc in job.procs:
                try:
                    proc.wait(self.config["stop_grace_seconds"] if proc is not main else 0)
                except subprocess.TimeoutExpired:
                    pass
                _kill_group(proc, 0 if proc is main else self.config["stop_grace_seconds"])
        codes = [p.wait() for p in (job.procs if sagemaker else [main])]
        code = next((c for c in codes if c != 0), 0)
        job.exit_code = 128 - code if code < 0 else code   # killed by signal N: 128 + N, as Docker
        if job.end_request and job.end_request[0] in ("client", "service"):
            time.sleep(self.config["stopping_seconds"])

    def _sync_checkpoints(self, job: Job) -> None:
        """SageMaker uploads what appears in each instance's /opt/ml/checkpoints while the job
        runs (here every second), not only at the end: a host that dies loses nothing synced."""
        while not job.wake.wait(1.0) and not self.closing.is_set():
            if not any(p.poll() is None for p in job.procs):
                return
            try:
                sync_checkpoints(self.s3, job.request, job.workdir, job.synced)
            except Exception as exc:  # a file renamed or removed mid-sync: next round
                log.debug("checkpoint sync of %s: %s", job.name, exc)

    def _pump(self, job: Job, proc: subprocess.Popen, sink: LogSink) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.add(line)
            with self.lock:
                job.log_lines += 1
                job.tail.append(line.rstrip("\n"))
        with self.lock:   # its output closed: the node's container has exited
            job.node_ended_at[job.procs.index(proc)] = time.time()

    def _flush_logs(self) -> None:
        while not self.closing.wait(0.25):
            with self.lock:
                sinks = list(self.sinks)
            for sink in sinks:
                try:
                    sink.flush(self.config["log_delay_seconds"])
                except Exception:
                    log.exception("writing log lines to %s failed", sink.stream)
            with self.lock:   # an ended job's lines are all in: its sink is done
                self.sinks = [s for s in self.sinks if not (s.closed and not s.buffer)]

    def _finish(self, job: Job) -> None:
        for pump in job.pumps:   # they end when the container's output closes: its last lines
            pump.join(10)
        with self.lock:
            sinks = [s for s in self.sinks if s.stream in job.streams]
            for sink in sinks:
                sink.closed = True
            if not self.config["log_delay_seconds"]:
                self.sinks = [s for s in self.sinks if s not in sinks]
        if not self.config["log_delay_seconds"]:
            for sink in sinks:
                sink.flush()
        # else: the job's last lines reach CloudWatch after its status says it ended (_flush_logs)
        why, given = job.end_request or ("exit", "")
        tail = "\n".join(job.tail)
        sagemaker = job.service == "sagemaker"
        with self.lock:
            job.ended_at = time.time()
            job.stopped_by = {"client": "client", "service": "service", "deadline": "deadline"}.get(why)
            if sagemaker:
                status, secondary, job.reason = {
                    "client": ("Stopped", "Stopped", ""),
                    "service": ("Stopped", "Stopped", given),
                    "deadline": ("Stopped", "MaxRuntimeExceeded",
                                 "MaxRuntimeExceeded: Training job exceeded MaxRuntimeInSeconds provided"),
                    "crash": ("Failed", "Failed", "AlgorithmError: " + (given or "the training container crashed")),
                    "host": ("Failed", "Failed", "InternalServerError: We encountered an internal error. "
                                                 "Please try again."),
                    "reclaim": ("Stopped", "MaxWaitTimeExceeded",
                                "MaxWaitTimeExceeded: Training job exceeded MaxWaitTimeInSeconds provided"),
                }.get(why) or (("Completed", "Completed", "") if job.exit_code == 0 else
                               ("Failed", "Failed", f"AlgorithmError: exit code {job.exit_code}: {tail}"[:1024]))
                job.move(status, secondary)
                job.transitions[-1]["EndTime"] = job.ended_at
            else:
                job.status, job.reason = {
                    "client": ("FAILED", given),
                    "service": ("FAILED", given or "Terminated from the AWS Batch console"),
                    "deadline": ("FAILED", "Job attempt duration exceeded timeout"),
                    "crash": ("FAILED", given or "Essential container in task exited"),
                    "host": ("FAILED", "Host EC2 (instance i-0fa4e00000000000) terminated."),
                }.get(why) or ("SUCCEEDED" if job.exit_code == 0 else "FAILED",
                               "Essential container in task exited")
        log.info("%s job %s ended: %s %s", job.service, job.name, job.status, job.reason)


def _tag_pairs(request: dict[str, Any]) -> set[str]:
    """`key=value` for each tag of a create request (SageMaker's list of Key/Value, Batch's map)."""
    tags = request.get("Tags") or request.get("tags") or {}
    if isinstance(tags, list):
        tags = {t.get("Key"): t.get("Value") for t in tags if isinstance(t, dict)}
    return {f"{k}={v}" for k, v in tags.items()} if isinstance(tags, dict) else set()


def _kill_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the process group (the entry passes it on to the stage), SIGKILL what is left
    after `grace` seconds (at once with no grace: a crash, or a container that has ended) — the
    whole container: every process it started, whatever its session (kill_container)."""
    try:
        if grace > 0 and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    marker = getattr(proc, "container", None)
    if marker:
        kill_container(marker)


# -- the proxy -----------------------------------------------------------------------------------

HOP_HEADERS = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
               "upgrade", "expect", "content-length"}


class ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive, as botocore's connection pool expects
    timeout = 300                   # an idle keep-alive connection gives its thread back
    fake: FakeAws
    origin = "clients"   # "jobs" on the port the containers use

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug(fmt, *args)

    def do_any(self) -> None:
        body = self._read_body()
        url = urlsplit(self.path)
        if url.path.startswith("/_chaos/"):
            return self._send(self._control(url.path, body))
        call = identify(self.command, url.path, url.query, self.headers, body)
        self.fake.count(call, self.origin)
        rule = self.fake.faults.pick(call, lambda: self.fake.sim.keys(call, body, url.path), self.origin)
        if rule is None:
            answer = self.fake.sim.handle(call, body, self._forward, self.headers.get("User-Agent", ""))
            return self._send(answer)
        if rule.kind == "lost":
            # AWS accepted the request (moto and the simulator act on it); its answer never
            # reaches the client, which sees a reset and resends it.
            self.fake.sim.handle(call, body, self._forward, self.headers.get("User-Agent", ""))
        if rule.kind in ("reset", "lost"):
            # SO_LINGER 0: close() sends RST at once, as a dropped load balancer connection does.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        elif rule.kind == "timeout":
            self.fake.releasing.wait(rule.hold_seconds)   # no answer, then a plain close
        else:
            return self._send(fault_answer(call, rule.kind))
        self.close_connection = True

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = do_any

    def _read_body(self) -> bytes:
        if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))
        # botocore streams S3 uploads with checksums chunked; moto gets them with a length.
        chunks = []
        while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
            chunks.append(self.rfile.read(size))
            self.rfile.readline()
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
            pass
        return b"".join(chunks)

    def _forward(self, body: bytes) -> Answer:
        conn = http.client.HTTPConnection("127.0.0.1", self.fake.moto_port, timeout=300)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for key, value in self.headers.items():   # Host and the signature as the client sent them
                if key.lower() not in HOP_HEADERS:
                    conn.putheader(key, value)
            if body or self.command in ("POST", "PUT", "PATCH"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            response = conn.getresponse()
            data = response.read()
            keep = HOP_HEADERS - ({"content-length"} if self.command == "HEAD" else set())
            return response.status, [(k, v) for k, v in response.getheaders() if k.lower() not in keep], data
        finally:
            conn.close()

    def _send(self, answer: Answer) -> None:
        status, headers, data = answer
        self.send_response(status)
        length_sent = False
        for key, value in headers:
            if key.lower() not in ("date", "server"):
                self.send_header(key, value)
                length_sent |= key.lower() == "content-length"
        if not length_sent:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _control(self, path: str, body: bytes) -> Answer:
        call = Call("chaos", path, "rest-json")
        fake, method = self.fake, self.command
        try:
            payload = json.loads(body) if body.strip() else {}
            if path == "/_chaos/health":
                return json_answer(call, {"ok": True, "url": fake.url, "moto": fake.moto_url,
                                          "jobs": len(fake.sim.jobs)})
            if path == "/_chaos/report":
                return json_answer(call, fake.report())
            if path == "/_chaos/faults" and method in ("POST", "DELETE"):
                fake.faults.set(payload.get("rules", []) if method == "POST" else [])
                return json_answer(call, {"rules": len(fake.faults.rules)})
            if path == "/_chaos/config":
                return json_answer(call, fake.sim.configure(**payload) if method == "POST" else fake.sim.config)
            match = re.fullmatch(r"/_chaos/jobs/(.+)/host", path)
            if match and method == "POST":
                job = fake.sim.find(match.group(1))
                if job is None:
                    return json_answer(call, {"error": f"no simulated job {match.group(1)!r}"}, 404)
                ended = fake.sim.lose_host(job, int(payload.get("node", 0)))
                return json_answer(call, {"ended": ended, "job": job.report()})
            match = re.fullmatch(r"/_chaos/jobs/(.+)/reclaim", path)
            if match and method == "POST":
                job = fake.sim.find(match.group(1))
                if job is None:
                    return json_answer(call, {"error": f"no simulated job {match.group(1)!r}"}, 404)
                return json_answer(call, {"reclaimed": fake.sim.reclaim(job), "job": job.report()})
            match = re.fullmatch(r"/_chaos/jobs/(.+)/(fail|stop)", path)
            if match and method == "POST":
                job = fake.sim.find(match.group(1))
                if job is None:
                    return json_answer(call, {"error": f"no simulated job {match.group(1)!r}"}, 404)
                why = "crash" if match.group(2) == "fail" else "service"
                ended = fake.sim.end(job, why, str(payload.get("reason", "")))
                return json_answer(call, {"ended": ended, "job": job.report()})
            return json_answer(call, {"error": f"no control call {method} {path}"}, 404)
        except (ValueError, TypeError, KeyError) as exc:
            return json_answer(call, {"error": str(exc)}, 400)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False   # a held "timeout" connection must not block stop()
    request_queue_size = 128  # every Airflow process and its connection pool, at once

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A connection reset (injected here, or a client killed mid-request) is part of the
        # game: no traceback on stderr for it, a debug line.
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)) or (
                isinstance(exc, (OSError, ValueError)) and ("closed" in str(exc) or "Bad file" in str(exc))):
            log.debug("connection from %s ended: %r", client_address, exc)
            return
        super().handle_error(request, client_address)


class FakeAws:
    """moto plus the proxy and the simulator, in this process: `FakeAws(port, workdir).start()`."""

    def __init__(self, port: int, workdir: str | Path, moto_port: int | None = None, **config: Any):
        self.port, self.workdir = port, Path(workdir)
        self.moto_port = moto_port or free_port()
        self.config = config
        self.faults = Faults()
        self.operations: collections.Counter[str] = collections.Counter()
        self.job_operations: collections.Counter[str] = collections.Counter()   # the containers' calls
        self.jobs_port = free_port()
        self.lock = threading.Lock()
        self.releasing = threading.Event()   # set at stop: held connections let go

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def moto_url(self) -> str:
        return f"http://127.0.0.1:{self.moto_port}"

    @property
    def jobs_url(self) -> str:
        """The proxy port the simulated containers use (their AWS_ENDPOINT_URL): only rules with
        `origin` "jobs" (or "*") touch their calls, so the clients' rules never hit a job."""
        return f"http://127.0.0.1:{self.jobs_port}"

    def connection(self) -> dict[str, Any]:
        """The Airflow AWS connection that points a process at the proxy."""
        return {"conn_type": "aws", "login": "testing", "password": "testing",
                "extra": {"region_name": REGION, "endpoint_url": self.url}}

    def count(self, call: Call, origin: str = "clients") -> None:
        with self.lock:
            (self.job_operations if origin == "jobs" else self.operations)[call.operation] += 1

    def report(self) -> dict[str, Any]:
        with self.faults.lock, self.lock:
            injections, operations = list(self.faults.injections), dict(self.operations)
            job_operations = dict(self.job_operations)
        return {"jobs": self.sim.report(), "injections": injections, "operations": operations,
                "job_operations": job_operations}

    def start(self) -> FakeAws:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)   # moto's request log
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=self.moto_port, verbose=False)
        self.moto.start()
        # In-process moto keeps its state in module globals: a FakeAws started earlier in the same
        # process (another test) would leave its roles, queues and jobs behind. Start empty.
        urllib.request.urlopen(urllib.request.Request(
            f"{self.moto_url}/moto-api/reset", data=b"", method="POST"), timeout=10).read()
        # Batch jobs would need Docker in moto; the simulator runs them instead.
        urllib.request.urlopen(urllib.request.Request(
            f"{self.moto_url}/moto-api/config", data=json.dumps({"batch": {"use_docker": False}}).encode(),
            method="POST"), timeout=10).read()
        self.sim = Simulator(self.moto_url, self.workdir)
        self.sim.configure(**self.config)
        self.server = _Server(("127.0.0.1", self.port), type("Handler", (ProxyHandler,), {"fake": self}))
        threading.Thread(target=self.server.serve_forever, daemon=True, name="fake-aws-proxy").start()
        self.jobs_server = _Server(("127.0.0.1", self.jobs_port),
                                   type("JobsHandler", (ProxyHandler,), {"fake": self, "origin": "jobs"}))
        threading.Thread(target=self.jobs_server.serve_forever, daemon=True, name="fake-aws-jobs-proxy").start()
        self.sim.jobs_url = self.jobs_url
        log.info("fake AWS on %s (moto on %s), workdir %s", self.url, self.moto_url, self.workdir)
        return self

    def stop(self) -> None:
        self.releasing.set()
        self.sim.shutdown()          # the jobs' process groups end with the server
        for server in (self.server, self.jobs_server):
            server.shutdown()
            server.server_close()
        self.moto.stop()


# -- the control API's client --------------------------------------------------------------------

class ChaosClient:
    """The control API of a running fake AWS, for test harnesses: ChaosClient("http://127.0.0.1:P")."""

    def __init__(self, url: str, timeout: float = 10.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def _call(self, method: str, path: str, payload: Any = None) -> Any:
        data = json.dumps(payload).encode() if payload is not None else None
        request = urllib.request.Request(f"{self.url}/_chaos/{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"fake AWS refused {method} /_chaos/{path}: {exc.read().decode()}") from None

    def faults(self, rules: list[dict[str, Any]]) -> Any:
        """Replace the fault rules (see Rule.parse for the keys). Examples, one per fault:
        a lost answer after the request took effect, `{"operations": ["SubmitJob"], "kind":
        "lost", "count": 1}` (also CreateTrainingJob, StopTrainingJob, TerminateJob); a
        sustained outage of the reads, `{"operations": ["Describe*", "List*"], "services":
        ["sagemaker", "batch"], "kind": "503", "seconds": 600}` plus `{"operations": ["*"],
        "services": ["logs"], "kind": "timeout", "seconds": 600}`; SlowDown on the jobs' own
        checkpoint uploads, `{"operations": ["PutObject", "UploadPart", "CreateMultipartUpload",
        "CompleteMultipartUpload"], "kind": "throttle", "origin": "jobs", "seconds": 60}`."""
        return self._call("POST", "faults", {"rules": rules})

    def clear(self) -> Any:
        return self._call("DELETE", "faults")

    def fail(self, name: str, reason: str = "") -> Any:
        """The job's container crashes now (SageMaker Failed, Batch FAILED)."""
        return self._call("POST", f"jobs/{name}/fail", {"reason": reason})

    def stop(self, name: str, reason: str = "") -> Any:
        """Someone stops the job from the console (SageMaker Stopped, Batch FAILED with reason)."""
        return self._call("POST", f"jobs/{name}/stop", {"reason": reason})

    def lose_host(self, name: str, node: int = 0) -> Any:
        """Node `node`'s host dies (its disk with it); the attempt fails as the service fails it."""
        return self._call("POST", f"jobs/{name}/host", {"node": node})

    def reclaim(self, name: str) -> Any:
        """EC2 reclaims the job's spot capacity now (see Simulator.reclaim): a SageMaker managed
        spot job is Interrupted and restarts inside the same job while MaxWaitTimeInSeconds
        allows; a Batch job's host is terminated."""
        return self._call("POST", f"jobs/{name}/reclaim")

    def config(self, **changes: Any) -> Any:
        """Change the simulator's settings (DEFAULT_CONFIG), e.g. `consistency_seconds=10`
        (Describe*/List* do not show a job that long after its create), `log_delay_seconds=5`
        (log lines reach CloudWatch that late: after the job's end), `capacity_wait_seconds`,
        `pending_seconds`, `fail_first_attempt`. They apply to jobs from then on."""
        return self._call("POST", "config", changes)

    def report(self) -> dict[str, Any]:
        return self._call("GET", "report")

    def health(self) -> dict[str, Any]:
        return self._call("GET", "health")

    def job(self, name: str) -> dict[str, Any] | None:
        """The newest simulated job of this name (or id), as in the report."""
        jobs = [j for j in self.report()["jobs"] if name in (j["name"], j["job_id"])]
        return jobs[-1] if jobs else None

    def wait(self, name: str, statuses: set[str] | tuple[str, ...], timeout: float = 60.0) -> dict[str, Any]:
        """Wait until the job reaches one of `statuses`; its report entry."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(name)
            if job and job["status"] in statuses:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {name} is {job and job['status']}, not in {sorted(statuses)}, "
                                   f"after {timeout} s")
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.fake_aws", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the proxy's port on 127.0.0.1")
    parser.add_argument("--workdir", required=True, help="where the jobs' /opt/ml layouts and logs go")
    parser.add_argument("--moto-port", type=int, default=None, help="moto's port (default: a free one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    fake = FakeAws(args.port, args.workdir, args.moto_port).start()
    print(json.dumps({"url": fake.url, "moto": fake.moto_url, "connection": fake.connection()}), flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1):
        pass
    fake.stop()


if __name__ == "__main__":
    main()
