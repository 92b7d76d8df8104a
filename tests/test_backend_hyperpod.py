"""HyperPod on EKS manifests: a HyperPodPyTorchJob (auto-resume, log-based hang detection) and a
Kubeflow PyTorchJob, validated against the CRD schemas shipped in the repo. A misspelt or
mistyped field fails here; the API server would silently prune it."""

from __future__ import annotations

import copy
import json

import pytest

from llmops.jobs.backends import JobState, remote
from llmops.jobs.backends.backend_settings import load
from llmops.jobs.backends.hyperpod.crds import ManifestError, crd, validate_manifest
from llmops.jobs.backends.hyperpod.hyperpod_backend import HyperPodBackend
from llmops.jobs.backends.hyperpod.hyperpod_manifest import k8s_name, manifest, priority_class
from llmops.jobs.backends.hyperpod.hyperpod_settings import HyperPodSettings
from llmops.jobs.backends.remote_settings import BackendSettingsError
from llmops.jobs.spec import JobSpec, JobSpecError, job_name
from tests.aws_fixtures import CONN_ID, IMAGE

STAGING = "s3://llmops-test/staging"


def spec(**changes) -> JobSpec:
    base = JobSpec(stage="pretrain", entrypoint="tasks.pretrain",
                   name=job_name("llm_lifecycle", "run", "pretrain", prefix="Pretrain_Task"),
                   config={"data_dir": "s3://b/data", "output_dir": "s3://b/pretrain"},
                   instance_type="ml.p5.48xlarge", instance_count=4, nproc_per_node=8,
                   max_run_seconds=7 * 24 * 3600, env={"MLFLOW_RUN_ID": "abc"},
                   tags={"team": "research", "priority": "700"})
    return base.replace(**changes)


def render(kind: str = "HyperPodPyTorchJob", job: JobSpec | None = None, **settings) -> dict:
    job = job or spec()
    settings = {"namespace": "hyperpod-ns-{team}", "queue_name": "hyperpod-ns-{team}-localqueue",
                **settings}
    cfg = HyperPodSettings(kind=kind, staging_uri=STAGING, image=IMAGE, eks_cluster_name="hp",
                           gpus_per_node=8, efa_per_node=32, cpu="180", memory="1800Gi",
                           priority_classes={"0": "low-priority", "500": "training-priority"},
                           **settings)
    name = remote.attempt_name(job.name, 1, 48)
    return manifest(job, cfg, remote.plan(job, name, STAGING), k8s_name(name))


def test_hyperpod_pytorch_job_has_nodes_resources_auto_resume_and_hang_detection():
    body = render()
    assert body["apiVersion"] == "sagemaker.amazonaws.com/v1" and body["kind"] == "HyperPodPyTorchJob"
    meta = body["metadata"]
    assert meta["namespace"] == "hyperpod-ns-research"
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "hyperpod-ns-research-localqueue"
    assert meta["labels"]["kueue.x-k8s.io/priority-class"] == "training-priority"
    assert len(meta["name"]) <= 48 and meta["name"] == meta["name"].lower()
    spec_ = body["spec"]
    assert spec_["nprocPerNode"] == "8" and spec_["replicaSpecs"][0]["replicas"] == 4
    run_policy = spec_["runPolicy"]
    assert run_policy["jobMaxRetryCount"] == 3                   # auto-resume after node faults
    assert run_policy["activeDeadlineSeconds"] == 7 * 24 * 3600
    rule = run_policy["logMonitoringConfiguration"][0]
    assert rule["expectedRecurringFrequencyInSeconds"] == 900     # no progress line for 15 min = hang
    pod = spec_["replicaSpecs"][0]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32,
                                                 "cpu": "180", "memory": "1800Gi"}
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "ml.p5.48xlarge"}
    args = container["args"]
    assert args[args.index("--launcher") + 1] == "hyperpodrun" and args[args.index("--nnodes") + 1] == "4"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1" and env["NCCL_DEBUG"] == "WARN"


def test_kubeflow_pytorch_job_has_master_workers_and_auto_resume_annotations():
    body = render("PyTorchJob")
    assert body["apiVersion"] == "kubeflow.org/v1"
    replicas = body["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 3
    # HyperPod's auto-resume reads annotations; as labels the keys were silently ignored.
    annotations, labels = body["metadata"]["annotations"], body["metadata"]["labels"]
    assert annotations["sagemaker.amazonaws.com/enable-job-auto-resume"] == "true"
    assert annotations["sagemaker.amazonaws.com/job-max-retry-count"] == "3"
    assert not any(key.startswith("sagemaker.amazonaws.com/") for key in labels)
    container = replicas["Master"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch"
    assert container["args"][container["args"].index("--launcher") + 1] == "torchrun"
    single = render("PyTorchJob", spec(instance_count=1))
    assert "Worker" not in single["spec"]["pytorchReplicaSpecs"]


@pytest.mark.parametrize("kind", ["HyperPodPyTorchJob", "PyTorchJob"])
@pytest.mark.parametrize("mutate, message", [
    (lambda b: b["spec"].__setitem__("nprocPerNod", "8"), "Additional properties are not allowed ('nprocPerNod'"),
    (lambda b: b["spec"].__setitem__("nprocPerNode", 8), "8 is not of type 'string'"),
    (lambda b: _container(b).__setitem__("imagePullPolicy", 3), "3 is not of type 'string'"),
    (lambda b: _container(b)["resources"].__setitem__("limit", {}), "'limit' was unexpected"),
    (lambda b: _container(b)["resources"]["limits"].__setitem__("memory", "lots"), "does not match"),
    (lambda b: b["metadata"].__setitem__("name", "Pretrain_Job"), "must be a DNS label"),
    (lambda b: b["metadata"]["labels"].__setitem__("llmops/stage", "x" * 64), "not a valid label value"),
    (lambda b: _pod(b)["affinity"]["nodeAffinity"].__setitem__("requiredDuringScheduling", {}),
     "Additional properties are not allowed ('requiredDuringScheduling'"),
])
def test_manifest_mistakes_are_caught(kind, mutate, message):
    body = copy.deepcopy(render(kind))
    mutate(body)
    with pytest.raises(ManifestError) as err:
        validate_manifest(body)
    assert message in str(err.value)


def _pod(body: dict) -> dict:
    spec_ = body["spec"]
    replica = spec_["replicaSpecs"][0] if "replicaSpecs" in spec_ else spec_["pytorchReplicaSpecs"]["Master"]
    return replica["template"]["spec"]


def _container(body: dict) -> dict:
    return _pod(body)["containers"][0]


def test_schemas_come_from_the_published_crds():
    kubeflow = crd("PyTorchJob")
    assert "aws/sagemaker-hyperpod-cli@" in kubeflow["source"] and kubeflow["plural"] == "pytorchjobs"
    spec_ = kubeflow["versions"]["v1"]["properties"]["spec"]
    assert spec_["required"] == ["pytorchReplicaSpecs"]
    hyperpod = crd("HyperPodPyTorchJob")
    run_policy = hyperpod["versions"]["v1"]["properties"]["spec"]["properties"]["runPolicy"]
    assert {"jobMaxRetryCount", "logMonitoringConfiguration"} <= set(run_policy["properties"])


def test_settings_mistakes_name_the_fix():
    with pytest.raises(BackendSettingsError, match="kind 'MPIJob' is not one of"):
        render("MPIJob")
    with pytest.raises(ValueError, match="eks_cluster_name"):
        HyperPodBackend(settings={"hyperpod": {"staging_uri": STAGING}}).submit(spec())
    assert priority_class("100", {"0": "low", "500": "high"}) == "low"
    assert priority_class("", {"0": "low"}) == ""


@pytest.mark.parametrize("kind", ["HyperPodPyTorchJob", "PyTorchJob"])
def test_pods_stay_off_unhealthy_nodes_and_carry_the_job_label(kind):
    body = render(kind)
    affinity = _pod(body)["affinity"]["nodeAffinity"]
    required = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert required == [{"matchExpressions": [{"key": "sagemaker.amazonaws.com/node-health-status",
                                               "operator": "In", "values": ["Schedulable"]}]}]
    preferred = affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"]
    assert preferred["matchExpressions"] == [{"key": "sagemaker.amazonaws.com/deep-health-check-status",
                                              "operator": "In", "values": ["Passed"]}]
    templates = ([body["spec"]["replicaSpecs"][0]["template"]] if kind == "HyperPodPyTorchJob"
                 else [r["template"] for r in body["spec"]["pytorchReplicaSpecs"].values()])
    assert all(t["metadata"]["labels"]["llmops/job"] == body["metadata"]["name"] for t in templates)
    assert "affinity" not in _pod(render(kind, require_healthy_nodes=False))


# -- submit, status, stop and logs against a fake API server and moto's S3 ---------------------

class ApiError(Exception):
    def __init__(self, status: int):
        super().__init__(f"({status})")
        self.status = status


class FakeCluster:
    """The few API calls the backend makes, in memory, in the shape the kubernetes client returns."""

    def __init__(self):
        self.objects: dict[tuple[str, str], dict] = {}
        self.invisible: set[str] = set()   # names a get misses (another try created it meanwhile)
        self.logs: dict[str, list[str]] = {}   # pod -> "timestamp line" records
        self.calls: list[tuple[str, dict]] = []

    def call(self, api: str, method: str, **kw):
        from types import SimpleNamespace

        self.calls.append((method, kw))
        key = (kw.get("namespace"), kw.get("name") or (kw.get("body") or {}).get("metadata", {}).get("name"))
        if method == "get_namespaced_custom_object":
            if key not in self.objects or key[1] in self.invisible:
                raise ApiError(404)
            return copy.deepcopy(self.objects[key])
        if method == "create_namespaced_custom_object":
            if key in self.objects:
                raise ApiError(409)
            self.objects[key] = copy.deepcopy(kw["body"])
            return kw["body"]
        if method == "delete_namespaced_custom_object":
            self.objects.pop(key)
            return {}
        if method == "list_namespaced_pod":
            label, _, value = kw["label_selector"].partition("=")
            pods = [f"{name}-master-0" for (ns, name), body in self.objects.items()
                    if ns == kw["namespace"] and label == "llmops/job" and name == value]
            return SimpleNamespace(items=[SimpleNamespace(metadata=SimpleNamespace(name=n)) for n in pods])
        if method == "read_namespaced_pod_log":
            records = self.logs.get(kw["name"], [])
            if "tail_lines" in kw:
                records = records[-kw["tail_lines"]:]
            text = "\n".join(records if kw.get("timestamps") else [r.split(" ", 1)[1] for r in records])
            text = text + "\n" if text else ""
            # _preload_content=False: the HTTP response, its body undecoded
            return SimpleNamespace(data=text.encode()) if kw.get("_preload_content") is False else text
        raise AssertionError(method)

    def set_condition(self, name: str, kind: str, **status):
        body = next(b for (ns, n), b in self.objects.items() if n == name)
        body["status"] = {"conditions": [{"type": kind, "status": "True",
                                          "lastTransitionTime": "2026-01-01T00:00:00Z"}], **status}


@pytest.fixture()
def cluster(monkeypatch, moto_server):
    from llmops.jobs.backends.hyperpod import hyperpod_hook as hyperpod

    moto_server.bucket("llmops-test")
    fake = FakeCluster()
    connects = []
    monkeypatch.setattr(hyperpod, "_CLIENTS", {})
    monkeypatch.setattr(hyperpod, "connect", lambda *key: connects.append(key) or fake)
    fake.connects = connects
    return fake


def hp_settings(**changes) -> dict:
    return {"hyperpod": {"aws_conn_id": CONN_ID, "staging_uri": STAGING, "image": IMAGE,
                         "eks_cluster_name": "hp", "namespace": "hyperpod-ns-{team}",
                         "queue_name": "hyperpod-ns-{team}-localqueue", **changes}}


def test_queued_running_stopped_and_retried_against_a_fake_cluster(cluster, moto_server):
    backend = HyperPodBackend(settings=hp_settings())
    job = spec(instance_count=2)
    handle = backend.submit(job)
    assert handle["reattached"] is False and handle["k8s_name"] == k8s_name(job.name)
    validate_manifest(cluster.objects[("hyperpod-ns-research", handle["k8s_name"])])
    # Kueue holds a job suspended until it is admitted: waiting, not stopped.
    cluster.set_condition(handle["k8s_name"], "Suspended")
    assert backend.status(handle).state is JobState.PENDING
    cluster.set_condition(handle["k8s_name"], "Running", startTime="2026-01-01T00:00:05Z")
    status = backend.status(handle)
    assert status.state is JobState.RUNNING and status.details["started_at"] == 1767225605.0
    assert backend.submit(job)["reattached"] is True
    backend.stop(handle)
    deletes = [kw for method, kw in cluster.calls if method == "delete_namespaced_custom_object"]
    assert deletes == [{"group": "sagemaker.amazonaws.com", "version": "v1", "plural": "hyperpodpytorchjobs",
                        "name": handle["k8s_name"], "namespace": "hyperpod-ns-research",
                        "propagation_policy": "Foreground"}]
    assert not any(method == "patch_namespaced_custom_object" for method, _ in cluster.calls)
    stopped = backend.status(handle)   # gone from the cluster, but its stop was recorded first
    assert stopped.state is JobState.STOPPED and "stopped" in stopped.message
    retry = backend.submit(job)
    assert retry["attempt"] == 2 and retry["reattached"] is False
    assert retry["job_name"] == remote.attempt_name(job.name, 2, 48)
    assert cluster.connects == [("hp", "", CONN_ID, "")], "one API client for the process"


def test_a_conflict_on_create_reattaches(cluster, moto_server):
    backend = HyperPodBackend(settings=hp_settings())
    job = spec()
    first = backend.submit(job)
    # The get raced with another try's create: it missed the job, and that try had not yet
    # written the record it writes once the API server has the job.
    cluster.invisible.add(first["k8s_name"])
    bucket, _, prefix = first["staging_prefix"].removeprefix("s3://").partition("/")
    moto_server.client("s3").delete_object(Bucket=bucket, Key=f"{prefix}/created.json")
    again = backend.submit(job)
    assert again["reattached"] is True and again["job_name"] == first["job_name"]
    assert len(cluster.objects) == 1


def test_started_at_falls_back_to_the_running_condition():
    from llmops.jobs.backends.hyperpod.hyperpod_backend import started_at

    resource = {"status": {"conditions": [{"type": "Created", "status": "True",
                                           "lastTransitionTime": "2026-01-01T00:00:00Z"},
                                          {"type": "Running", "status": "True",
                                           "lastTransitionTime": "2026-01-01T00:01:00Z"}]}}
    assert started_at(resource) == 1767225660.0
    assert started_at({"status": {}}) is None


def test_logs_are_read_by_label_and_since_the_last_line(cluster, monkeypatch):
    from llmops.jobs.backends.hyperpod import hyperpod_backend as hyperpod

    backend = HyperPodBackend(settings=hp_settings())
    handle = backend.submit(spec())
    pod = f"{handle['k8s_name']}-master-0"
    cluster.logs[pod] = [f"2026-01-01T00:00:0{i}.5Z step {i}" for i in range(5)]
    cluster.logs[pod].append("2026-01-01T00:00:04.5Z same instant")
    monkeypatch.setattr(hyperpod.time, "time", lambda: 1767225610.0)   # 00:00:10
    lines, cursor = backend.read_logs(handle, 0)
    assert lines == ["step 0", "step 1", "step 2", "step 3", "step 4", "same instant"]
    reads = [kw for method, kw in cluster.calls if method == "read_namespaced_pod_log"]
    assert reads[-1]["tail_lines"] == hyperpod.FIRST_LOG_LINES and reads[-1]["timestamps"] is True
    assert reads[-1]["_preload_content"] is False   # client 36 garbles a decoded log (hyperpod.pod_log)
    lists = [kw for method, kw in cluster.calls if method == "list_namespaced_pod"]
    assert lists[-1]["label_selector"] == f"llmops/job={handle['k8s_name']}"
    # Lines keep coming, two in the same (trimmed) instant as the last one shown.
    cluster.logs[pod] += ["2026-01-01T00:00:04.5Z also then", "2026-01-01T00:00:09.25Z step 9"]
    cursor["_next_read"] = 0
    lines, cursor = backend.read_logs(handle, cursor)
    assert lines == ["also then", "step 9"]
    again = [kw for method, kw in cluster.calls if method == "read_namespaced_pod_log"][-1]
    assert again["since_seconds"] == 6 + hyperpod.LOG_OVERLAP_SECONDS and "tail_lines" not in again
    cursor["_next_read"] = 0
    assert backend.read_logs(handle, cursor)[0] == []
    assert backend.log_tail(handle, lines=2) == ["also then", "step 9"]


def test_the_token_is_renewed_before_it_expires_and_on_401(monkeypatch):
    from llmops.jobs.backends.hyperpod import hyperpod_hook as hyperpod

    tokens, clock = iter(f"t{i}" for i in range(10)), [1000.0]
    monkeypatch.setattr(hyperpod.time, "monotonic", lambda: clock[0])
    from types import SimpleNamespace

    failures = [401]

    class Custom:
        def get_namespaced_custom_object(self, **kw):
            if failures:
                raise ApiError(failures.pop())
            return {"ok": config.api_key["authorization"]}

    config = SimpleNamespace(api_key={})
    kube = hyperpod.KubeClient(Custom(), None, config, token=lambda: next(tokens))
    assert config.api_key == {"authorization": "Bearer t0"}
    assert kube.call("custom", "get_namespaced_custom_object")["ok"] == "Bearer t1"   # 401 -> renewed
    clock[0] += hyperpod.TOKEN_REFRESH_SECONDS - 1
    assert kube.call("custom", "get_namespaced_custom_object")["ok"] == "Bearer t1"
    clock[0] += 2
    assert kube.call("custom", "get_namespaced_custom_object")["ok"] == "Bearer t2"


def test_an_eks_client_is_made_in_process_from_describe_cluster(moto_server):
    """DescribeCluster (moto's EKS) and a signed token; no kubeconfig file, no exec plugin."""
    from llmops.jobs.backends.hyperpod import hyperpod_hook as hyperpod

    eks = moto_server.client("eks")
    eks.create_cluster(name="hp-moto", roleArn="arn:aws:iam::123456789012:role/eks",
                       resourcesVpcConfig={"subnetIds": []})
    kube = hyperpod.connect("hp-moto", "", CONN_ID, "")
    configuration = kube.custom.api_client.configuration
    assert configuration.host == eks.describe_cluster(name="hp-moto")["cluster"]["endpoint"]
    token = configuration.api_key["authorization"]
    assert token.startswith("Bearer k8s-aws-v1.")
    url = __import__("base64").urlsafe_b64decode(token.split(".", 1)[1] + "==").decode()
    assert "Action=GetCallerIdentity" in url and "x-k8s-aws-id" in url


def test_fingerprint_follows_the_deployment_settings_and_the_handle_says_how_to_wait(cluster):
    job = spec()
    base = HyperPodBackend(settings=hp_settings()).fingerprint(job)
    assert base == HyperPodBackend(settings=hp_settings()).fingerprint(job)
    assert HyperPodBackend(settings=hp_settings(gpus_per_node=4)).fingerprint(job) != base
    assert HyperPodBackend.poll_interval == 30
    handle = HyperPodBackend(settings=hp_settings()).submit(job)
    assert handle["poll_interval"] == 30.0 and "deadline_grace_seconds" in handle


def test_every_job_carries_the_cost_allocation_labels_sanitized():
    """dag_id, run_id, team, stage as labels (Kubernetes label values: at most 63 of
    [A-Za-z0-9_.-], alphanumeric at both ends) on the job and its pods; exact values as annotations."""
    import re

    run_id = "manual__2026-11-30T01:00:00.123456+00:00" + "x" * 40
    body = render(job=spec(tags={"team": "research", "dag_id": "llm_lifecycle", "run_id": run_id}))
    validate_manifest(body)
    labels = body["metadata"]["labels"]
    value_rule = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
    for key in ("llmops/dag-id", "llmops/run-id", "llmops/team", "llmops/stage"):
        assert value_rule.match(labels[key]) and len(labels[key]) <= 63, (key, labels[key])
        assert body["spec"]["replicaSpecs"][0]["template"]["metadata"]["labels"][key] == labels[key]
    assert labels["llmops/run-id"].startswith("manual__2026-11-30T01_00_00.123456_00_00")
    assert (labels["llmops/dag-id"], labels["llmops/team"], labels["llmops/stage"]) == (
        "llm_lifecycle", "research", "pretrain")
    assert body["metadata"]["annotations"]["llmops/run-id"] == run_id


# -- what the cluster would take silently and do wrong ------------------------------------------

def test_two_runs_of_a_long_task_id_get_two_kubernetes_names():
    """A 48-character task id: the name's head fills the 48 characters Kubernetes names get here;
    cutting there dropped the hash, and the second run reattached to the first run's job."""
    task = "pretrain_with_a_rather_long_descriptive_task_id_x"
    first, second = (job_name("llm_lifecycle", run, task, prefix=task) for run in ("run-1", "run-2"))
    names = [k8s_name(remote.attempt_name(n, 1, 48)) for n in (first, second)]
    assert names[0] != names[1]
    assert [n[-12:] for n in names] == [first[-12:], second[-12:]], "the hash is kept whole"
    assert all(len(n) <= 48 for n in names)
    retry = k8s_name(remote.attempt_name(first, 2, 48))
    assert retry.endswith(f"-{first[-12:]}-r2") and len(retry) <= 48
    # A name without a hash of its own gets one: still unique when cut.
    plain = ["a" * 60 + "-x", "a" * 60 + "-y"]
    assert len({remote.attempt_name(n, 1, 48) for n in plain}) == 2
    with pytest.raises(JobSpecError, match="not a valid kubernetes job name"):
        remote.check_name("kubernetes", "Upper-Case")


def test_a_failed_jobs_pods_are_cleaned_up_and_the_agent_port_is_declared():
    for kind in ("HyperPodPyTorchJob", "PyTorchJob"):
        body = render(kind)
        validate_manifest(body)
        # None left a failed job's pods on their nodes, holding every GPU until someone noticed.
        assert body["spec"]["runPolicy"]["cleanPodPolicy"] == "All"
    # hyperpodrun talks to the HyperPod training operator on 8080 (AWS's example declares it).
    assert _container(render())["ports"] == [{"containerPort": 8080}]
    assert "ports" not in _container(render("PyTorchJob"))
    # The entry finds the stage's result in a known work dir (docker/job_entry.py is_leader).
    env = {e["name"]: e["value"] for e in _container(render())["env"]}
    assert env["LLMOPS_WORKDIR"] == "/tmp/llmops-job"


def test_a_pytorch_job_goes_where_hyperpod_auto_resumes_it():
    """HyperPod auto-resumes a PyTorchJob only in `kubeflow` or a `hyperpod*` namespace; the
    default namespace used to be `default`, where a node fault ended the job for good."""
    default = load("hyperpod", HyperPodSettings, {"hyperpod": {"kind": "PyTorchJob"}})
    body = render("PyTorchJob", namespace="", queue_name="")
    assert default.resolved_namespace() == "kubeflow" and body["metadata"]["namespace"] == "kubeflow"
    assert body["metadata"]["annotations"]["sagemaker.amazonaws.com/enable-job-auto-resume"] == "true"
    assert render("PyTorchJob")["metadata"]["namespace"] == "hyperpod-ns-research"
    with pytest.raises(BackendSettingsError, match=r"namespace 'default'.*kubeflow.*max_retry_count"):
        load("hyperpod", HyperPodSettings, {"hyperpod": {"kind": "PyTorchJob", "namespace": "default"}})
    # A namespace made from the team is checked when the team is known.
    with pytest.raises(BackendSettingsError, match="namespace 'research-jobs'"):
        render("PyTorchJob", namespace="{team}-jobs")
    # Without auto-resume asked for, any namespace; a HyperPodPyTorchJob resumes in any.
    assert render("PyTorchJob", namespace="default", max_retry_count=0)["metadata"]["namespace"] == "default"
    assert render(namespace="default")["spec"]["runPolicy"]["jobMaxRetryCount"] == 3
    assert load("hyperpod", HyperPodSettings, {}).resolved_namespace() == "default"


def _entry():
    import importlib.util

    from tests.aws_fixtures import ENTRY

    module_spec = importlib.util.spec_from_file_location("job_entry_under_test", ENTRY)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_only_the_pod_that_ran_rank_0_leads_a_hyperpod_job(tmp_path, monkeypatch):
    """In a HyperPodPyTorchJob pod nothing names the pod's node (the elastic rendezvous numbers
    them): every pod read itself as node 0, and each uploaded its outputs and wrote the result.
    The stage writes its result on global rank 0 only; that pod leads."""
    entry = _entry()
    args, _ = entry.parse_args(["--entrypoint", "tasks.pretrain", "--config", "c.json", "--result",
                                "s3://b/r.json", "--launcher", "hyperpodrun", "--nnodes", "4"])
    for name in ("AWS_BATCH_JOB_NUM_NODES", "PET_NODE_RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PET_NNODES", "4")   # if the operator sets it: still no node rank
    pods = [tmp_path / f"pod-{i}" for i in range(4)]
    leaders = []
    for i, workdir in enumerate(pods):
        workdir.mkdir()
        if i == 2:   # the rendezvous put global rank 0 on the third pod
            (workdir / "result.json").write_text("{}")
        monkeypatch.setenv("LLMOPS_WORKDIR", str(workdir))
        leaders.append(entry.is_leader(args))
    assert leaders == [False, False, True, False]
    # Kubeflow's PyTorchJob names each pod's node: that rule is unchanged.
    torchrun, _ = entry.parse_args(["--entrypoint", "tasks.pretrain", "--config", "c.json",
                                    "--result", "r.json", "--launcher", "torchrun"])
    monkeypatch.setenv("PET_NODE_RANK", "0")
    assert entry.is_leader(torchrun)
    monkeypatch.setenv("PET_NODE_RANK", "1")
    assert not entry.is_leader(torchrun)


def test_every_object_the_backend_writes_is_encrypted_with_the_kms_key(cluster, moto_server):
    key = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"
    backend = HyperPodBackend(settings=hp_settings(kms_key_id=key))
    handle = backend.submit(spec(name=job_name("kms", prefix="hp-kms")))
    body = cluster.objects[("hyperpod-ns-research", handle["k8s_name"])]
    backend.stop(handle)   # the stop record too
    s3 = moto_server.client("s3")
    prefix = handle["staging_prefix"][len("s3://llmops-test/"):]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="llmops-test", Prefix=prefix)["Contents"]]
    assert {k.rsplit("/", 1)[-1] for k in keys} >= {"manifest.json", "created.json", "stopped.json"}
    for k in keys:
        head = s3.head_object(Bucket="llmops-test", Key=k)
        assert (head["ServerSideEncryption"], head["SSEKMSKeyId"]) == ("aws:kms", key), k
    env = {e["name"]: e["value"] for e in body["spec"]["replicaSpecs"][0]["template"]["spec"]
           ["containers"][0]["env"]}
    assert env["LLMOPS_S3_KMS_KEY_ID"] == key   # the job's own writes (docker/job_entry.py)
    with pytest.raises(BackendSettingsError, match="kms_key_id 'my key' is not a KMS key"):
        load("hyperpod", HyperPodSettings, {"hyperpod": {"kms_key_id": "my key"}})


# -- against the simulated cluster (tests/chaos/fake_eks.py): Kueue, a lost create ------------

@pytest.fixture()
def eks(monkeypatch, moto_server, tmp_path):
    from llmops.jobs.backends.hyperpod import hyperpod_hook as hyperpod
    from tests.chaos.fake_eks import FakeEks

    moto_server.bucket("llmops-test")
    fake = FakeEks(tmp_path / "eks", {})
    monkeypatch.setattr(hyperpod, "_CLIENTS", {})
    monkeypatch.setattr(hyperpod, "connect", lambda *key: fake)
    yield fake
    fake.shutdown()


@pytest.mark.parametrize("kind", ["HyperPodPyTorchJob", "PyTorchJob"])
def test_a_job_kueue_holds_waits_in_kueues_words(eks, kind):
    """Kueue suspends a queued job until its quota is reserved; the operator's condition says only
    that it is suspended, so the waiting state names Kueue's reason from the job's Workload."""
    eks.hold_for_capacity(600)   # never admitted here: no pod starts
    backend = HyperPodBackend(settings=hp_settings(kind=kind, gpus_per_node=8))
    handle = backend.submit(spec(name=job_name("kueue", kind, prefix="hp-kueue")))
    status = backend.status(handle)
    assert status.state is JobState.PENDING, status
    assert status.message == ("suspended by Kueue: couldn't assign flavors to pod set "
                              f"{'master' if kind == 'PyTorchJob' else 'pod'}: insufficient unused "
                              "quota for nvidia.com/gpu in flavor default-flavor, 32 more needed")
    assert "started_at" not in status.details
    # queue time (max_queue_seconds) counts from the API server's creation, not from staging
    created = eks.job(handle["k8s_name"]).created_at
    assert abs(status.details["submitted_at"] - created) < 0.01, (status.details, created)


def test_a_create_whose_answer_was_lost_is_resent_and_its_job_recognised(eks):
    """The API server made the job and the connection dropped before its answer: the resend
    gets a 409, and the token annotation says the job is this try's own (not reattached)."""
    eks.hold_for_capacity(600)
    eks.lose_responses("create_namespaced_custom_object")
    backend = HyperPodBackend(settings=hp_settings())
    handle = backend.submit(spec(name=job_name("lost", prefix="hp-lost")))
    creates = [kw for method, kw in eks.calls if method == "create_namespaced_custom_object"]
    assert len(creates) == 2 and len(eks.report()["jobs"]) == 1
    assert [i["operation"] for i in eks.report()["injections"]] == ["create_namespaced_custom_object"]
    assert handle["reattached"] is False and handle["attempt"] == 1


def test_a_failed_job_that_paused_on_request_is_told_by_its_published_result(cluster, moto_server):
    """The operator says a replica failed, not with which code: a job whose entry published a
    paused result (docker/job_entry.py, PAUSED_EXIT) carries it, so its task can say "paused at
    step N"; a plain failure has none."""
    from llmops.airflow.operators.job_pause import paused

    backend = HyperPodBackend(settings=hp_settings())
    handle = backend.submit(spec())
    cluster.set_condition(handle["k8s_name"], "Failed")
    assert backend.status(handle).result is None and paused(backend.status(handle)) == (False, None)
    bucket, key = handle["result_uri"][len("s3://"):].split("/", 1)
    moto_server.client("s3").put_object(Bucket=bucket, Key=key, Body=json.dumps(
        {"paused": True, "paused_at_step": 40, "metrics": {"step": 40}}).encode())
    status = backend.status(handle)
    assert status.state is JobState.FAILED and paused(status) == (True, 40)
