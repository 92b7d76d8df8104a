"""HyperPod on EKS manifests: a HyperPodPyTorchJob (auto-resume, log-based hang detection) and a
Kubeflow PyTorchJob, validated against the CRD schemas shipped in the repo. A misspelt or
mistyped field fails here; the API server would silently prune it."""

from __future__ import annotations

import copy

import pytest

from llmops.jobs.backends import remote
from llmops.jobs.backends.crds import ManifestError, crd, validate_manifest
from llmops.jobs.backends.hyperpod import HyperPodBackend, k8s_name, manifest, priority_class
from llmops.jobs.backends.settings import HyperPodSettings
from llmops.jobs.spec import JobSpec, JobSpecError, job_name
from tests.aws_fixtures import IMAGE

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
    cfg = HyperPodSettings(kind=kind, staging_uri=STAGING, image=IMAGE, eks_cluster_name="hp",
                           gpus_per_node=8, efa_per_node=32, cpu="180", memory="1800Gi",
                           namespace="hyperpod-ns-{team}", queue_name="hyperpod-ns-{team}-localqueue",
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
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1" and env["NCCL_DEBUG"] == "INFO"


def test_kubeflow_pytorch_job_has_master_workers_and_auto_resume_labels():
    body = render("PyTorchJob")
    assert body["apiVersion"] == "kubeflow.org/v1"
    replicas = body["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 3
    labels = body["metadata"]["labels"]
    assert labels["sagemaker.amazonaws.com/enable-job-auto-resume"] == "true"
    assert labels["sagemaker.amazonaws.com/job-max-retry-count"] == "3"
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
])
def test_manifest_mistakes_are_caught(kind, mutate, message):
    body = copy.deepcopy(render(kind))
    mutate(body)
    with pytest.raises(ManifestError) as err:
        validate_manifest(body)
    assert message in str(err.value)


def _container(body: dict) -> dict:
    spec_ = body["spec"]
    replica = spec_["replicaSpecs"][0] if "replicaSpecs" in spec_ else spec_["pytorchReplicaSpecs"]["Master"]
    return replica["template"]["spec"]["containers"][0]


def test_schemas_come_from_the_published_crds():
    kubeflow = crd("PyTorchJob")
    assert "aws/sagemaker-hyperpod-cli@" in kubeflow["source"] and kubeflow["plural"] == "pytorchjobs"
    spec_ = kubeflow["versions"]["v1"]["properties"]["spec"]
    assert spec_["required"] == ["pytorchReplicaSpecs"]
    hyperpod = crd("HyperPodPyTorchJob")
    run_policy = hyperpod["versions"]["v1"]["properties"]["spec"]["properties"]["runPolicy"]
    assert {"jobMaxRetryCount", "logMonitoringConfiguration"} <= set(run_policy["properties"])


def test_settings_mistakes_name_the_fix():
    with pytest.raises(JobSpecError, match="kind 'MPIJob' is not one of"):
        render("MPIJob")
    with pytest.raises(ValueError, match="eks_cluster_name"):
        HyperPodBackend(settings={"hyperpod": {"staging_uri": STAGING}}).submit(spec())
    assert priority_class("100", {"0": "low", "500": "high"}) == "low"
    assert priority_class("", {"0": "low"}) == ""
