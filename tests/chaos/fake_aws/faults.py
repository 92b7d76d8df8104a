"""Which operation a request is (`identify`), the error answers in each protocol's shape (`ERRORS`,
`fault_answer`) and the fault rules (`Rule`, `Faults`) that pick the calls to fail."""

from __future__ import annotations

import fnmatch
import functools
import json
import logging
import random
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import parse_qs

log = logging.getLogger("fake_aws")
KINDS = ("throttle", "500", "503", "reset", "timeout", "lost")
ORIGINS = ("clients", "jobs", "*")   # whose calls a rule touches (see FakeAws.jobs_url)


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
