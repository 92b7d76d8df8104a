"""Vendor a CustomResourceDefinition's schema for manifest validation, descriptions stripped.

    python scripts/vendor_crd.py CRD.yaml OUT.json --source "where it came from"

The PyTorchJob schema in plugins/llmops/jobs/backends/hyperpod/crds/ was made from the Kubeflow
training operator's CRD as the SageMaker HyperPod Helm chart installs it
(aws/sagemaker-hyperpod-cli: helm_chart/HyperPodHelmChart/charts/training-operators/crds/
pytorchjobs.kubeflow.org-CustomResourceDefinition.yaml, Apache-2.0).
"""

from __future__ import annotations

import argparse
import json

import yaml


def strip(node):
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("crd")
    parser.add_argument("out")
    parser.add_argument("--source", required=True)
    args = parser.parse_args()
    with open(args.crd) as fh:
        crd = next(d for d in yaml.safe_load_all(fh) if d and d.get("kind") == "CustomResourceDefinition")
    versions = {v["name"]: strip(v["schema"]["openAPIV3Schema"]) for v in crd["spec"]["versions"]}
    out = {"source": args.source, "group": crd["spec"]["group"], "kind": crd["spec"]["names"]["kind"],
           "plural": crd["spec"]["names"]["plural"], "versions": versions}
    with open(args.out, "w") as fh:
        json.dump(out, fh, separators=(",", ":"), sort_keys=True)
        fh.write("\n")


if __name__ == "__main__":
    main()
