"""A simulated job (`Job`: its status, processes, log streams and billing), one CloudWatch stream it
writes (`LogSink`), and what both services' lifecycles share: the capacity messages, log groups,
the containers' credentials, a create request's tags (`tag_pairs`), a container's end (`kill_group`)."""

from __future__ import annotations

import collections
import json
import math
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.aws_fixtures import REGION, kill_container

# What the services say while a job waits for instances (AWS Batch's statusReason on RUNNABLE,
# SageMaker's StatusMessage on the Starting transition).
BATCH_CAPACITY = ("CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY - Service cannot fulfill the capacity "
                  "requested for instance type [p4d.24xlarge]")
SM_CAPACITY = "Insufficient capacity error from EC2 while launching instances, retrying!"
SM_GROUP, BATCH_GROUP = "/aws/sagemaker/TrainingJobs", "/aws/batch/job"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION}
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
    modified_at: float = 0.0             # SageMaker's LastModifiedTime: the last change of its status
    timed: bool = False                  # runs no container (the simulator's `timed_jobs`)

    def __post_init__(self) -> None:
        self.modified_at = self.modified_at or self.created_at

    def move(self, status: str, secondary: str = "") -> None:
        """Change the status (the simulator's lock held), keeping SecondaryStatusTransitions."""
        if status != self.status or (self.service == "sagemaker" and secondary != self.secondary):
            self.modified_at = time.time()
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
                "timed": self.timed,
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

def timed_plan(service: str, request: dict[str, Any], default_seconds: float) -> tuple[float, int, str]:
    """What a timed job (no container) does, from its own request, as it starts now: (seconds it
    runs, its exit code, the s3:// URI its result JSON goes to, "" when the request names none).
    The seconds and exit code come from the job's environment: SIM_RUN_SECONDS, or SIM_END_AT
    (epoch seconds: it runs until then, at least 1 s), else the simulator's `timed_run_seconds`;
    SIM_EXIT_CODE, else 0. The result URI from the entry's `--result` argument, as
    docker/job_entry.py would read it (SageMaker: the `result` hyperparameter)."""
    if service == "sagemaker":
        env = dict(request.get("Environment") or {})
        hyper = request.get("HyperParameters") or {}
        result = json.loads(hyper["result"]) if "result" in hyper else ""
    else:
        overrides = [request.get("containerOverrides") or {}] + [
            o.get("containerOverrides") or {}
            for o in (request.get("nodeOverrides") or {}).get("nodePropertyOverrides") or []]
        env = {e["name"]: e["value"] for o in overrides for e in o.get("environment") or []}
        command = [a for o in overrides for a in o.get("command") or []]
        result = command[command.index("--result") + 1] if "--result" in command[:-1] else ""
    return run_seconds(env, default_seconds), int(env.get("SIM_EXIT_CODE", 0)), str(result)


def run_seconds(env: dict[str, str], default: float) -> float:
    """How long a timed job (or pod) starting now runs: SIM_RUN_SECONDS, or until SIM_END_AT."""
    if "SIM_END_AT" in env:
        return max(1.0, float(env["SIM_END_AT"]) - time.time())
    return float(env.get("SIM_RUN_SECONDS", default))


def timed_result(seconds: float) -> dict[str, Any]:
    """The result JSON a timed job's entry would have written (nothing but its own record)."""
    return {"metrics": {"timed_seconds": seconds}, "outputs": {}, "timed": True}


def tag_pairs(request: dict[str, Any]) -> set[str]:
    """`key=value` for each tag of a create request (SageMaker's list of Key/Value, Batch's map)."""
    tags = request.get("Tags") or request.get("tags") or {}
    if isinstance(tags, list):
        tags = {t.get("Key"): t.get("Value") for t in tags if isinstance(t, dict)}
    return {f"{k}={v}" for k, v in tags.items()} if isinstance(tags, dict) else set()


def kill_group(proc: subprocess.Popen, grace: float) -> None:
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
