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
                                  and job-max-retry-count *annotations* (the HyperPod docs'
                                  "Running jobs using kubectl"; as labels they are ignored):
                                  after a node fault HyperPod replaces the node and restarts
                                  the job, which resumes from its checkpoints
    settings.require_healthy_nodes -> node affinity: only nodes HyperPod's health agent marks
                                  Schedulable, preferring those whose deep health check Passed
    settings.log_monitoring    -> runPolicy.logMonitoringConfiguration: hang and slowness
                                  detection from the job's log lines (HyperPodPyTorchJob)
    spec.tags team / priority  -> namespace and Kueue queue (task governance), priority class;
                                  no namespace set: `kubeflow` for a PyTorchJob (HyperPod
                                  auto-resumes a PyTorchJob only there or in a `hyperpod*`
                                  namespace: another is refused while max_retry_count > 0),
                                  `default` for a HyperPodPyTorchJob
    spec.max_run_seconds       -> runPolicy.activeDeadlineSeconds
    (always)                   -> runPolicy.cleanPodPolicy All: a failed or finished job's pods
                                  are deleted, not left holding their GPUs; the elastic agent's
                                  port (AGENT_PORT, as in AWS's HyperPodPyTorchJob example)
                                  declared on the container; LLMOPS_WORKDIR set, so the entry
                                  can tell which pod hosted rank 0 (docker/job_entry.py is_leader)

Names: the job's Kubernetes name is its attempt name lower-cased within MAX_NAME characters, cut
from the readable front so that the spec name's hash survives (remote.attempt_name): two runs of
one long task id never share a name, which would make the second reattach to the first's job.

Manifests are validated against the CRD schemas in crds/ before they are sent. Credentials: the
AWS connection's session signs an EKS token for `eks_cluster_name` (in process: no kubeconfig, no
exec plugin), or `kubernetes_conn_id` names a Kubernetes connection. One API client per (cluster,
connection, region) lives in the process (the worker, or the triggerer across all its triggers)
and renews its token every TOKEN_REFRESH_SECONDS, or at once on a 401. Pods are listed by the
`llmops/job` label this backend puts on its pod template, and logs are read since the last line
shown (timestamps dedupe the overlap), not downloaded whole on every poll.

Stopping deletes the job resource (foreground: its pods go first) after writing
`<staging>/<spec name>/<job>/stopped.json`, so status() says STOPPED, and a retry starts the next
attempt. A job someone else deleted (`kubectl delete`) fails its try, and the retry starts the
next attempt too: `created.json`, written beside the manifest once the API server has the job,
tells a job that was made and is gone from one not made yet. Not runPolicy.suspend: under Kueue
`suspend` belongs to Kueue, which sets it while a job waits for quota and clears it on
admission, so a suspended job can be started again behind our back; a deleted one cannot, and
its quota is released at once. A job that is Suspended (queued or
preempted by Kueue) is PENDING, not stopped, and says why in Kueue's own words: the message of
its Workload (kueue.x-k8s.io/v1beta1, found by the `kueue.x-k8s.io/job-uid` label Kueue puts on
it) while its quota is not reserved or it was evicted ("couldn't assign flavors to pod set
master: insufficient unused quota for nvidia.com/gpu ..."); the training operator's condition
says only "<kind> <name> is suspended.". Reading it needs `list` on workloads.kueue.x-k8s.io in
the job's namespace; without it the operator's words are shown.

A job whose pods wait for nodes (no Kueue queue, or admitted by Kueue before the nodes are
there) is PENDING in the scheduler's own words: the message of its pods' PodScheduled condition
while False with reason Unschedulable ("0/4 nodes are available: 4 Insufficient nvidia.com/gpu.
..."), which the training operator's Created condition does not carry. The watch says it in the
task log with the time waited, and again while it lasts (llmops.jobs.watch). Reading it needs
`list` on pods (deploy/iam/hyperpod-rbac.yaml), which the logs already need.
"""

from __future__ import annotations

import logging
import time
import uuid
from datetime import datetime
from typing import Any

from llmops.infra.aws import s3
from llmops.jobs.backends import remote, shared
from llmops.jobs.backends.base import Backend, JobState, JobStatus
from llmops.jobs.backends.hyperpod.crds import group_version_plural
from llmops.jobs.backends.hyperpod.hyperpod_hook import KubeClient, client_key, kube_client, pod_log
from llmops.jobs.backends.hyperpod.hyperpod_manifest import (JOB_LABEL, MAX_NAME, k8s_name,
                                                             manifest, namespace_of, run_selector)
from llmops.jobs.backends.backend_settings import load
from llmops.jobs.backends.hyperpod.hyperpod_settings import HyperPodSettings
from llmops.jobs.spec import JobSpec, JobSpecError
from llmops.jobs.watch import call_with_retries

log = logging.getLogger(__name__)

KINDS = ("HyperPodPyTorchJob", "PyTorchJob")
TOKEN_ANNOTATION = "llmops/submit-token"   # this try's token, on the job its create made
CREATE_ATTEMPTS = 5   # a create sent this often at most while its answers are lost
FIRST_LOG_LINES = 1000          # the first read of a pod's log: its tail, not all of it
LOG_OVERLAP_SECONDS = 10        # re-read this much before the last line (clock skew, same-second lines)
STOP_RECORD = "stopped.json"
CREATED_RECORD = "created.json"   # written once the API server has the job (see submit's `get`)
FINISHED = ("Succeeded", "Completed", "Failed")
KUEUE_WORKLOADS = ("kueue.x-k8s.io", "v1beta1", "workloads")   # group, version, plural
KUEUE_JOB_UID = "kueue.x-k8s.io/job-uid"   # on the Workload Kueue makes for a job: the job's uid


def job_state(resource: dict[str, Any]) -> tuple[str, str]:
    """(condition type, message) of the job's newest true condition; ("", "") before any."""
    conditions = [c for c in (resource.get("status") or {}).get("conditions") or []
                  if str(c.get("status")) == "True"]
    if not conditions:
        return "", ""
    newest = max(conditions, key=lambda c: c.get("lastTransitionTime") or "")
    return newest.get("type", ""), newest.get("message") or newest.get("reason") or ""


def _epoch(timestamp: Any) -> float | None:
    """RFC 3339 text (as the API server writes it) or a datetime -> epoch seconds."""
    if isinstance(timestamp, datetime):
        return timestamp.timestamp()
    if not timestamp:
        return None
    try:
        return datetime.fromisoformat(str(timestamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def suspended(resource: dict[str, Any], state: str) -> bool:
    """Held by Kueue: the operator's Suspended condition, or suspend set before it reconciled."""
    policy = (resource.get("spec") or {}).get("runPolicy") or {}
    return state == "Suspended" or (state in ("", "Created") and bool(policy.get("suspend")))


def kueue_reason(kube: "KubeClient", resource: dict[str, Any], namespace: str) -> str:
    """Why Kueue holds the job, in its words: the message of its Workload's QuotaReserved or
    Admitted condition while not true, or of its Evicted condition; "" when none can be read
    (no Kueue, no permission to list workloads, not made yet)."""
    uid = (resource.get("metadata") or {}).get("uid")
    if not uid:
        return ""
    group, version, plural = KUEUE_WORKLOADS
    try:
        found = kube.call("custom", "list_namespaced_custom_object", group=group, version=version,
                          plural=plural, namespace=namespace, label_selector=f"{KUEUE_JOB_UID}={uid}")
    except Exception as exc:  # noqa: BLE001 - the operator's own words stand in
        log.debug("Could not read the Kueue workload of %s: %s", uid, exc)
        return ""
    for workload in (found or {}).get("items") or []:
        for condition in (workload.get("status") or {}).get("conditions") or []:
            waiting = condition.get("type") in ("QuotaReserved", "Admitted") and condition.get("status") != "True"
            evicted = condition.get("type") == "Evicted" and condition.get("status") == "True"
            if (waiting or evicted) and condition.get("message"):
                return str(condition["message"])
    return ""


def _model_field(obj: Any, name: str) -> Any:
    """A field of a kubernetes client model, or of the same object as a dict."""
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def unschedulable_reason(kube: "KubeClient", handle: dict[str, Any]) -> str:
    """Why the job's pods wait for nodes, in the scheduler's words (pods_unschedulable); "" when
    none does or the pods cannot be listed."""
    try:
        pods = kube.call("core", "list_namespaced_pod", namespace=handle["namespace"],
                         label_selector=f"{JOB_LABEL}={handle['k8s_name']}").items
    except Exception as exc:  # noqa: BLE001 - the operator's own words stand in
        log.debug("Could not list the pods of %s: %s", handle["k8s_name"], exc)
        return ""
    return pods_unschedulable(pods)


def pods_unschedulable(pods: list[Any]) -> str:
    """"<n> of <m> pods unschedulable: <its message>" from the PodScheduled condition (False,
    reason Unschedulable) of the first such pod; "" when none is."""
    get = _model_field
    messages = []
    for pod in sorted(pods or [], key=lambda p: str(get(get(p, "metadata") or {}, "name"))):
        for condition in get(get(pod, "status") or {}, "conditions") or []:
            if (get(condition, "type"), get(condition, "status"), get(condition, "reason")) == \
                    ("PodScheduled", "False", "Unschedulable"):
                messages.append(str(get(condition, "message") or "no message"))
    if not messages:
        return ""
    return f"{len(messages)} of {len(pods)} pods unschedulable: {messages[0]}"


def started_at(resource: dict[str, Any]) -> float | None:
    """When the job began running: status.startTime, else when its Running condition turned true."""
    status = resource.get("status") or {}
    if status.get("startTime"):
        return _epoch(status["startTime"])
    running = [c for c in status.get("conditions") or [] if c.get("type") == "Running"]
    return _epoch(running[0].get("lastTransitionTime")) if running else None


def _log_key(timestamp: str) -> str:
    """A sortable form of a kubelet log timestamp (RFC 3339 with up to 9 fractional digits,
    trailing zeros trimmed, so the raw strings do not sort)."""
    whole, _, frac = timestamp.rstrip("Z").partition(".")
    return f"{whole}.{frac[:9].ljust(9, '0')}"


def _missing(exc: Exception) -> bool:
    return getattr(exc, "status", None) == 404


def read_job(kube: KubeClient, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    """The job resource `name` (its Kubernetes name), or None where the API server has none."""
    group, version, plural = group_version_plural(kind)
    try:
        return kube.call("custom", "get_namespaced_custom_object", group=group, version=version,
                         plural=plural, name=name, namespace=namespace)
    except Exception as exc:
        if _missing(exc):
            return None
        raise


class HyperPodBackend(Backend):
    name = "hyperpod"
    poll_interval = 30   # seconds: a job runs for hours; every poll is an API server round trip

    def __init__(self, settings: dict[str, Any] | None = None):
        self._settings = settings

    # -- reads: a job's own, or (a trigger's) one list for every job of its DAG run --------------
    def _resource(self, kube: KubeClient, handle: dict[str, Any]) -> dict[str, Any] | None:
        """The job resource; None where the API server has none. A trigger's comes from one list
        by label of its run's jobs, shared by the process's triggers; a job the list lacks (gone,
        or not listed yet) is read on its own, so a deletion is told as before."""
        selector = handle.get("run_selector")
        if self.shared_max_age and selector:
            key = (*client_key(handle), handle["namespace"], handle["kind"], selector, handle["k8s_name"])
            found = self._jobs_board(handle).get(key, self.shared_max_age)
            if found is not None:
                return found
        return read_job(kube, handle["kind"], handle["k8s_name"], handle["namespace"])

    def _pods(self, kube: KubeClient, handle: dict[str, Any]) -> list[Any]:
        """The job's pods (by its `llmops/job` label): a trigger's from one list of every pod of
        its run's jobs in the namespace, shared by the process's triggers."""
        selector = handle.get("run_selector")
        if self.shared_max_age and selector:
            key = (*client_key(handle), handle["namespace"], selector, handle["k8s_name"])
            pods = self._pods_board(handle).get(key, self.shared_max_age)
            if pods is not None:
                return pods
        return kube.call("core", "list_namespaced_pod", namespace=handle["namespace"],
                         label_selector=f"{JOB_LABEL}={handle['k8s_name']}").items or []

    def _jobs_board(self, handle: dict[str, Any]) -> shared.SharedReads:
        def read(keys: list[tuple]) -> dict[tuple, Any]:
            found = {}
            for head, _ in shared.grouped(keys, len(keys[0]) - 1).items():
                *_, namespace, kind, selector = head
                group, version, plural = group_version_plural(kind)
                listed = kube_client(handle).call("custom", "list_namespaced_custom_object", group=group,
                                                  version=version, plural=plural, namespace=namespace,
                                                  label_selector=selector)
                found.update({(*head, item["metadata"]["name"]): item for item in (listed or {}).get("items") or []})
            return found

        return shared.board(("hyperpod-jobs", *client_key(handle)), lambda: shared.SharedReads(read, 10_000))

    def _pods_board(self, handle: dict[str, Any]) -> shared.SharedReads:
        def read(keys: list[tuple]) -> dict[tuple, Any]:
            found: dict[tuple, list[Any]] = {}
            for head, members in shared.grouped(keys, len(keys[0]) - 1).items():
                *_, namespace, selector = head
                pods = kube_client(handle).call("core", "list_namespaced_pod", namespace=namespace,
                                                label_selector=f"{selector},{JOB_LABEL}").items
                for key in members:
                    found[key] = []
                for pod in pods or []:
                    labels = _model_field(_model_field(pod, "metadata") or {}, "labels") or {}
                    found.setdefault((*head, labels.get(JOB_LABEL)), []).append(pod)
            return found

        return shared.board(("hyperpod-pods", *client_key(handle)), lambda: shared.SharedReads(read, 10_000))

    def _settings_for(self, spec: JobSpec) -> HyperPodSettings:
        return load("hyperpod", HyperPodSettings, self._settings).for_job(spec)

    def fingerprint(self, spec: JobSpec) -> str:
        """The deployment's settings for the stage: a change to them is a different job."""
        return remote.settings_fingerprint(self._settings_for(spec))

    def submit(self, spec: JobSpec) -> dict[str, Any]:
        if not spec.name:
            raise JobSpecError("JobSpec.name is required to submit: it makes retries reattach.")
        settings = self._settings_for(spec)
        settings.require("staging_uri", backend="hyperpod")
        if not (settings.eks_cluster_name or settings.kubernetes_conn_id):
            settings.require("eks_cluster_name", backend="hyperpod")
        remote.check_environment(spec.env)
        remote.warn_if_unreachable(spec.env, log)
        group, version, plural = group_version_plural(settings.kind)
        namespace = namespace_of(spec, settings)
        kube = kube_client(settings)
        s3_hook = s3.s3_hook(settings.aws_conn_id, settings.region_name, settings.kms_key_id)

        def read(name: str) -> dict[str, Any] | None:
            return read_job(kube, settings.kind, k8s_name(name), namespace)

        def get(name: str) -> dict[str, Any] | None:
            """The attempt's job; a gone one that existed still counts as an attempt, so the
            retry takes the next name (a log, result and stop record of its own, as SageMaker's
            `-r2`): deleted by stop() (its stop record), or by someone else (`kubectl delete`),
            which leaves only the record written once the API server had the job. That record
            is written after the create, so with it a miss is no race with another try's create
            in flight; the second read makes sure (the API server's reads are linearizable)."""
            found = read(name)
            if found is not None:
                return found
            prefix = remote.plan(spec, name, settings.staging_uri).prefix
            if s3.read_json(s3_hook, _stop_uri(prefix)):
                return {"status": {"conditions": [{"type": "Stopped", "status": "True"}]}}
            if not s3.read_json(s3_hook, s3.join(prefix, CREATED_RECORD)):
                return None
            return read(name) or {"status": {"conditions": [{"type": "Failed", "status": "True"}]}}

        def created(staged: remote.Staged, job_name: str) -> None:
            s3.write_json(s3_hook, s3.join(staged.prefix, CREATED_RECORD),
                          {"kind": settings.kind, "name": k8s_name(job_name), "at": time.time()})

        attempt, found = remote.latest_attempt(spec.name, get, max_len=MAX_NAME)
        state = job_state(found)[0] if found else ""
        if found is not None and state not in ("Failed", "Stopped"):
            job_name = remote.attempt_name(spec.name, attempt, MAX_NAME)
            staged = remote.plan(spec, job_name, settings.staging_uri)
            created(staged, job_name)   # again: the try that made it may have died before
            return self._handle(spec, settings, staged, job_name, namespace, attempt, True)
        attempt += 1
        job_name = remote.attempt_name(spec.name, attempt, MAX_NAME)
        staged = remote.plan(spec, job_name, settings.staging_uri)
        body = manifest(spec, settings, staged, k8s_name(job_name))
        token = uuid.uuid4().hex   # tells this try's create from another try's
        body["metadata"]["annotations"][TOKEN_ANNOTATION] = token
        remote.upload(staged, s3_hook, log)
        s3.write_json(s3_hook, s3.join(staged.prefix, "manifest.json"), body)

        def create() -> bool:
            try:
                kube.call("custom", "create_namespaced_custom_object", group=group, version=version,
                          plural=plural, body=body, namespace=namespace)
                return True
            except Exception as exc:
                if getattr(exc, "status", None) != 409:
                    raise
                return False

        # A create whose answer was lost (the connection dropped after the API server took it;
        # urllib3 does not resend a POST) is sent again: the name makes the resend harmless,
        # a 409 at most. Any other error is raised: the next try reattaches by name.
        if not call_with_retries(create, f"create {settings.kind} {k8s_name(job_name)}",
                                 attempts=CREATE_ATTEMPTS, logger=log):
            # 409 Conflict: this try's own create (its first answer lost), or another try's a
            # moment ago; use it either way.
            existing = read(job_name) or {}
            created(staged, job_name)
            ours = ((existing.get("metadata") or {}).get("annotations") or {}).get(TOKEN_ANNOTATION) == token
            log.info("%s %s/%s already exists (%s): using it", settings.kind, namespace, k8s_name(job_name),
                     "created by this try, its first answer lost" if ours else "another try's")
            return self._handle(spec, settings, staged, job_name, namespace, attempt, not ours)
        created(staged, job_name)
        log.info("Created %s %s/%s (%d node(s))", settings.kind, namespace, k8s_name(job_name),
                 remote.merged(spec, settings)["instance_count"])
        return self._handle(spec, settings, staged, job_name, namespace, attempt, False)

    def _handle(self, spec, settings, staged, job_name, namespace, attempt, reattached) -> dict[str, Any]:
        return {"backend": self.name, "name": spec.name, "job_name": job_name,
                "k8s_name": k8s_name(job_name), "kind": settings.kind, "namespace": namespace,
                "namespace_resolved": namespace, "attempt": attempt,
                "aws_conn_id": settings.aws_conn_id, "region_name": settings.region_name,
                "eks_cluster_name": settings.eks_cluster_name,
                "kubernetes_conn_id": settings.kubernetes_conn_id,
                "result_uri": staged.result_uri, "staging_prefix": staged.prefix,
                "checkpoint_uri": staged.checkpoint_uri,
                "copy_back": staged.copy_back, "reattached": reattached,
                "kms_key_id": settings.kms_key_id, "run_selector": run_selector(spec),
                **remote.resource_fields(spec, settings), **remote.watch_fields(settings)}

    def _s3(self, handle: dict[str, Any]) -> Any:
        return s3.s3_hook(handle["aws_conn_id"], handle.get("region_name", ""), handle.get("kms_key_id"))

    def status(self, handle: dict[str, Any]) -> JobStatus:
        kube = kube_client(handle)
        resource = self._resource(kube, handle)
        what = f"{handle['kind']} {handle['k8s_name']}"
        if resource is None or (resource.get("metadata") or {}).get("deletionTimestamp"):
            stopped = s3.read_json(self._s3(handle), _stop_uri(_prefix(handle)))
            if stopped:
                return JobStatus(JobState.STOPPED, f"{what} was stopped and deleted",
                                 details={"stopped": stopped})
            if resource is None:
                return JobStatus(JobState.FAILED, f"{what} no longer exists: it was deleted, not by "
                                 "this task (kubectl delete, or its namespace removed)")
        state, message = job_state(resource)
        details: dict[str, Any] = {"state": state}
        # Queue time counts from when the API server had the job (max_queue_seconds), not from
        # when the operator began submitting: staging the inputs to S3 is no wait for nodes.
        created = _epoch((resource.get("metadata") or {}).get("creationTimestamp"))
        if created is not None:
            details["submitted_at"] = created
        begun = started_at(resource)
        if begun is not None:
            details["started_at"] = begun
        ended = _epoch((resource.get("status") or {}).get("completionTime"))
        if ended is not None:
            details["ended_at"] = ended
        if state in ("Succeeded", "Completed"):
            result, why = remote.fetch_result(handle, self._s3(handle), log)
            if result is None:
                return JobStatus(JobState.FAILED, why, details=details)
            return JobStatus(JobState.SUCCEEDED, result=result, details=details)
        if state == "Failed":
            # the operator says which replica failed, not with which code: a job that paused on
            # request (exit PAUSED_EXIT) is told by the result its entry published
            return JobStatus(JobState.FAILED, f"{what} failed: {message}", details=details,
                             result=remote.paused_result(handle, self._s3(handle)))
        if suspended(resource, state):
            # Kueue holds a job suspended until its queue admits it, and again when preempted.
            why = kueue_reason(kube, resource, handle["namespace"])
            return JobStatus(JobState.PENDING, f"suspended by Kueue: {why}" if why else
                             f"suspended by Kueue (queued or preempted) {message}".strip(), details=details)
        if state in ("Running", "Restarting"):
            return JobStatus(JobState.RUNNING, f"{state} {message}".strip(), details=details)
        # Created: its pods may wait for nodes; the scheduler says why, the operator does not.
        try:
            why = pods_unschedulable(self._pods(kube, handle))
        except Exception as exc:  # noqa: BLE001 - the operator's own words stand in
            log.debug("Could not list the pods of %s: %s", handle["k8s_name"], exc)
            why = ""
        return JobStatus(JobState.PENDING, why or state or "waiting for the operator", details=details)

    def stop(self, handle: dict[str, Any]) -> None:
        """Record the stop, then delete the job (see the module docstring for why not suspend)."""
        kube = kube_client(handle)
        resource = read_job(kube, handle["kind"], handle["k8s_name"], handle["namespace"])
        if resource is None or job_state(resource)[0] in FINISHED:
            return  # nothing runs; a finished job keeps its record
        # Written first: if the delete is lost, the job is still there and status() reads it;
        # if the record were written after, a crash between the two would read "no longer exists".
        s3.write_json(self._s3(handle), _stop_uri(_prefix(handle)),
                      {"stopped_at": time.time(), "kind": handle["kind"], "name": handle["k8s_name"],
                       "state": job_state(resource)[0] or "Pending"})
        group, version, plural = group_version_plural(handle["kind"])
        try:
            kube.call("custom", "delete_namespaced_custom_object", group=group, version=version,
                      plural=plural, name=handle["k8s_name"], namespace=handle["namespace"],
                      propagation_policy="Foreground")  # its pods are gone before it is
        except Exception as exc:
            if not _missing(exc):
                raise
        log.info("Deleted %s %s (stopped)", handle["kind"], handle["k8s_name"])

    # -- logs --------------------------------------------------------------------------------
    def _first_pod(self, kube: KubeClient, handle: dict[str, Any]) -> str | None:
        """Node 0's pod (the master of a PyTorchJob): the one with the job's label, first by name."""
        names = sorted(_model_field(_model_field(p, "metadata"), "name") for p in self._pods(kube, handle))
        masters = [n for n in names if "-master-" in n]
        return (masters or names or [None])[0]

    def read_logs(self, handle: dict[str, Any], cursor: Any = None) -> tuple[list[str], Any]:
        """Node 0's new log lines. The cursor holds the pod, the timestamp of the last line shown
        and how many lines carried it; each read asks for the seconds since then (plus an overlap)
        and drops what was shown. The first read takes the last FIRST_LOG_LINES lines."""
        if not remote.log_due(cursor):
            return [], cursor
        state = {k: v for k, v in cursor.items() if not k.startswith("_")} if isinstance(cursor, dict) else {}
        kube = kube_client(handle)
        pod = self._first_pod(kube, handle)
        if pod is None:
            return [], remote.log_cursor(state)
        if state.get("pod") != pod:   # a new pod (first read, or replaced after a node fault)
            state = {"pod": pod}
        last, shown = state.get("last", ""), int(state.get("n", 0))
        if last:
            since = _epoch(last[:19] + "Z") or time.time()
            query = {"since_seconds": max(1, int(time.time() - since) + LOG_OVERLAP_SECONDS)}
        else:
            query = {"tail_lines": FIRST_LOG_LINES}
        try:
            text = pod_log(kube, pod, handle["namespace"], timestamps=True, **query)
        except Exception:  # the container has not started yet
            return [], remote.log_cursor(state)
        lines, seen_at_last = [], 0
        for raw in text.splitlines():
            stamp, _, line = raw.partition(" ")
            key = _log_key(stamp)
            if last and key < last:
                continue
            if last and key == last:
                seen_at_last += 1
                if seen_at_last <= shown:
                    continue
            lines.append(line)
            if key == state.get("last"):
                state["n"] = state.get("n", 0) + 1
            else:
                state.update(last=key, n=1)
        return lines, remote.log_cursor(state)

    def log_tail(self, handle: dict[str, Any], lines: int = 40) -> list[str]:
        """The last `lines` lines of node 0's log (for a failure message)."""
        kube = kube_client(handle)
        pod = self._first_pod(kube, handle)
        if pod is None:
            return []
        try:
            text = pod_log(kube, pod, handle["namespace"], tail_lines=lines)
        except Exception:
            return []
        return text.splitlines()[-lines:]


def _prefix(handle: dict[str, Any]) -> str:
    return handle.get("staging_prefix") or handle["result_uri"].rsplit("/", 1)[0]


def _stop_uri(prefix: str) -> str:
    return s3.join(prefix, STOP_RECORD)
