"""The Kubernetes job resource of one attempt, as pure functions: `manifest()` (a
HyperPodPyTorchJob or a PyTorchJob, validated against crds/), its name (`k8s_name`), namespace,
labels and priority class. How a JobSpec maps onto it: the docstring of
llmops.jobs.backends.hyperpod.hyperpod_backend."""

from __future__ import annotations

import re
from typing import Any

from llmops.jobs.backends import remote
from llmops.jobs.backends.fabric import fabric_env
from llmops.jobs.backends.hyperpod.crds import group_version_plural, validate_manifest
from llmops.jobs.backends.hyperpod.hyperpod_settings import (HyperPodSettings,
                                                             check_auto_resume_namespace)
from llmops.jobs.spec import JobSpec, JobSpecError, cost_allocation_tags

MAX_NAME = 48   # pods and services are named <job>-worker-<i>: keep those within 63
JOB_LABEL = "llmops/job"        # on every pod of a job, so its pods are listed by selector
MANAGED_BY = "app.kubernetes.io/managed-by"   # "llmops" on every job and pod of ours
NODE_HEALTH = "sagemaker.amazonaws.com/node-health-status"
DEEP_HEALTH = "sagemaker.amazonaws.com/deep-health-check-status"
AUTO_RESUME = "sagemaker.amazonaws.com/enable-job-auto-resume"
MAX_RETRY = "sagemaker.amazonaws.com/job-max-retry-count"
AGENT_PORT = 8080               # hyperpodrun's port, which the HyperPod training operator talks to
POD_WORKDIR = "/tmp/llmops-job"  # the entry's work dir in a pod (LLMOPS_WORKDIR)


def k8s_name(name: str) -> str:
    """`name` as a Kubernetes name of at most MAX_NAME characters, its trailing hash kept."""
    clean = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", name.lower())).strip("-")
    return remote.check_name("kubernetes", remote.fit_name(clean, MAX_NAME))


def namespace_of(spec: JobSpec, settings: HyperPodSettings) -> str:
    """The job's namespace (the settings', {team} filled in, else the kind's default), refused
    where HyperPod would not auto-resume it although max_retry_count asks for that."""
    namespace = settings.resolved_namespace(spec.tags.get("team", "") or "default")
    check_auto_resume_namespace(settings, namespace)
    return namespace


def label_value(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(value))[:63].strip("_.-") or "none"


def cost_labels(spec: JobSpec) -> dict[str, str]:
    """The labels every job and pod of ours carries: who made it (`managed-by`) and the cost
    allocation (dag_id, run_id, team, stage). Label values are at most 63 of [A-Za-z0-9_.-]
    (run ids have ':' and '+'), so the exact values are annotations too."""
    return {MANAGED_BY: "llmops", **{f"llmops/{key.replace('_', '-')}": label_value(value)
                                     for key, value in cost_allocation_tags(spec).items() if value}}


def run_selector(spec: JobSpec) -> str:
    """A label selector for the jobs of the spec's DAG run (of its DAG and stage outside one):
    what a trigger lists to read every job of its run with one call, a run's jobs and no others'."""
    labels = cost_labels(spec)
    return ",".join(f"{key}={labels[key]}" for key in (MANAGED_BY, "llmops/dag-id", "llmops/run-id",
                                                        "llmops/stage") if key in labels)


def priority_class(priority: str, classes: dict[str, str]) -> str:
    """The class of the highest threshold at or below the run's priority ({"0": "low", ...})."""
    if priority == "" or not classes:
        return ""
    eligible = [(int(threshold), name) for threshold, name in classes.items() if int(threshold) <= int(priority)]
    return max(eligible)[1] if eligible else ""


def manifest(spec: JobSpec, settings: HyperPodSettings, staged: remote.Staged, name: str) -> dict[str, Any]:
    """The job resource for one attempt of `spec`."""
    res = remote.merged(spec, settings)
    if not res["image"]:
        raise JobSpecError(f"No image for the {spec.stage} job: set stage_resources.{spec.stage}.image "
                           "or `image` in the hyperpod settings.")
    nodes, nproc = res["instance_count"], res["nproc_per_node"]
    team = spec.tags.get("team", "") or "default"
    hyperpod = settings.kind == "HyperPodPyTorchJob"
    efa = settings.efa_per_node > 0
    env = {**fabric_env(res["instance_type"], nodes, efa=efa), **res["env"],
           "LLMOPS_WORKDIR": POD_WORKDIR, **remote.kms_env(settings)}
    remote.check_environment(env)
    args = remote.entry_args(spec, staged, launcher="hyperpodrun" if hyperpod else "torchrun",
                             nproc_per_node=nproc, nnodes=nodes)
    limits: dict[str, Any] = {}
    if settings.gpus_per_node:
        limits["nvidia.com/gpu"] = settings.gpus_per_node
    if efa:
        limits["vpc.amazonaws.com/efa"] = settings.efa_per_node
    if settings.cpu:
        limits["cpu"] = settings.cpu
    if settings.memory:
        limits["memory"] = settings.memory
    container: dict[str, Any] = {
        "name": "pytorch",  # the Kubeflow operator finds the training container by this name
        "image": res["image"], "imagePullPolicy": "IfNotPresent",
        "command": ["python3", settings.entry_script], "args": args,
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
        # Extended resources (GPUs, EFA) need requests equal to limits.
        "resources": {"requests": dict(limits), "limits": dict(limits)} if limits else {},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
    }
    if hyperpod:
        container["ports"] = [{"containerPort": AGENT_PORT}]
    pod_spec: dict[str, Any] = {
        "containers": [container],
        # NCCL and data loaders use shared memory; the container default (64 MiB) is too small.
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
    }
    selector = dict(settings.node_selector)
    if res["instance_type"]:
        selector["node.kubernetes.io/instance-type"] = res["instance_type"]
    if selector:
        pod_spec["nodeSelector"] = selector
    if settings.service_account:
        pod_spec["serviceAccountName"] = settings.service_account
    if settings.require_healthy_nodes:
        # HyperPod's health agent labels every node; a node that failed a check is relabelled
        # (and tainted) until it is replaced. Never land on one; prefer nodes that passed the
        # deep health checks (stress and NCCL tests) over those that were never deep-checked.
        pod_spec["affinity"] = {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": NODE_HEALTH, "operator": "In", "values": ["Schedulable"]}]}]},
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "preference": {"matchExpressions": [
                    {"key": DEEP_HEALTH, "operator": "In", "values": ["Passed"]}]}}]}}
    cost = cost_allocation_tags(spec)
    labels = cost_labels(spec)
    if settings.queue_name:
        labels["kueue.x-k8s.io/queue-name"] = settings.queue_name.format(team=team)
    klass = priority_class(spec.tags.get("priority", ""), settings.priority_classes)
    if klass:
        labels["kueue.x-k8s.io/priority-class"] = klass
    metadata = {"name": name, "namespace": namespace_of(spec, settings), "labels": labels,
                "annotations": {"llmops/job-name": spec.name, "llmops/result-uri": staged.result_uri,
                                **{f"llmops/{key.replace('_', '-')}": value
                                   for key, value in cost.items() if value}}}
    template = {"metadata": {"labels": {**labels, JOB_LABEL: name}}, "spec": pod_spec}
    group, version, _ = group_version_plural(settings.kind)
    if hyperpod:
        # cleanPodPolicy All: with None a failed job's pods stay, each holding its node's GPUs.
        run_policy: dict[str, Any] = {"jobMaxRetryCount": settings.max_retry_count,
                                      "activeDeadlineSeconds": spec.max_run_seconds,
                                      "cleanPodPolicy": "All"}
        if settings.log_monitoring:
            run_policy["logMonitoringConfiguration"] = list(settings.log_monitoring)
        body_spec = {"nprocPerNode": str(nproc),
                     "replicaSpecs": [{"name": "pod", "replicas": nodes, "template": template}],
                     "runPolicy": run_policy}
    else:
        if settings.max_retry_count:
            # Annotations, not labels: the HyperPod auto-resume controller reads only these.
            metadata["annotations"][AUTO_RESUME] = "true"
            metadata["annotations"][MAX_RETRY] = str(settings.max_retry_count)
        replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
        if nodes > 1:
            replicas["Worker"] = {"replicas": nodes - 1, "restartPolicy": "OnFailure", "template": template}
        body_spec = {"nprocPerNode": str(nproc), "pytorchReplicaSpecs": replicas,
                     "runPolicy": {"activeDeadlineSeconds": spec.max_run_seconds,
                                   "cleanPodPolicy": "All"}}
    body = {"apiVersion": f"{group}/{version}", "kind": settings.kind, "metadata": metadata,
            "spec": body_spec}
    validate_manifest(body)
    return body
