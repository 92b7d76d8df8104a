"""Which errors of a status or log call are worth waiting out, and how long to wait between tries.

Watching a job for days means meeting every hiccup of the services around it: throttled describe
calls when a sweep polls many jobs, a 503 from an API having a bad minute, a connection reset by a
NAT gateway. botocore retries a few times by itself; what still gets through lands here. A
transient error is retried with backoff for as long as the job may be running; anything else
(AccessDenied, a job that no longer exists) is a real answer and fails the wait.

`is_transient` is only meant for *read* calls (describe, get logs): retrying those is always safe.
Submitting is not retried here: a retried submit can start a second job.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

# Error codes AWS services use for "slow down". LimitExceededException is a quota error for
# create calls, but for describe calls (HyperPod, Batch) it is the service's throttling.
THROTTLING_CODES = frozenset({
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException",
    "TooManyRequestsException", "ProvisionedThroughputExceededException", "RequestLimitExceeded",
    "SlowDown", "RequestThrottled", "LimitExceededException",
})
# Server-side failures some services report with a code, not (only) a 5xx status.
SERVER_ERROR_CODES = frozenset({
    "InternalError", "InternalFailure", "InternalServerError", "InternalServerException",
    "ServiceUnavailable", "ServiceUnavailableException", "RequestTimeout", "RequestTimeoutException",
})
# Local filesystem answers that no retry will change (the local backend reads files).
_PERMANENT_OS_ERRORS = (PermissionError, IsADirectoryError, NotADirectoryError)


def _http_status_transient(status: object) -> bool:
    # 0: the kubernetes client's "no HTTP response at all" (connection failed).
    return isinstance(status, int) and (status in (0, 429) or 500 <= status <= 599)


def is_transient(exc: BaseException) -> bool:
    """True if a read call that raised `exc` may well succeed when tried again later."""
    try:
        from botocore.exceptions import ClientError, ConnectionClosedError, HTTPClientError
        from botocore.exceptions import ConnectionError as BotoConnectionError
    except ImportError:  # an install without the AWS extras
        ClientError = BotoConnectionError = HTTPClientError = ConnectionClosedError = ()  # type: ignore
    if ClientError and isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return (error.get("Code") in THROTTLING_CODES or error.get("Code") in SERVER_ERROR_CODES
                or _http_status_transient(status))
    # EndpointConnectionError, ConnectTimeoutError (ConnectionError); ReadTimeoutError,
    # ConnectionClosedError (HTTPClientError): the request never got an answer.
    if BotoConnectionError and isinstance(exc, (BotoConnectionError, HTTPClientError)):
        return True
    # The kubernetes client (HyperPod): matched by name, so kubernetes is not imported here. Since
    # client 36 a 5xx is its subclass ServiceException (404 NotFoundException, ...), so any class
    # the error derives from counts: taken by its own name, a 503 of a 10-minute API outage read
    # as a real answer and failed the task (the fault matrix's HyperPod outage row).
    if any(k.__name__ == "ApiException" for k in type(exc).__mro__) and hasattr(exc, "status"):
        return _http_status_transient(exc.status)
    try:
        import urllib3.exceptions as u3
        if isinstance(exc, (u3.ProtocolError, u3.TimeoutError, u3.MaxRetryError, u3.NewConnectionError)):
            return True
    except ImportError:
        pass
    try:
        import requests.exceptions as rq
        if isinstance(exc, rq.HTTPError):  # an OSError too, but it carries a real answer
            return _http_status_transient(getattr(exc.response, "status_code", None))
        if isinstance(exc, (rq.ConnectionError, rq.Timeout, rq.ChunkedEncodingError)):
            return True
    except ImportError:
        pass
    # ConnectionResetError, BrokenPipeError, TimeoutError, socket.gaierror...; and a file of the
    # local backend replaced between two reads (FileNotFoundError) is a race, not an answer.
    return isinstance(exc, OSError) and not isinstance(exc, _PERMANENT_OS_ERRORS)


@dataclass
class Backoff:
    """Exponential backoff with full jitter: the n-th wait is uniform in [0, min(cap, base*2^n)].

    Full jitter spreads many watchers (a sweep's trials) that were throttled together, so they do
    not all retry in the same second and get throttled again.
    """

    base: float = 2.0
    cap: float = 300.0
    attempt: int = 0
    rand: Callable[[], float] = random.random

    def next_delay(self) -> float:
        ceiling = min(self.cap, self.base * (2 ** min(self.attempt, 30)))
        self.attempt += 1
        return ceiling * self.rand()

    def reset(self) -> None:
        self.attempt = 0
