"""Accelerators: the dense bf16 peak of each one, by its exact name, and which one a SageMaker
instance type carries.

One table for both sides: a training job reads its device's peak for MFU
(tasks.train.runtime.peak_flops, from torch.cuda.get_device_name), and the Airflow side's budget
estimator (plugins/llmops/policy/budget.py) reads the peak of the instance type a stage will run
on. Standard library only: the MWAA bundle ships this module beside tasks/configs/.

Peaks are dense (no structured sparsity) bf16 tensor-core figures from the vendors' data sheets.
Names are matched exactly, after normalising what the CUDA driver reports ("NVIDIA H100 80GB
HBM3" is an H100 SXM, "NVIDIA H100 PCIe" a PCIe card): substring matching gave an H100 PCIe or NVL
the SXM's 989 TFLOP/s and an L40 the L4's 121. A device that is not listed has no known peak, and
then no MFU is reported (a guessed peak is how CPUs once got an MFU of 70%); LLMOPS_PEAK_TFLOPS
states one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_tflops: float  # dense bf16 (fp16 where the chip has no bf16: V100)
    memory_gib: float


ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator("B200", 2250.0, 180),
    Accelerator("H200 SXM", 989.4, 141),
    Accelerator("H200 NVL", 835.5, 141),
    Accelerator("H100 SXM", 989.4, 80),
    Accelerator("H100 PCIe", 756.0, 80),
    Accelerator("H100 NVL", 835.5, 94),
    Accelerator("A100 40GB", 312.0, 40),
    Accelerator("A100 80GB", 312.0, 80),
    Accelerator("L40S", 362.05, 48),
    Accelerator("L40", 181.05, 48),
    Accelerator("L4", 121.0, 24),
    # AWS's A10G is a variant of the A10; NVIDIA publishes no separate sheet, so the A10's
    # dense bf16 figure is used
    Accelerator("A10G", 125.0, 24),
    Accelerator("V100", 125.0, 16),  # fp16: no bf16 on Volta
    Accelerator("Trainium", 190.0, 32),   # per trn1 chip (2 NeuronCores)
    Accelerator("Trainium2", 667.0, 96),  # per trn2 chip
)}

# What torch.cuda.get_device_name returns (after "NVIDIA " is dropped), as full-string patterns.
_DEVICE_NAMES: tuple[tuple[str, str], ...] = (
    (r"B200", "B200"),
    (r"H200 NVL", "H200 NVL"),
    (r"H200( SXM)?( \d+GB)?( HBM3e)?", "H200 SXM"),
    (r"H100 NVL", "H100 NVL"),
    (r"H100 PCIe", "H100 PCIe"),
    (r"H100( SXM5?)?( 80GB)?( HBM3)?", "H100 SXM"),
    (r"A100[- ](SXM4|PCIE)[- ]40GB|A100 40GB PCIe", "A100 40GB"),
    (r"A100[- ](SXM4|PCIE)[- ]80GB|A100 80GB PCIe", "A100 80GB"),
    (r"L40S", "L40S"),
    (r"L40", "L40"),
    (r"L4", "L4"),
    (r"A10G", "A10G"),
    (r"Tesla V100(-SXM2|-PCIE)?(-16GB|-32GB)?", "V100"),
)

# SageMaker instance family -> accelerator (instance type = family + size: "ml.g5.2xlarge")
_INSTANCE_FAMILIES: dict[str, str] = {
    "ml.g5": "A10G", "ml.g6": "L4", "ml.g6e": "L40S", "ml.p3": "V100", "ml.p3dn": "V100",
    "ml.p4d": "A100 40GB", "ml.p4de": "A100 80GB", "ml.p5": "H100 SXM", "ml.p5e": "H200 SXM",
    "ml.p5en": "H200 SXM", "ml.p6-b200": "B200", "ml.trn1": "Trainium", "ml.trn1n": "Trainium",
    "ml.trn2": "Trainium2",
}


def for_device_name(device_name: str) -> Accelerator | None:
    """The accelerator torch.cuda.get_device_name(...) names, or None when it is not listed."""
    name = device_name.strip()
    if name.upper().startswith("NVIDIA "):
        name = name[len("NVIDIA "):]
    for pattern, key in _DEVICE_NAMES:
        if re.fullmatch(pattern, name, flags=re.IGNORECASE):
            return ACCELERATORS[key]
    return None


def for_instance_type(instance_type: str) -> Accelerator | None:
    """The accelerator of a SageMaker instance type ("ml.p5.48xlarge" -> H100 SXM), or None."""
    family = instance_type.rsplit(".", 1)[0] if instance_type.count(".") >= 2 else instance_type
    key = _INSTANCE_FAMILIES.get(family)
    return ACCELERATORS[key] if key else None
