"""Pause a running pretraining: a marker object next to its checkpoints asks the job to stop.

    <output_dir>/checkpoints/PAUSE            (a local file; on shared storage, any node sees it)
    <checkpoint_uri>/PAUSE                    (an S3 object, when checkpoint_uri is set)

Its content is optional JSON: {"at_step": N} pauses exactly after step N (or at once when the job
is already past N); an empty or non-JSON marker pauses after the next step. Other keys (say
"by": who asked) are kept in the job's "paused" event.

Rank 0 alone looks for the marker: once when training starts (so a marker written before the
job pauses it at exactly its at_step) and then on a background thread every `poll_s` seconds,
so that an S3 request never stalls a step. Every rank learns rank 0's answer at the same step:
the answer rides on the all-reduce each step already makes for the spike guard
(tasks/train/loop.py), so the ranks stop together at no extra collective. The loop then saves a
checkpoint of that step (unless it just did), waits for it to be committed (and uploaded), deletes
the marker, logs "paused at step N" and returns; the job exits with
tasks.train.supervisor.PAUSED_EXIT and its result says `paused` and `paused_at_step`.

Resuming is a fork of the paused job's checkpoints at that step with nothing changed
(TrainConfig.fork_from, fork_step: tasks/train/fork.py): it ends bitwise where a run never paused
ends. A retry of the same job (same output_dir) resumes in place, the marker being consumed.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MARKER = "PAUSE"
POLL_S = 5.0  # seconds between two looks at the marker (rank 0, on a thread)


def marker_path(output_dir: str | Path) -> Path:
    """The local marker of a job writing its checkpoints under output_dir/checkpoints."""
    return Path(output_dir) / "checkpoints" / MARKER


def parse_request(raw: bytes) -> dict[str, Any]:
    """A marker's content as a request: {"at_step": int or None, ...the marker's other keys}."""
    try:
        found = json.loads(raw.decode() or "{}")
    except (UnicodeDecodeError, ValueError):
        found = {}
    if not isinstance(found, dict):
        found = {}
    at = found.get("at_step")
    try:
        at_step = int(at) if at is not None else None
    except (TypeError, ValueError):
        log.warning("pause marker: at_step %r is not a step number; pausing at the next step", at)
        at_step = None
    return {**found, "at_step": at_step}


class PauseWatch:
    """Rank 0's view of the pause marker (local file and, with a mirror, its S3 object)."""

    def __init__(self, local: str | Path, mirror: Any = None, *, poll_s: float = POLL_S) -> None:
        self.local, self.mirror, self.poll_s = Path(local), mirror, poll_s
        self.request: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def places(self) -> list[str]:
        where = [str(self.local)]
        if self.mirror is not None:
            where.append(f"s3://{self.mirror.bucket}/{self.mirror._key(MARKER)}")
        return where

    def poll(self) -> dict[str, Any] | None:
        """Look at the marker now; the request it holds, or None."""
        raw: bytes | None = None
        try:
            if self.local.is_file():
                raw = self.local.read_bytes()
            elif self.mirror is not None:
                raw = self.mirror.read_object(MARKER)
        except Exception as exc:  # noqa: BLE001 - a failed look is retried at the next poll
            log.warning("pause marker: could not read it (%s); looking again in %.0fs", exc,
                        self.poll_s)
            return self.request
        request = parse_request(raw) if raw is not None else None
        with self._lock:
            if request is not None and self.request is None:
                log.info("pause requested (%s): %s", " or ".join(self.places), request)
            self.request = request
        return request

    def start(self) -> None:
        """One look now, then one every poll_s seconds on a daemon thread."""
        self.poll()
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._serve, name="pause-watch", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 1)
            self._thread = None

    def wanted(self, done: int) -> bool:
        """Whether the job should pause after step `done`."""
        with self._lock:
            request = self.request
        return request is not None and (request["at_step"] is None or done >= request["at_step"])

    def consume(self) -> dict[str, Any]:
        """Delete the marker (the pause it asked for has happened); returns its request."""
        self.stop()
        request = dict(self.request or {})
        self.local.unlink(missing_ok=True)
        if self.mirror is not None:
            try:
                self.mirror.delete_object(MARKER)
            except Exception as exc:  # noqa: BLE001 - the checkpoint is committed; say so
                log.warning("pause marker: could not delete %s (%s); delete it before resuming "
                            "in place", self.places[-1], exc)
        return request
