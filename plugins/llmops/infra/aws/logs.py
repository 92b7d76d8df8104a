"""CloudWatch Logs for the Airflow side: follow streams from a cursor that survives deferral (a
dict of forward tokens), list every stream of a job, and read only the end of each stream."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import ClientError

FULL_PAGE = 1000   # events: a GetLogEvents page this full may have more behind it
MAX_PAGES = 10     # pages read per stream per call; a backlog beyond comes with the next call


def stream_names(logs: Any, group: str, prefix: str) -> list[str]:
    """Every stream of `group` whose name starts with `prefix`, across all pages (DescribeLogStreams
    returns at most 50 a call: a 64-instance job has 64). [] when the group does not exist yet."""
    names: list[str] = []
    try:
        for page in logs.get_paginator("describe_log_streams").paginate(
                logGroupName=group, logStreamNamePrefix=prefix):
            names += [s["logStreamName"] for s in page.get("logStreams", [])]
    except ClientError as exc:
        if exc.response["Error"]["Code"] != "ResourceNotFoundException":
            raise
    return names


def _prefix(stream: str, streams: list[str]) -> str:
    return f"[{stream.rsplit('/', 1)[-1]}] " if len(streams) > 1 else ""


def follow(logs: Any, group: str, streams: list[str], cursor: dict[str, str] | None
           ) -> tuple[list[str], dict[str, str]]:
    """New lines of `streams` since `cursor`; lines are prefixed with their stream's last part
    when there are several (one per instance or node).

    One GetLogEvents per stream per call when the page is not full: asking again only to hear
    "no more" doubled every poll's log calls. A page of FULL_PAGE events or more may have more
    behind it and is followed by the next, at most MAX_PAGES a stream; whatever is left comes with
    the next call, from the cursor (nothing is skipped, it only comes a poll later)."""
    cursor = dict(cursor or {})
    lines: list[str] = []
    for stream in streams:
        kwargs: dict[str, Any] = {"logGroupName": group, "logStreamName": stream, "startFromHead": True}
        if stream in cursor:
            kwargs["nextToken"] = cursor[stream]
        try:
            for _ in range(MAX_PAGES):
                page = logs.get_log_events(**kwargs)
                events = page.get("events", [])
                lines += [_prefix(stream, streams) + event["message"] for event in events]
                token = page.get("nextForwardToken")
                if not token or token == kwargs.get("nextToken"):
                    break
                kwargs["nextToken"] = token
                if len(events) < FULL_PAGE:
                    break
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "ResourceNotFoundException":
                raise
            continue  # the stream appears when the container writes its first line
        if kwargs.get("nextToken"):
            cursor[stream] = kwargs["nextToken"]
    return lines, cursor


def tail(logs: Any, group: str, streams: list[str], lines: int = 40,
         cursor: dict[str, str] | None = None) -> list[str]:
    """The last `lines` lines over `streams`, oldest first: one GetLogEvents call per stream,
    reading from the end (startFromHead=False), never the whole log. With `cursor`, each stream's
    forward token is put in it, so `follow` goes on after these lines."""
    limit = max(1, min(int(lines), 10_000))   # GetLogEvents' own bounds
    events: list[tuple[int, int, str]] = []
    for stream in streams:
        try:
            page = logs.get_log_events(logGroupName=group, logStreamName=stream,
                                       startFromHead=False, limit=limit)
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "ResourceNotFoundException":
                raise
            continue
        if cursor is not None and page.get("nextForwardToken"):
            cursor[stream] = page["nextForwardToken"]
        found = page.get("events", [])[-limit:]
        events += [(e.get("timestamp", 0), i, _prefix(stream, streams) + e["message"])
                   for i, e in enumerate(found)]
    events.sort(key=lambda e: (e[0], e[1]))   # interleave instances by time, stable per stream
    return [message for *_, message in events[-limit:]]
