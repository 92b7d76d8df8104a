"""Where a job computes (device, precision) and its random state, saved and restored exactly."""

from __future__ import annotations

import contextlib
import logging
import os
import random
from typing import Any, ContextManager

import numpy as np
import torch

log = logging.getLogger(__name__)


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        # TF32 matmuls: near-fp32 accuracy at several times the speed on Ampere and later
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return torch.device("cuda")
    if "OMP_NUM_THREADS" not in os.environ:
        # Intra-op threads synchronize at every op; when another process holds one of the cores
        # each barrier waits for a descheduled thread. Measured on a shared 2-core box with a
        # 0.5M-parameter GPT: 2 threads ran 10x slower than 1. Half the cores leaves room for
        # the rest of the machine; OMP_NUM_THREADS overrides.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    log.info("device cpu, %d threads", torch.get_num_threads())
    return torch.device("cpu")


def autocast(device: torch.device) -> ContextManager:
    """bf16 autocast on CUDA (no loss scaling needed, unlike fp16). On CPU stay in fp32: CPU
    bf16 is slower than fp32 on most machines and would change the numbers tests pin."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state() -> dict[str, Any]:
    """Every generator a training step may draw from, as tensors and plain numbers so the
    checkpoint loads with torch.load(weights_only=True)."""
    version, mt_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(mt_state, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # a job resumed on fewer GPUs restores the generators it has
        cuda = state["cuda"][: torch.cuda.device_count()]
        for i, s in enumerate(cuda):
            torch.cuda.set_rng_state(s, i)
