"""Waits for a job from the triggerer, so a deferred task holds no worker slot while it runs."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from llmops.jobs.backends import get_backend


class JobTrigger(BaseTrigger):
    """Polls a backend until the job ends, streaming its log lines into the task log.

    The deadline is the job's own max run time, not a fixed number of polls: pretraining may run
    for days. Past it the job is stopped. A user killing the task stops the job (`on_kill`); a
    triggerer restart does not (the trigger is simply resumed elsewhere).
    """

    def __init__(self, handle: dict[str, Any], poll_interval: float = 5.0,
                 deadline: float | None = None, log_cursor: Any = None,
                 context: dict[str, Any] | None = None):
        super().__init__()
        self.handle = handle
        self.context = context or {}  # handed back in the event: what the task resumes with
        self.poll_interval = poll_interval
        self.deadline = deadline
        self.log_cursor = log_cursor

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("llmops.triggers.job.JobTrigger",
                {"handle": self.handle, "poll_interval": self.poll_interval,
                 "deadline": self.deadline, "log_cursor": self.log_cursor,
                 "context": self.context})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        backend = get_backend(self.handle["backend"])
        cursor = self.log_cursor
        while True:
            lines, cursor = await asyncio.to_thread(backend.read_logs, self.handle, cursor)
            for line in lines:
                self.log.info("[%s] %s", self.handle["name"], line)
            status = await asyncio.to_thread(backend.status, self.handle)
            if status.state.terminal:
                yield TriggerEvent({"state": status.state.value, "message": status.message,
                                    "log_cursor": cursor, "handle": self.handle, **self.context})
                return
            if self.deadline is not None and time.time() > self.deadline:
                await asyncio.to_thread(backend.stop, self.handle)
                yield TriggerEvent({"state": "timeout", "log_cursor": cursor,
                                    "handle": self.handle, **self.context,
                                    "message": "the job ran past its max_run_seconds and was stopped"})
                return
            await asyncio.sleep(self.poll_interval)

    async def on_kill(self) -> None:
        await asyncio.to_thread(get_backend(self.handle["backend"]).stop, self.handle)
