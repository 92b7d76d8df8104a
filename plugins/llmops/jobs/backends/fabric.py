"""The network environment of a job across instances (EFA, GPUDirect RDMA, NCCL), shared by the
SageMaker, Batch and HyperPod requests."""

from __future__ import annotations

import re

# Instance types with Elastic Fabric Adapter, and those with GPUDirect RDMA over it (EC2 names;
# SageMaker's carry an "ml." prefix).
EFA_TYPES = {"p3dn.24xlarge", "p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge",
             "p5en.48xlarge", "p6-b200.48xlarge", "g5.48xlarge", "g6.48xlarge", "g6e.48xlarge",
             "trn1.32xlarge", "trn1n.32xlarge"}
RDMA_TYPES = {"p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge",
              "p6-b200.48xlarge"}


def is_gpu(instance_type: str) -> bool:
    return bool(re.match(r"(ml\.)?(p\d|g\d)", instance_type))


def fabric_env(instance_type: str, instance_count: int, efa: bool | None = None) -> dict[str, str]:
    """EFA and NCCL settings for collectives across instances (none on a single instance).

    NCCL_DEBUG=WARN: warnings and errors only. INFO prints thousands of lines per rank at start
    (every ring and channel), which CloudWatch ingests and bills, and MWAA's task log copies
    again; set NCCL_DEBUG=INFO in the stage's env to see whether NCCL picked EFA ("NET/OFI
    Selected Provider is efa") and GPUDirect RDMA ("via NET/AWS Libfabric/1/GDRDMA"). `efa`
    overrides the lookup by instance type (Batch knows its EFA devices, not always the type)."""
    name = instance_type.removeprefix("ml.")
    has_efa = name in EFA_TYPES if efa is None else efa
    if instance_count < 2 or not (is_gpu(name) or has_efa):
        return {}
    env = {"NCCL_DEBUG": "WARN"}
    if has_efa:
        env.update(FI_PROVIDER="efa", NCCL_PROTO="simple")
        if name in RDMA_TYPES:
            env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    return env
