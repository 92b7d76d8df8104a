"""Schemas of the Kubernetes job resources the hyperpod backend creates, and a strict validator.

`pytorchjobs.kubeflow.org.json` is the published Kubeflow PyTorchJob CRD (as SageMaker HyperPod's
Helm chart installs it; see scripts/vendor_crd.py). `hyperpodpytorchjobs.sagemaker.amazonaws.com.json`
is written from the HyperPod training operator's CRD fields (aws/sagemaker-hyperpod-cli,
hyperpod_pytorch_job_unified_config.py) and reuses the PyTorchJob's pod template schema.

The API server prunes fields a structural schema does not declare: a misspelt field would vanish
without an error. Validation here is stricter: every object that lists its properties refuses
any other.
"""

from __future__ import annotations

import copy
import functools
import json
import pkgutil
import re
from typing import Any

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
FILES = {"PyTorchJob": "pytorchjobs.kubeflow.org.json",
         "HyperPodPyTorchJob": "hyperpodpytorchjobs.sagemaker.amazonaws.com.json"}


class ManifestError(ValueError):
    """The manifest breaks its CRD's schema; the message lists each path and problem."""


@functools.lru_cache(maxsize=None)
def crd(kind: str) -> dict[str, Any]:
    data = json.loads(pkgutil.get_data(__name__, FILES[kind]))
    if kind == "HyperPodPyTorchJob":  # the same core/v1 PodTemplateSpec as the PyTorchJob's
        template = crd("PyTorchJob")["versions"]["v1"]["properties"]["spec"]["properties"][
            "pytorchReplicaSpecs"]["additionalProperties"]["properties"]["template"]
        spec = data["versions"]["v1"]["properties"]["spec"]
        spec["properties"]["replicaSpecs"]["items"]["properties"]["template"] = copy.deepcopy(template)
    return data


def _strict(schema: Any) -> Any:
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out and \
                not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.lru_cache(maxsize=None)
def _validator(kind: str):
    import jsonschema

    data = crd(kind)
    schema = _strict(copy.deepcopy(data["versions"]["v1"]))
    schema["properties"]["metadata"] = {"type": "object"}  # checked by `_metadata` below
    return jsonschema.Draft7Validator(schema)


def group_version_plural(kind: str) -> tuple[str, str, str]:
    data = crd(kind)
    return data["group"], "v1", data["plural"]


def validate_manifest(manifest: dict[str, Any]) -> None:
    """Raise ManifestError unless `manifest` is a valid PyTorchJob or HyperPodPyTorchJob."""
    kind = manifest.get("kind")
    if kind not in FILES:
        raise ManifestError(f"kind must be one of {sorted(FILES)}, got {kind!r}")
    group, version, _ = group_version_plural(kind)
    problems = []
    if manifest.get("apiVersion") != f"{group}/{version}":
        problems.append(f"apiVersion: expected {group}/{version}, got {manifest.get('apiVersion')!r}")
    problems += _metadata(manifest.get("metadata") or {}, "metadata")
    for error in sorted(_validator(kind).iter_errors(manifest), key=lambda e: list(e.absolute_path)):
        path = ".".join(str(p) for p in error.absolute_path) or "(root)"
        problems.append(f"{path}: {error.message}")
    for i, template in enumerate(_templates(manifest)):
        problems += _metadata(template.get("metadata") or {}, f"template[{i}].metadata", name=False)
    if problems:
        raise ManifestError(f"{kind} manifest is invalid:\n  " + "\n  ".join(problems))


def _templates(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    spec = manifest.get("spec") or {}
    if "pytorchReplicaSpecs" in spec:
        return [r.get("template") or {} for r in spec["pytorchReplicaSpecs"].values()]
    return [r.get("template") or {} for r in spec.get("replicaSpecs") or []]


def _metadata(meta: dict[str, Any], where: str, name: bool = True) -> list[str]:
    problems = []
    if name and not DNS_LABEL.match(str(meta.get("name", ""))):
        problems.append(f"{where}.name: {meta.get('name')!r} must be a DNS label (a-z, 0-9, -; "
                        "at most 63, starting and ending alphanumeric)")
    if "namespace" in meta and not DNS_LABEL.match(str(meta["namespace"])):
        problems.append(f"{where}.namespace: {meta['namespace']!r} is not a DNS label")
    for key, value in (meta.get("labels") or {}).items():
        if not LABEL_KEY.match(key) or len(key.split("/")[-1]) > 63:
            problems.append(f"{where}.labels: key {key!r} is not a valid label key")
        if not isinstance(value, str) or not LABEL_VALUE.match(value):
            problems.append(f"{where}.labels[{key!r}]: {value!r} is not a valid label value "
                            "(at most 63 of A-Z a-z 0-9 - _ ., alphanumeric at both ends)")
    for key, value in (meta.get("annotations") or {}).items():
        if not isinstance(value, str):
            problems.append(f"{where}.annotations[{key!r}] must be a string")
    return problems
