"""Backends by name: one line each in BACKENDS, naming the BackendEntry its folder declares
(llmops/jobs/backends/<folder>/__init__.py). Registered as dotted paths so a backend's SDK is
imported only when used; everything else about a backend (its settings block, what lifecycle
requires of it, its console links) is read from its entry."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from llmops.jobs.backends.base import Backend, BackendEntry, JobState, JobStatus

BACKENDS = {
    "local": "llmops.jobs.backends.local.ENTRY",
    "sagemaker": "llmops.jobs.backends.sagemaker.TRAINING",
    "sagemaker_processing": "llmops.jobs.backends.sagemaker.PROCESSING",
    "batch": "llmops.jobs.backends.batch.ENTRY",
    "hyperpod": "llmops.jobs.backends.hyperpod.ENTRY",
    "ray": "llmops.jobs.backends.ray.ENTRY",
}


@functools.cache
def load(dotted: str) -> Any:
    """The object a dotted path names (module.attribute), imported on first use."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def entry(name: str) -> BackendEntry:
    if name not in BACKENDS:
        raise ValueError(f"Unknown backend {name!r}. Choose one of {sorted(BACKENDS)}.")
    return load(BACKENDS[name])


def get_backend(name: str) -> Backend:
    return load(entry(name).backend)()


__all__ = ["BACKENDS", "Backend", "BackendEntry", "JobState", "JobStatus", "entry", "get_backend",
           "load"]
