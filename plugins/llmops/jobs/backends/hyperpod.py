"""SageMaker HyperPod on EKS backend (`hyperpod`): a HyperPodPyTorchJob (HyperPod training
operator) or a Kubeflow PyTorchJob, created through the Kubernetes API.

    spec.instance_count        -> replicas (one pod per node); PyTorchJob: 1 Master + N-1 Workers
    spec.nproc_per_node        -> nprocPerNode; the pod runs docker/job_entry.py, which starts
                                  `hyperpodrun` (HyperPod's elastic agent) or torchrun with it
    spec.instance_type         -> nodeSelector node.kubernetes.io/instance-type (ml.p5.48xlarge)
    settings gpus/efa/cpu/memory -> container resources: nvidia.com/gpu, vpc.amazonaws.com/efa
                                  (+ FI_PROVIDER=efa and NCCL settings on several nodes)
    settings.max_retry_count   -> HyperPod auto-resume: runPolicy.jobMaxRetryCount, or on a
                                  PyTorchJob the sagemaker.amazonaws.com/enable-job-auto-resume
                                  and job-max-retry-count labels: after a node fault HyperPod
                                  replaces the node and restarts the job, which resumes from
                                  its checkpoints
    settings.log_monitoring    -> runPolicy.logMonitoringConfiguration: hang and slowness
                                  detection from the job's log lines (HyperPodPyTorchJob)
    spec.tags team / priority  -> namespace and Kueue queue (task governance), priority class
    spec.max_run_seconds       -> runPolicy.activeDeadlineSeconds

Manifests are validated against the CRD schemas in crds/ before they are sent. Credentials:
EksHook (the AWS connection) writes a kubeconfig for `eks_cluster_name`, or `kubernetes_conn_id`
names a Kubernetes connection. Stopping suspends the job (runPolicy.suspend), which deletes its
pods and keeps its record.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any, Iterator

from llmops.aws import s3
from llmops.jobs.backends import remote
from llmops.jobs.backends.base import Backend, JobState, JobStatus
from llmops.jobs.backends.crds import group_version_plural, validate_manifest
from llmops.jobs.backends.sagemaker import fabric_env
from llmops.jobs.backends.settings import HyperPodSettings, load
from llmops.jobs.spec import JobSpec, JobSpecError

log = logging.getLogger(__name__)

MAX_NAME = 48   # pods and services are named <job>-worker-<i>: keep those within 63
KINDS = ("HyperPodPyTorchJob", "PyTorchJob")


def k8s_name(name: str) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", name.lower())).strip("-")[:MAX_NAME].rstrip("-")


def label_value(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(value))[:63].strip("_.-") or "none"


def priority_class(priority: str, classes: dict[str, str]) -> str:
    """The class of the highest threshold at or below the run's priority ({"0": "low", ...})."""
    if priority == "" or not classes:
        return ""
    eligible = [(int(threshold), name) for threshold, name in classes.items() if int(threshold) <= int(priority)]
    return max(eligible)[1] if eligible else ""


def manifest(spec: JobSpec, settings: HyperPodSettings, staged: remote.Staged, name: str) -> dict[str, Any]:
    """The job resource for one attempt of `spec`."""
    if settings.kind not in KINDS:
        raise JobSpecError(f"hyperpod kind {settings.kind!r} is not one of {list(KINDS)}.")
    res = remote.merged(spec, settings)
    if not res["image"]:
        raise JobSpecError(f"No image for the {spec.stage} job: set stage_resources.{spec.stage}.image "
                           "or `image` in the hyperpod settings.")
    nodes, nproc = res["instance_count"], res["nproc_per_node"]
    team = spec.tags.get("team", "") or "default"
    hyperpod = settings.kind == "HyperPodPyTorchJob"
    efa = settings.efa_per_node > 0
    env = {**fabric_env(res["instance_type"], nodes, efa=efa), **res["env"]}
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
    labels = {"app.kubernetes.io/managed-by": "llmops", "llmops/stage": label_value(spec.stage),
              "llmops/team": label_value(team)}
    if settings.queue_name:
        labels["kueue.x-k8s.io/queue-name"] = settings.queue_name.format(team=team)
    klass = priority_class(spec.tags.get("priority", ""), settings.priority_classes)
    if klass:
        labels["kueue.x-k8s.io/priority-class"] = klass
    metadata = {"name": name, "namespace": settings.namespace.format(team=team), "labels": labels,
                "annotations": {"llmops/job-name": spec.name, "llmops/result-uri": staged.result_uri}}
    template = {"metadata": {"labels": dict(labels)}, "spec": pod_spec}
    group, version, _ = group_version_plural(settings.kind)
    if hyperpod:
        run_policy: dict[str, Any] = {"jobMaxRetryCount": settings.max_retry_count,
                                      "activeDeadlineSeconds": spec.max_run_seconds,
                                      "cleanPodPolicy": "None"}
        if settings.log_monitoring:
            run_policy["logMonitoringConfiguration"] = list(settings.log_monitoring)
        body_spec = {"nprocPerNode": str(nproc),
                     "replicaSpecs": [{"name": "pod", "replicas": nodes, "template": template}],
                     "runPolicy": run_policy}
    else:
        if settings.max_retry_count:
            labels["sagemaker.amazonaws.com/enable-job-auto-resume"] = "true"
            labels["sagemaker.amazonaws.com/job-max-retry-count"] = str(settings.max_retry_count)
        replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
        if nodes > 1:
            replicas["Worker"] = {"replicas": nodes - 1, "restartPolicy": "OnFailure", "template": template}
        body_spec = {"nprocPerNode": str(nproc), "pytorchReplicaSpecs": replicas,
                     "runPolicy": {"activeDeadlineSeconds": spec.max_run_seconds,
                                   "cleanPodPolicy": "None"}}
    body = {"apiVersion": f"{group}/{version}", "kind": settings.kind, "metadata": metadata,
            "spec": body_spec}
    validate_manifest(body)
    return body


def job_state(resource: dict[str, Any]) -> tuple[str, str]:
    """(condition type, message) of the job's newest true condition; ("", "") before any."""
    conditions = [c for c in (resource.get("status") or {}).get("conditions") or []
                  if str(c.get("status")) == "True"]
    if not conditions:
        return "", ""
    newest = max(conditions, key=lambda c: c.get("lastTransitionTime") or "")
    return newest.get("type", ""), newest.get("message") or newest.get("reason") or ""


class HyperPodBackend(Backend):
    name = "hyperpod"

    def __init__(self, settings: dict[str, Any] | None = None):
        self._settings = settings

    @contextlib.contextmanager
    def _kube(self, settings_or_handle: Any) -> Iterator[Any]:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

        get = (settings_or_handle.get if isinstance(settings_or_handle, dict)
               else lambda k, d="": getattr(settings_or_handle, k, d))
        if get("kubernetes_conn_id", ""):
            yield KubernetesHook(conn_id=get("kubernetes_conn_id"))
            return
        from airflow.providers.amazon.aws.hooks.eks import EksHook

        eks = EksHook(aws_conn_id=get("aws_conn_id", "") or None, region_name=get("region_name", "") or None)
        cluster, namespace = get("eks_cluster_name"), get("namespace_resolved", "") or None
        # 9.34 (MWAA) and later providers name the kubeconfig helper differently.
        if hasattr(eks, "generate_config_file_with_credentials"):
            with eks.generate_config_file_with_credentials(eks_cluster_name=cluster,
                                                           pod_namespace=namespace) as (config, _):
                yield KubernetesHook(conn_id=None, config_file=config)
        else:
            with eks.generate_config_file(eks_cluster_name=cluster, pod_namespace=namespace) as config:
                yield KubernetesHook(conn_id=None, config_file=config)

    def submit(self, spec: JobSpec) -> dict[str, Any]:
        if not spec.name:
            raise JobSpecError("JobSpec.name is required to submit: it makes retries reattach.")
        settings = load("hyperpod", HyperPodSettings, self._settings).for_stage(spec.stage)
        settings.require("staging_uri", backend="hyperpod")
        if not (settings.eks_cluster_name or settings.kubernetes_conn_id):
            settings.require("eks_cluster_name", backend="hyperpod")
        remote.check_environment(spec.env)
        remote.warn_if_unreachable(spec.env, log)
        group, version, plural = group_version_plural(settings.kind)
        namespace = settings.namespace.format(team=spec.tags.get("team", "") or "default")
        with self._kube(settings) as kube:
            def get(name: str) -> dict[str, Any] | None:
                try:
                    return kube.get_custom_object(group=group, version=version, plural=plural,
                                                  name=k8s_name(name), namespace=namespace)
                except Exception as exc:
                    if getattr(exc, "status", None) == 404:
                        return None
                    raise

            attempt, found = remote.latest_attempt(spec.name, get, max_len=MAX_NAME)
            state = job_state(found)[0] if found else ""
            if found is not None and state not in ("Failed", "Suspended"):
                job_name = remote.attempt_name(spec.name, attempt, MAX_NAME)
                staged = remote.plan(spec, job_name, settings.staging_uri)
                return self._handle(spec, settings, staged, job_name, namespace, attempt, True)
            attempt += 1
            job_name = remote.attempt_name(spec.name, attempt, MAX_NAME)
            staged = remote.plan(spec, job_name, settings.staging_uri)
            body = manifest(spec, settings, staged, k8s_name(job_name))
            s3_hook = s3.s3_hook(settings.aws_conn_id, settings.region_name)
            remote.upload(staged, s3_hook, log)
            s3.write_json(s3_hook, s3.join(staged.prefix, "manifest.json"), body)
            kube.create_custom_object(group=group, version=version, plural=plural, body=body,
                                      namespace=namespace)
        log.info("Created %s %s/%s (%d node(s))", settings.kind, namespace, k8s_name(job_name),
                 body["spec"].get("replicaSpecs", [{}])[0].get("replicas", 1) if settings.kind ==
                 "HyperPodPyTorchJob" else spec.instance_count)
        return self._handle(spec, settings, staged, job_name, namespace, attempt, False)

    def _handle(self, spec, settings, staged, job_name, namespace, attempt, reattached) -> dict[str, Any]:
        return {"backend": self.name, "name": spec.name, "job_name": job_name,
                "k8s_name": k8s_name(job_name), "kind": settings.kind, "namespace": namespace,
                "namespace_resolved": namespace, "attempt": attempt,
                "aws_conn_id": settings.aws_conn_id, "region_name": settings.region_name,
                "eks_cluster_name": settings.eks_cluster_name,
                "kubernetes_conn_id": settings.kubernetes_conn_id,
                "result_uri": staged.result_uri, "copy_back": staged.copy_back,
                "reattached": reattached}

    def _get(self, kube: Any, handle: dict[str, Any]) -> dict[str, Any] | None:
        group, version, plural = group_version_plural(handle["kind"])
        try:
            return kube.get_custom_object(group=group, version=version, plural=plural,
                                          name=handle["k8s_name"], namespace=handle["namespace"])
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                return None
            raise

    def status(self, handle: dict[str, Any]) -> JobStatus:
        with self._kube(handle) as kube:
            resource = self._get(kube, handle)
        if resource is None:
            return JobStatus(JobState.FAILED, f"{handle['kind']} {handle['k8s_name']} no longer exists")
        state, message = job_state(resource)
        if state in ("Succeeded", "Completed"):
            result, why = remote.fetch_result(handle, s3.s3_hook(handle["aws_conn_id"],
                                                                 handle.get("region_name", "")), log)
            if result is None:
                return JobStatus(JobState.FAILED, why)
            return JobStatus(JobState.SUCCEEDED, result=result)
        if state == "Failed":
            return JobStatus(JobState.FAILED, f"{handle['kind']} {handle['k8s_name']} failed: {message}")
        if state == "Suspended":
            return JobStatus(JobState.STOPPED, f"{handle['kind']} {handle['k8s_name']} was suspended")
        if state in ("Running", "Restarting"):
            return JobStatus(JobState.RUNNING, f"{state} {message}".strip())
        return JobStatus(JobState.PENDING, state or "waiting for the operator")

    def stop(self, handle: dict[str, Any]) -> None:
        group, version, plural = group_version_plural(handle["kind"])
        with self._kube(handle) as kube:
            kube.custom_object_client.patch_namespaced_custom_object(
                group=group, version=version, namespace=handle["namespace"], plural=plural,
                name=handle["k8s_name"], body={"spec": {"runPolicy": {"suspend": True}}})
        log.info("Suspended %s %s", handle["kind"], handle["k8s_name"])

    def read_logs(self, handle: dict[str, Any], cursor: Any = None) -> tuple[list[str], Any]:
        """The first pod's (node 0's) log; the cursor counts lines already shown."""
        seen = int(cursor or 0)
        with self._kube(handle) as kube:
            pods = kube.core_v1_client.list_namespaced_pod(namespace=handle["namespace"]).items
            mine = sorted(p.metadata.name for p in pods if p.metadata.name.startswith(handle["k8s_name"] + "-"))
            if not mine:
                return [], seen
            try:
                text = kube.core_v1_client.read_namespaced_pod_log(name=mine[0],
                                                                   namespace=handle["namespace"])
            except Exception:  # the container has not started yet
                return [], seen
        lines = text.splitlines()
        return lines[seen:], len(lines)
