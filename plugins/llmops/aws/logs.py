"""Follow CloudWatch log streams from a cursor that survives deferral (a dict of forward tokens)."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import ClientError


def follow(logs: Any, group: str, streams: list[str], cursor: dict[str, str] | None
           ) -> tuple[list[str], dict[str, str]]:
    """New lines of `streams` since `cursor`; lines are prefixed with their stream's last part
    when there are several (one per instance or node)."""
    cursor = dict(cursor or {})
    lines: list[str] = []
    for stream in streams:
        kwargs: dict[str, Any] = {"logGroupName": group, "logStreamName": stream, "startFromHead": True}
        if stream in cursor:
            kwargs["nextToken"] = cursor[stream]
        try:
            while True:
                page = logs.get_log_events(**kwargs)
                prefix = f"[{stream.rsplit('/', 1)[-1]}] " if len(streams) > 1 else ""
                lines += [prefix + event["message"] for event in page.get("events", [])]
                token = page.get("nextForwardToken")
                if not token or token == kwargs.get("nextToken"):
                    break
                kwargs["nextToken"] = token
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "ResourceNotFoundException":
                raise
            continue  # the stream appears when the container writes its first line
        if kwargs.get("nextToken"):
            cursor[stream] = kwargs["nextToken"]
    return lines, cursor
