"""What every backend provides: submit (or reattach), status, logs, stop."""

from __future__ import annotations

import abc
import enum
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from llmops.jobs.spec import JobSpec

# A committed checkpoint: tasks/train/checkpoint.py's step_{step:06d} directory, whose manifest is
# written last (docker/job_entry.py reads the same layout to restore the newest one).
CHECKPOINT_STEP = re.compile(r"^step_(\d{6,})$")
CHECKPOINT_COMMIT = "manifest.json"
NO_CHECKPOINT = -1   # checkpoint_step: the job's storage holds no complete checkpoint yet


class JobState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


@dataclass
class JobStatus:
    state: JobState
    message: str = ""
    result: dict[str, Any] | None = None   # the job's result JSON, once it succeeded
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BackendEntry:
    """Everything the rest of llmops reads of one backend, declared in its folder's __init__.py
    (light: no SDK import) and registered by one line in llmops.jobs.backends.BACKENDS: lifecycle's
    settings check, the settings block, the console links and the Param's choices read it here.

    `backend` and `settings` are dotted paths, imported only when used. `host` finds where the
    job's console or dashboard is (the AWS region, the Ray dashboard: "" when unknown) and
    `links` turns a job handle and that host into {button name: URL}; `buttons` names the link
    buttons it may fill, in order (a button shows on every job task, greyed out when empty)."""

    backend: str                        # the Backend class
    settings: str = ""                  # its settings block class; "" = none, the job runs here
    required: tuple[str, ...] = ()      # settings it cannot submit without
    one_of: tuple[str, ...] = ()        # at least one of these (the first is named when none is)
    aws: bool = True                    # staging bucket checked through the block's AWS connection
    host: Callable[[dict[str, Any]], str] | None = None
    links: Callable[[dict[str, Any], str], dict[str, str]] | None = None
    buttons: tuple[str, ...] = ()
    no_pause: str = ""                  # why a running job cannot see a pause marker ("" = it can)


class Backend(abc.ABC):
    """A handle is a small JSON-able dict, so it survives deferral to the triggerer.

    A handle may carry `poll_interval` and `deadline_grace_seconds` (from the backend's settings):
    the operator and the trigger use them over the class defaults.
    """

    name: str
    # Seconds between two polls of a job's status and log, unless the operator or the handle says
    # otherwise. Remote services rate-limit describe and log calls per account.
    poll_interval: float = 30.0
    # Set by a trigger (llmops.airflow.triggers.job_trigger): its status reads go through the one
    # read the process's triggers share where the service answers for many jobs at once
    # (llmops.jobs.backends.shared), and a value read that many seconds ago still serves. 0: the
    # job is read on its own (a worker watching its one job).
    shared_max_age: float = 0.0

    @abc.abstractmethod
    def submit(self, spec: JobSpec) -> dict[str, Any]:
        """Start the job, or reattach to the job of the same name if it is running or succeeded."""

    @abc.abstractmethod
    def status(self, handle: dict[str, Any]) -> JobStatus: ...

    @abc.abstractmethod
    def stop(self, handle: dict[str, Any]) -> None: ...

    def read_logs(self, handle: dict[str, Any], cursor: Any = None) -> tuple[list[str], Any]:
        """New log lines since `cursor`, and the cursor to pass next time."""
        return [], cursor

    def log_budget(self, handle: dict[str, Any]) -> Any:
        """The process's budget of log reads for the handle's log service (a RateBudget of
        llmops.jobs.backends.shared, which JobWatch takes a token from before each read), or None
        where the service publishes no rate to stay under."""
        return None

    def log_tail(self, handle: dict[str, Any], lines: int = 40) -> list[str]:
        """The last `lines` lines of the job's log (shown when it fails).

        This default reads the whole log; backends whose logs can be read from the end override it.
        """
        return self.read_logs(handle, None)[0][-lines:] if lines > 0 else []

    def checkpoint_step(self, handle: dict[str, Any]) -> int | None:
        """The step of the newest complete checkpoint (a step_NNNNNN directory with its
        manifest) under the handle's `checkpoint_uri`, the storage every attempt of the job
        shares; NO_CHECKPOINT when there is none yet; None when the handle names no storage (a
        local job, a handle from before the field). Raises when the storage cannot be read.

        The chain of attempts compares it at an attempt's start and end
        (llmops.airflow.operators.job_chain).
        """
        uri = str(handle.get("checkpoint_uri") or "")
        if not uri:
            return None
        if uri.startswith("s3://"):
            from llmops.infra.aws import s3

            hook = s3.s3_hook(handle.get("aws_conn_id"), handle.get("region_name") or None,
                              handle.get("kms_key_id"))
            names = s3.child_names(hook, uri)

            def committed(name: str) -> bool:
                return s3.exists(hook, s3.join(uri, name, CHECKPOINT_COMMIT))
        elif "://" not in uri:
            names = os.listdir(uri) if os.path.isdir(uri) else []

            def committed(name: str) -> bool:
                return os.path.isfile(os.path.join(uri, name, CHECKPOINT_COMMIT))
        else:
            return None
        steps = sorted((int(m.group(1)) for name in names if (m := CHECKPOINT_STEP.match(name))),
                       reverse=True)
        return next((step for step in steps if committed(f"step_{step:06d}")), NO_CHECKPOINT)

    def fingerprint(self, spec: JobSpec) -> str:
        """A hash of the backend settings this spec's job is built from (e.g. the resolved stage
        settings block: role, subnets, queue, image defaults), or "" when there are none.

        It is part of the job's name: when an admin changes those settings, the next run of the
        task starts a new job instead of reattaching to one built from the old settings.
        """
        return ""
