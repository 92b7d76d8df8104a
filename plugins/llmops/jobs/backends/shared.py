"""Reads that serve every trigger of a triggerer process at once, and a budget for log reads.

Airflow's triggerer runs every deferred task's trigger in one process: a sweep of 100 trials is
100 triggers polling the same services every 30 s, and one triggerer holds up to 1,000. Where an
API answers for many jobs in one call, one call does (a backend's `shared` reads, turned on by
llmops.airflow.triggers.job_trigger.JobTrigger; a worker watches one job and reads it directly):

- AWS Batch: DescribeJobs takes up to 100 job ids, parents and node jobs alike (`SharedReads`);
- SageMaker: ListTrainingJobs (ListProcessingJobs) with LastModifiedTimeAfter says which jobs
  changed since the last look; only those are described again (`ChangedSince`);
- Kubernetes (HyperPod): the jobs of one DAG run in a namespace with one list by label, instead
  of a get per job; their pods likewise (`SharedReads` over grouped keys).

A value read for one trigger serves every other trigger that asks within `max_age` seconds (a
third of its poll interval, `max_age_for`), so a job's end is seen at most a poll interval plus
that later than by a trigger reading alone. What a shared answer lacks (a job Batch does not
list yet, a Kubernetes job gone from the list) is read by the trigger itself, as before, so
eventual consistency and deletions keep their handling. A failed shared read is raised to every
trigger waiting on it (each backs off as after its own failed read), never read again at once by
each of them: under throttling a triggerer sends fewer calls, not more.

`RateBudget` bounds a process's CloudWatch Logs reads (GetLogEvents, DescribeLogStreams: 25 TPS
per account and Region, a hard limit): a poll without a token skips its log read (its lines come
with a later one, from the cursor), except the read after a job's end, which waits for one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, Hashable, Iterable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
FRESH_SHARE = 1 / 3      # a shared value serves triggers for this share of their poll interval
FORGET_SECONDS = 600.0   # keys nobody asked for this long are dropped (their trigger ended)
WAIT_SECONDS = 600.0     # the longest a trigger waits on another's read (botocore retries included)
# SageMaker: a description is trusted on the list's word at most this long; then it is read again
# whatever the list said (a change the list never showed costs at most this much delay).
TRUST_SECONDS = 600.0
# ... and the list looks this far back beyond what each description is known to cover: the
# service's clock against ours, and the list's lag behind the job's change.
OVERLAP_SECONDS = 120.0
# CloudWatch Logs reads a process makes a second at most ([llmops] cloudwatch_log_reads_per_second):
# GetLogEvents and DescribeLogStreams have 25 TPS each per account and Region, shared by every
# triggerer (MWAA runs one per scheduler, 2 by default) and everyone else reading logs there.
LOG_READS_PER_SECOND = 8.0


def max_age_for(poll_interval: float) -> float:
    """How old a shared value may be for a trigger polling this often: a third of its interval."""
    return max(0.5, float(poll_interval) * FRESH_SHARE)


@dataclass
class _Read:
    """One shared read under way: the keys it covers, its end, and its error if it failed."""

    keys: frozenset
    started: float
    done: threading.Event
    error: BaseException | None = None


class SharedReads(Generic[K, V]):
    """One read answers for many keys: `read_many(keys) -> {key: value}` (a key it has no value
    for is simply absent), at most `batch` keys a call.

    `get(key, max_age)` is the value read for `key` at most `max_age` seconds ago; else a read
    of `key` together with the keys asked for lately whose values are oldest (up to `batch` in
    all; none younger than half of `max_age`). While a read that covers `key` is under way, the
    caller waits for it instead of sending its own. None: the read had no value for `key`.
    """

    def __init__(self, read_many: Callable[[list[K]], dict[K, V]], batch: int = 100):
        self._read_many = read_many
        self.batch = batch
        self._lock = threading.Lock()
        self._values: dict[K, tuple[float, V | None]] = {}   # key -> (read started at, value or None)
        self._asked: dict[K, float] = {}
        self._reading: dict[K, _Read] = {}
        self.reads = 0   # calls of read_many (the tests and the benchmark read it)

    def get(self, key: K, max_age: float) -> V | None:
        waited: _Read | None = None
        while True:
            with self._lock:
                now = time.monotonic()
                self._asked[key] = now
                found = self._values.get(key)
                if found is not None and now - found[0] <= max_age:
                    return found[1]
                if waited is not None and waited.error is not None and key in waited.keys:
                    raise waited.error   # the read that covered this key failed: so does this poll
                under_way = self._reading.get(key)
                if under_way is None:
                    read = _Read(frozenset(self._pick(key, now, max_age)), now, threading.Event())
                    for k in read.keys:
                        self._reading[k] = read
                    self.reads += 1
            if under_way is not None:
                under_way.done.wait(WAIT_SECONDS)
                waited = under_way
                continue
            return self._run(read, key)

    def _pick(self, key: K, now: float, max_age: float) -> list[K]:
        for k in [k for k, at in self._asked.items() if now - at > FORGET_SECONDS]:
            self._asked.pop(k, None)
            self._values.pop(k, None)
        others = [k for k in self._asked if k != key and k not in self._reading
                  and (k not in self._values or now - self._values[k][0] > max_age / 2)]
        others.sort(key=lambda k: self._values[k][0] if k in self._values else float("-inf"))
        return [key, *others[:self.batch - 1]]

    def _run(self, read: _Read, key: K) -> V | None:
        try:
            values = self._read_many(sorted(read.keys, key=repr))
        except BaseException as exc:
            with self._lock:
                read.error = exc
                for k in read.keys:
                    self._reading.pop(k, None)
            read.done.set()
            raise
        with self._lock:
            for k in read.keys:
                self._reading.pop(k, None)
            # A key the answer lacks is remembered as such (None) for as long as a value would
            # be: its trigger reads it on its own, once, not in every shared read after.
            for k in {*read.keys, *values}:
                self._values[k] = (read.started, values.get(k))
        read.done.set()
        return values.get(key)


@dataclass
class _Known:
    description: dict[str, Any]
    described_at: float   # epoch s: when the description was read
    trusted_at: float     # epoch s: the job had not changed since its description, as of then


class ChangedSince:
    """Descriptions of the watched jobs, each read again only when it changed: one call,
    `list_changed(since)` -> {name: summary} of the jobs modified after `since` (epoch s), tells
    which ones; `same(summary, description)` whether a listed job's description still holds.

    `get(name, max_age)`: the job's description, no staler than `max_age` on the list's word
    (a list is made when the newest word is older: one for every trigger asking meanwhile), and
    read anew with `describe(name)` when the list says it changed, when it was described more
    than TRUST_SECONDS ago, or the first time. None: `describe` found no such job.
    """

    def __init__(self, list_changed: Callable[[float], dict[str, dict[str, Any]]],
                 describe: Callable[[str], dict[str, Any] | None],
                 same: Callable[[dict[str, Any], dict[str, Any]], bool]):
        self._list_changed, self._describe, self._same = list_changed, describe, same
        self._lock = threading.Lock()
        self._known: dict[str, _Known] = {}
        self._asked: dict[str, float] = {}
        self._listing: _Read | None = None
        self.lists = 0   # calls of list_changed
        self.describes = 0

    def get(self, name: str, max_age: float) -> dict[str, Any] | None:
        waited: _Read | None = None
        while True:
            with self._lock:
                now = time.time()
                self._asked[name] = now
                known = self._known.get(name)
                if known is None or now - known.described_at > TRUST_SECONDS:
                    break   # described anew below
                if now - known.trusted_at <= max_age:
                    return known.description
                if waited is not None and waited.error is not None:
                    raise waited.error
                if waited is not None:
                    break   # the list said it changed (or could not tell): described anew
                listing = self._listing
                if listing is None:
                    self._forget(now)
                    since = min(k.trusted_at for k in self._known.values()) - OVERLAP_SECONDS
                    listing = self._listing = _Read(frozenset(), now, threading.Event())
                    self.lists += 1
                    mine = True
                else:
                    mine = False
            if mine:
                self._list(listing, since)
            else:
                listing.done.wait(WAIT_SECONDS)
            waited = listing
        started = time.time()
        description = self._describe(name)
        with self._lock:
            self.describes += 1
            if description is None:
                self._known.pop(name, None)
            else:
                self._known[name] = _Known(description, started, started)
        return description

    def _forget(self, now: float) -> None:
        for name in [n for n, at in self._asked.items() if now - at > FORGET_SECONDS]:
            self._asked.pop(name, None)
            self._known.pop(name, None)

    def _list(self, listing: _Read, since: float) -> None:
        try:
            changed = self._list_changed(since)
        except BaseException as exc:
            with self._lock:
                listing.error = exc
                self._listing = None
            listing.done.set()
            raise
        with self._lock:
            for name, known in list(self._known.items()):
                if known.described_at >= listing.started:
                    continue   # described after the list began: already newer than its word
                summary = changed.get(name)
                if summary is None or self._same(summary, known.description):
                    known.trusted_at = max(known.trusted_at, listing.started)
                else:
                    del self._known[name]   # it changed: its trigger describes it again
            self._listing = None
        listing.done.set()


class RateBudget:
    """Tokens at `rate` a second (a burst of at most one second's worth), shared by every poll
    of a process: `take()` a token if there is one; `take(wait=True)` waits for one."""

    def __init__(self, rate: float):
        self.rate = float(rate)
        self._lock = threading.Lock()
        self._tokens = self.rate
        self._at = time.monotonic()
        self.taken = self.refused = 0

    def take(self, wait: bool = False) -> bool:
        if self.rate <= 0:
            return True   # no budget: every read goes
        while True:
            with self._lock:
                now = time.monotonic()
                self._tokens = min(max(self.rate, 1.0), self._tokens + (now - self._at) * self.rate)
                self._at = now
                if self._tokens >= 1.0:
                    self._tokens -= 1.0
                    self.taken += 1
                    return True
                if not wait:
                    self.refused += 1
                    return False
                pause = (1.0 - self._tokens) / self.rate
            time.sleep(pause)


def cloudwatch_budget(aws_conn_id: str, region_name: str) -> RateBudget:
    """The process's budget of CloudWatch Logs reads for a connection and region."""
    return board(("cloudwatch-logs", aws_conn_id, region_name), lambda: RateBudget(log_reads_per_second()))


def log_reads_per_second() -> float:
    """`[llmops] cloudwatch_log_reads_per_second` (0: no budget), LOG_READS_PER_SECOND unset."""
    try:
        from airflow.configuration import conf

        return conf.getfloat("llmops", "cloudwatch_log_reads_per_second", fallback=LOG_READS_PER_SECOND)
    except Exception:  # noqa: BLE001 - no Airflow config here (a job's own process): the default
        return LOG_READS_PER_SECOND


_BOARDS: dict[Hashable, Any] = {}
_BOARDS_LOCK = threading.Lock()


def board(key: Hashable, make: Callable[[], Any]) -> Any:
    """The process's one object for `key` (a SharedReads, ChangedSince or RateBudget of one
    service, connection and region), made by `make()` the first time."""
    with _BOARDS_LOCK:
        found = _BOARDS.get(key)
        if found is None:
            found = _BOARDS[key] = make()
        return found


def clear() -> None:
    """Forget every board (a test that changes what a connection points to)."""
    with _BOARDS_LOCK:
        _BOARDS.clear()


def grouped(keys: Iterable[tuple], size: int) -> dict[tuple, list[tuple]]:
    """Keys whose first `size` parts are the same, together: {head: [keys]}."""
    groups: dict[tuple, list[tuple]] = {}
    for key in keys:
        groups.setdefault(tuple(key[:size]), []).append(key)
    return groups
