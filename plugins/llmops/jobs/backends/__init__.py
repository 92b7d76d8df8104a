"""Backends by name. Registered as dotted paths so a backend's SDK is imported only when used."""

from __future__ import annotations

import importlib

from llmops.jobs.backends.base import Backend, JobState, JobStatus

BACKENDS = {
    "local": "llmops.jobs.backends.local.local_backend.LocalBackend",
    "sagemaker": "llmops.jobs.backends.sagemaker.sagemaker_backend.SageMakerTrainingBackend",
    "sagemaker_processing": "llmops.jobs.backends.sagemaker.sagemaker_backend.SageMakerProcessingBackend",
    "hyperpod": "llmops.jobs.backends.hyperpod.hyperpod_backend.HyperPodBackend",
    "batch": "llmops.jobs.backends.batch.batch_backend.BatchBackend",
    "ray": "llmops.jobs.backends.ray.ray_backend.RayBackend",
}


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"Unknown backend {name!r}. Choose one of {sorted(BACKENDS)}.")
    module, _, cls = BACKENDS[name].rpartition(".")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["BACKENDS", "Backend", "JobState", "JobStatus", "get_backend"]
