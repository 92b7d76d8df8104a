"""Which ends of a job the next attempt fixes by going on from the newest checkpoint.

A stage's run is longer than any one job. SageMaker stops a training job at its MaxRuntime (a
quota, 5 days by default), spot capacity is reclaimed, a capacity request fails, the service has
an internal error, a node's host dies. None of these is the job's fault and none would happen the
same way again, so the operator submits the next attempt at once (capacity errors after a
backoff), and that attempt restores the newest complete checkpoint from the run's storage before
its first step (docker/job_entry.py). Every other end — the code failed, the config is wrong,
someone stopped the job — ends the chain: continuing would fail the same way, or undo a person's
decision. Airflow's task retries stay for what the chain cannot fix.

The services say why in words: SageMaker's FailureReason and SecondaryStatus, Batch's
statusReason, the Kubernetes job's condition message. The patterns below are those words, as the
services document them.
"""

from __future__ import annotations

import re
from typing import Any

from llmops.jobs.backends.base import JobState, JobStatus

# (why, pattern): the first match names the reason.
CONTINUABLE: tuple[tuple[str, re.Pattern[str]], ...] = (
    # The Kubeflow training operator fails a job past runPolicy.activeDeadlineSeconds with
    # "Job <name> has failed because it was active longer than specified deadline" (the reason,
    # DeadlineExceeded, is not in the condition's message the backend reports).
    ("max_runtime", re.compile(r"MaxRuntimeExceeded|attempt duration exceeded timeout|"
                               r"DeadlineExceeded|activeDeadlineSeconds|"
                               r"active longer than specified deadline", re.I)),
    ("capacity", re.compile(r"CapacityError|InsufficientInstanceCapacity|"
                            r"INSUFFICIENT_INSTANCE_CAPACITY|insufficient capacity", re.I)),
    ("spot", re.compile(r"\bInterrupted\b|spot (?:instance )?(?:interruption|reclaim)", re.I)),
    ("host", re.compile(r"Host EC2 \(instance [^)]*\) terminated|host[^.]* terminated", re.I)),
    ("internal", re.compile(r"InternalServerError|internal (?:server )?error", re.I)),
)
# SageMaker's MaxPendingTimeInSeconds (the stage's max_queue_seconds) ended the job: a limit the
# user set, which the next attempt would hit the same way.
QUEUE_BOUND = re.compile(r"MaxPendingTime|max_queue_seconds", re.I)
CAPACITY_BACKOFF_S = (60.0, 1800.0)   # first wait, longest wait (doubling in between)


def reason(status: JobStatus) -> str | None:
    """Why the job ended, when the next attempt can go on from its checkpoint; else None."""
    if status.state not in (JobState.FAILED, JobState.STOPPED):
        return None
    details: dict[str, Any] = status.details or {}
    text = " ".join(str(part) for part in (status.message, details.get("secondary", ""),
                                           details.get("reason", "")) if part)
    if QUEUE_BOUND.search(text):   # the stage's own max_queue_seconds: a decision, not a fault
        return None
    return next((why for why, pattern in CONTINUABLE if pattern.search(text)), None)


def backoff_seconds(why: str, capacity_waits: int) -> float:
    """How long to wait before the next attempt: capacity errors back off (the capacity will not
    be there a second later), the rest go on at once."""
    if why != "capacity":
        return 0.0
    first, longest = CAPACITY_BACKOFF_S
    return min(longest, first * 2 ** max(0, capacity_waits - 1))
