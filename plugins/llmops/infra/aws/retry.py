"""Every boto3 client of the Airflow side retries throttling and transient errors the same way.

botocore's default (legacy mode, 5 attempts) gives up on a few seconds of throttling, and a sweep
polling many jobs at once is exactly what throttles DescribeTrainingJob, DescribeJobs and
GetLogEvents. `with_retries(HookClass)` is the provider hook with botocore's adaptive mode (client
side rate limiting plus exponential backoff with jitter, at most 20 s a wait) and 10 retries
(botocore's `max_attempts` counts retries: 11 attempts in all).

Why not the hooks' `config=` argument: the provider takes an explicit `config` *instead of* the
connection's `config_kwargs` extra (AwsConnectionWrapper: "Explicit set (in Hook)" wins, in 9.34
as in 9.39), so an admin's proxies or timeouts would silently vanish. Here the retry policy is
laid under the connection's config: an explicit `retries` in `config_kwargs` still wins.
"""

from __future__ import annotations

import functools
from functools import cached_property
from typing import Any, TypeVar

from botocore.config import Config

RETRIES = {"mode": "adaptive", "max_attempts": 10}
H = TypeVar("H")


def botocore_config(configured: Config | None = None) -> Config:
    """Our retry policy, overridden by whatever the connection (or the caller) configured."""
    ours = Config(retries=dict(RETRIES))
    return ours.merge(configured) if configured is not None else ours


@functools.cache
def with_retries(hook_cls: type[H]) -> type[H]:
    """`hook_cls` whose clients use `botocore_config` (one subclass per hook class)."""

    class Retrying(hook_cls):  # type: ignore[misc,valid-type]
        @cached_property
        def conn_config(self) -> Any:
            wrapper = super().conn_config
            wrapper.botocore_config = botocore_config(wrapper.botocore_config)
            return wrapper

    Retrying.__name__ = Retrying.__qualname__ = f"Retrying{hook_cls.__name__}"
    return Retrying
