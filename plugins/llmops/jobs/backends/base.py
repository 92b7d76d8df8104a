"""What every backend provides: submit (or reattach), status, logs, stop."""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any

from llmops.jobs.spec import JobSpec


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


class Backend(abc.ABC):
    """A handle is a small JSON-able dict, so it survives deferral to the triggerer."""

    name: str

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
