"""One client per connection, region and service in a process, reused across polls and triggers.

A deferred task's trigger polls its job every 30 s, and the triggerer runs every deferred task's
trigger in one process. Building a hook for each poll read the Airflow connection, made a boto3
session and loaded the service's model again (~0.3 s of CPU per poll on a build machine), and
started botocore's adaptive rate limiter from nothing each time, so a throttled account was never
slowed down by it. Here a hook (and so its boto3 client) is made once per key and shared:

- the key: hook class, connection id, region, and the hook's own arguments (an S3 hook's KMS
  key); the connection's definition (endpoint, role_arn, keys, config: everything in it) is
  checked by a fingerprint, so an edited connection gets a new client;
- when the definition is re-read: a connection in an environment variable (AIRFLOW_CONN_*) costs
  nothing to read, so it is compared on every lookup; one in the metadata DB or a secrets backend
  costs a round trip (the triggerer asks its supervisor, which asks the API server), so it is read
  again at most every RECHECK_SECONDS. Entries do not otherwise expire: an expiry would rebuild a
  client that is still right and reset its rate limiter;
- credentials are not pinned: the provider builds a role_arn connection's session with botocore's
  RefreshableCredentials (AssumeRole again before they expire), and a connection without keys uses
  boto3's default chain, whose container and instance-profile credentials refresh the same way; a
  client keeps the credentials object of the session it was made from, so it keeps refreshing.
  Static keys only change when the connection does, and then the fingerprint does;
- threads: boto3 clients are thread-safe, sessions and resources are not. A client is built under
  its key's lock (the hook's session is touched by one thread only) and then only its client
  methods are shared (llmops.infra.aws.s3 reads with the client, not the S3 resource).

`cached(key, build, conn_ids)` does the same for any other object built from connections (the
HyperPod backend's Kubernetes client, whose own EKS token renews itself).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable

RECHECK_SECONDS = 300.0   # how often a connection from the DB or a secrets backend is read again


@dataclass
class _Entry:
    value: Any
    fingerprint: str
    checked_at: float


_ENTRIES: dict[Hashable, _Entry] = {}
_LOCKS: collections.defaultdict[Hashable, threading.Lock] = collections.defaultdict(threading.Lock)
_LOCKS_LOCK = threading.Lock()
# How many objects each kind of key built in this process (a benchmark and the tests read it).
builds: collections.Counter[str] = collections.Counter()


def _env_name(conn_id: str) -> str:
    return f"AIRFLOW_CONN_{conn_id.upper()}"


def _from_env(conn_ids: Iterable[str]) -> bool:
    return all(_env_name(c) in os.environ for c in conn_ids)


def fingerprint(conn_ids: Iterable[str]) -> str:
    """A hash of the connections' whole definitions ("" for none): never the secrets themselves."""
    parts = []
    for conn_id in conn_ids:
        if _env_name(conn_id) in os.environ:
            parts.append(os.environ[_env_name(conn_id)])
            continue
        from airflow.sdk import BaseHook

        try:
            conn = BaseHook.get_connection(conn_id)
        except Exception as exc:  # noqa: BLE001 - absent: the hook says so when it is used
            parts.append(f"absent: {type(exc).__name__}")
            continue
        parts.append(json.dumps([conn.conn_type, conn.host, conn.login, conn.password, conn.schema,
                                 conn.port, conn.extra], default=str))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest() if parts else ""


def cached(key: Hashable, build: Callable[[], Any], conn_ids: Iterable[str | None] = (),
           store: dict | None = None) -> Any:
    """The object `build()` made for `key`, made again when a connection in `conn_ids` changed."""
    ids = tuple(c for c in conn_ids if c)
    store = _ENTRIES if store is None else store
    entry = store.get(key)
    now = time.monotonic()
    env = _from_env(ids)
    if entry is not None and not env and now - entry.checked_at < RECHECK_SECONDS:
        return entry.value
    with _LOCKS_LOCK:
        lock = _LOCKS[key]
    with lock:
        entry = store.get(key)
        current = fingerprint(ids)
        if entry is not None and entry.fingerprint == current:
            entry.checked_at = now
            return entry.value
        value = build()
        builds[str(key[0]) if isinstance(key, tuple) and key else str(key)] += 1
        store[key] = _Entry(value, current, now)
        return value


def hook(hook_cls: type, aws_conn_id: str | None, region_name: str | None = None, **kwargs: Any) -> Any:
    """The process's `hook_cls(aws_conn_id=, region_name=, **kwargs)`, its client already built."""
    aws_conn_id, region_name = aws_conn_id or None, region_name or None
    key = (hook_cls.__name__, hook_cls, aws_conn_id, region_name,
           json.dumps(kwargs, sort_keys=True, default=str))

    def build() -> Any:
        made = hook_cls(aws_conn_id=aws_conn_id, region_name=region_name, **kwargs)
        made.get_conn()   # now, under the key's lock: threads share only the finished client
        return made

    return cached(key, build, (aws_conn_id,))


def clear() -> None:
    """Forget every cached client (a test that changes what a connection id points to)."""
    _ENTRIES.clear()
