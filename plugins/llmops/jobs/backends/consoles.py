"""Where a job on AWS shows itself: the console of its region's partition, its CloudWatch log
streams, and the region itself (the host discovery of the AWS backends' entries)."""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import quote

log = logging.getLogger(__name__)


def aws_console(region: str) -> str:
    """The console's address for the region's partition (China and GovCloud have their own)."""
    if region.startswith("cn-"):
        return "https://console.amazonaws.cn"
    if region.startswith("us-gov-"):
        return "https://console.amazonaws-us-gov.com"
    return "https://console.aws.amazon.com"


def _cloudwatch_escape(text: str) -> str:
    """CloudWatch's console fragment encodes its own URL-encoding once more: '/' -> '$252F'."""
    return quote(text, safe="").replace("%", "$25")


def cloudwatch_logs_url(region: str, group: str, stream_prefix: str = "") -> str:
    url = (f"{aws_console(region)}/cloudwatch/home?region={region}#logsV2:log-groups/log-group/"
           f"{_cloudwatch_escape(group)}")
    if stream_prefix:
        url += "$3FlogStreamNameFilter$3D" + _cloudwatch_escape(stream_prefix)
    return url


def handle_region(handle: dict[str, Any]) -> str:
    """The job's AWS region: the backend settings', else its AWS connection's, else the
    environment's."""
    if handle.get("region_name"):
        return handle["region_name"]
    if "aws_conn_id" in handle:
        try:
            from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

            region = AwsBaseHook(aws_conn_id=handle["aws_conn_id"] or None,
                                 client_type="sts").conn_region_name
            if region:
                return region
        except Exception:  # noqa: BLE001 - no region, no console link
            log.debug("no region from connection %s", handle["aws_conn_id"], exc_info=True)
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or ""
