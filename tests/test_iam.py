"""The IAM a deployment needs (deploy/iam/) against the AWS calls the code makes.

A platform team creates the roles from these files; a call the code makes that the files do not
grant fails on AWS with AccessDenied, mid-run, and nothing here would notice: moto checks no IAM.
So the code is scanned for every AWS operation it calls (boto3 client methods, the amazon
provider's S3Hook methods, Kubernetes API calls of the HyperPod backend) and each one must be
granted to the identity that makes it:

  plugins/          the Airflow side: MWAA's execution role (scheduler, workers, triggerer)
                    -> deploy/iam/airflow-role.json, and in EKS -> deploy/iam/hyperpod-rbac.yaml
  docker/, tasks/   the job containers: SageMaker's and Batch's job role, HyperPod pods' role
                    -> deploy/iam/job-role.json (trust: deploy/iam/job-role-trust.json)

Every action in the files must name an operation that exists in botocore's service model (or
one of the few IAM-only permissions), so a typo in a policy fails here, not on AWS.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import botocore.session
import pytest
import yaml
from botocore import xform_name

ROOT = Path(__file__).resolve().parents[1]
IAM = ROOT / "deploy" / "iam"
# Services the code calls; IAM action names equal their operation names.
SERVICES = ("sagemaker", "batch", "logs", "eks", "s3")
# Permissions that are not API operations of their service.
IAM_ONLY = {"iam:PassRole", "s3:ListBucket", "sts:TagSession"}
# S3 calls whose IAM action is not their operation's name, and the provider S3Hook's methods.
S3_ACTIONS = {
    "list_objects_v2": "s3:ListBucket", "head_bucket": "s3:ListBucket", "head_object": "s3:GetObject",
    "download_file": "s3:GetObject", "upload_file": "s3:PutObject", "delete_objects": "s3:DeleteObject",
    "create_multipart_upload": "s3:PutObject", "upload_part": "s3:PutObject",
    "complete_multipart_upload": "s3:PutObject",
    "load_string": "s3:PutObject", "load_bytes": "s3:PutObject", "load_file": "s3:PutObject",
    "read_key": "s3:GetObject", "get_key": "s3:GetObject", "check_for_key": "s3:GetObject",
    "list_keys": "s3:ListBucket", "list_prefixes": "s3:ListBucket",
}
# The amazon provider's notifiers and hook methods that make an AWS call of their own, by the name
# the code uses (llmops.infra.notify publishes alerts through SnsNotifier).
PROVIDER_ACTIONS = {"SnsNotifier": "sns:Publish", "publish_to_target": "sns:Publish"}
# Method names that are also AWS operations but are not AWS calls where this code makes them.
NOT_AWS = {
    "search": "re.Pattern.search",
    "verify": "our own signature checks (replay, reuse)",
    "describe_job": "the JobBackend interface's own method",
    "stop_job": "the JobBackend interface's own method, and Ray's job client",
    "create_experiment": "MLflow's client",
    "submit_job": "Ray's job client in backends/ray/; Batch's SubmitJob is matched in batch/backend.py",
}
# `client.op(...)` or `client.op` passed on (a retry wrapper), `get_paginator("op")`, and operation
# names kept in tables ("describe_training_job").
CALLS = (re.compile(r"\.([a-z][a-z0-9_]+)\b"), re.compile(r"get_paginator\(\s*[\"']([a-z0-9_]+)[\"']"),
         re.compile(r"[\"']((?:describe|stop|list|create)_[a-z_]+)[\"']"),
         re.compile(r"\b(SnsNotifier)\("))


def _operations() -> dict[str, list[str]]:
    session = botocore.session.get_session()
    ops: dict[str, list[str]] = {}
    for service in SERVICES:
        prefix = "s3" if service == "s3" else session.get_service_model(service).signing_name
        for op in session.get_service_model(service).operation_names:
            ops.setdefault(xform_name(op), []).append(f"{prefix}:{op}")
    return ops


OPERATIONS = _operations()


def _called(*roots: str) -> dict[str, set[str]]:
    """Per AWS operation (snake name) the files that call it."""
    found: dict[str, set[str]] = {}
    for root in roots:
        for path in (ROOT / root).rglob("*.py"):
            text = path.read_text()
            names = {name for pattern in CALLS for name in pattern.findall(text)}
            for name in names:
                if name in NOT_AWS and not (name == "submit_job" and path.match("batch/backend.py")):
                    continue
                if name in OPERATIONS or name in S3_ACTIONS or name in PROVIDER_ACTIONS:
                    found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def _granted(policy: dict) -> set[str]:
    actions: set[str] = set()
    for statement in policy["Statement"]:
        assert statement["Effect"] == "Allow", statement
        listed = statement["Action"]
        actions.update([listed] if isinstance(listed, str) else listed)
    return actions


def _needed(name: str) -> list[str]:
    """The IAM actions of which one must be granted for a call of `name`."""
    if name in PROVIDER_ACTIONS:
        return [PROVIDER_ACTIONS[name]]
    return [S3_ACTIONS[name]] if name in S3_ACTIONS else OPERATIONS[name]


def _policy(name: str) -> dict:
    policy = json.loads((IAM / name).read_text())
    assert policy["Version"] == "2012-10-17"
    return policy


@pytest.mark.parametrize("side, roots, policy", [
    ("Airflow side (MWAA execution role)", ("plugins", "dags"), "airflow-role.json"),
    ("job containers (job role)", ("docker", "tasks"), "job-role.json"),
])
def test_every_aws_call_the_code_makes_is_granted(side, roots, policy):
    granted = _granted(_policy(policy))
    called = _called(*roots)
    assert called, f"no AWS call found in {roots}: the scan is broken"
    missing = [f"{name} (one of {_needed(name)}) in {sorted(files)}"
               for name, files in sorted(called.items())
               if not any(action in granted for action in _needed(name))]
    assert not missing, f"{side}: deploy/iam/{policy} lacks:\n" + "\n".join(missing)
    sse = any("aws:kms" in p.read_text() for r in roots for p in (ROOT / r).rglob("*.py"))
    if sse:   # SSE-KMS writes need a data key, reads of them need Decrypt
        assert {"kms:GenerateDataKey", "kms:Decrypt"} <= granted


@pytest.mark.parametrize("name", ["airflow-role.json", "job-role.json", "job-role-trust.json"])
def test_every_action_in_the_policies_exists(name):
    session = botocore.session.get_session()
    unknown = []
    for action in _granted(_policy(name)):
        if action in IAM_ONLY:
            continue
        prefix, op = action.split(":", 1)
        service = {"cloudwatch": "cloudwatch", "logs": "logs"}.get(prefix, prefix)
        if op not in session.get_service_model(service).operation_names:
            unknown.append(action)
    assert not unknown, f"{name}: no such operation in botocore's models: {unknown}"


def test_jobs_role_is_trusted_by_every_service_that_runs_a_job():
    principals = set()
    for statement in _policy("job-role-trust.json")["Statement"]:
        listed = statement["Principal"]["Service"]
        principals.update([listed] if isinstance(listed, str) else listed)
    # SageMaker training/processing, Batch containers (ECS tasks), HyperPod pods (EKS Pod Identity)
    assert {"sagemaker.amazonaws.com", "ecs-tasks.amazonaws.com", "pods.eks.amazonaws.com"} <= principals


KUBE_CALL = re.compile(r"kube\.call\(\s*\"(core|custom)\",\s*\"([a-z_]+)\"")
KUBE_VERBS = {"create": "create", "get": "get", "read": "get", "list": "list", "delete": "delete",
              "patch": "patch", "replace": "update"}


def test_hyperpod_rbac_grants_every_kubernetes_call():
    from llmops.jobs.backends.hyperpod.crds import FILES, group_version_plural

    docs = [d for d in yaml.safe_load_all((IAM / "hyperpod-rbac.yaml").read_text()) if d]
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    allowed = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    calls = set(KUBE_CALL.findall("".join(
        path.read_text() for path in sorted((ROOT / "plugins/llmops/jobs/backends/hyperpod").glob("*.py")))))
    assert calls, "no Kubernetes call found in the HyperPod backend: the scan is broken"
    needed = set()
    for api, method in calls:
        verb, _, rest = method.partition("_namespaced_")
        if api == "custom":   # every kind the backend can submit
            needed |= {(*group_version_plural(kind)[::2], KUBE_VERBS[verb]) for kind in FILES}
        elif rest == "pod_log":
            needed.add(("", "pods/log", KUBE_VERBS[verb]))
        else:
            needed.add(("", rest + "s", KUBE_VERBS[verb]))
    from llmops.jobs.backends.hyperpod.hyperpod_backend import KUEUE_WORKLOADS

    # a custom-object list whose resource is Kueue's Workloads (kueue_reason), not a job kind
    needed.add((KUEUE_WORKLOADS[0], KUEUE_WORKLOADS[2], "list"))
    assert needed - allowed == set(), f"hyperpod-rbac.yaml lacks {sorted(needed - allowed)}"
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
