"""LoRA fine-tuning through peft: low-rank adapters on the attention and MLP projections, the
base weights frozen, merged back at the end so the stage still hands on a plain GPT directory.

peft injects its layers into the GPT in place (c_attn becomes a lora.Linear wrapping the
original), so the same module object trains, checkpoints and resumes through the shared loop;
the optimizer sees only the adapters (the loop optimizes parameters that require grad).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.nn as nn

log = logging.getLogger(__name__)

PEFT_HINT = "LoRA needs peft: pip install peft==0.21.2 (pinned in docker/requirements-job.txt)."


def add_lora(model: nn.Module, rank: int, alpha: float, dropout: float, targets: list[str]) -> Any:
    """Inject adapters into `model` (in place) and return the peft wrapper to merge them later."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # optional: full fine-tuning does not need it
        raise ImportError(PEFT_HINT) from exc
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=list(targets), bias="none")
    wrapped = get_peft_model(model, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("LoRA r=%d alpha=%g on %s: %d of %d parameters train (%.2f%%)", rank, alpha,
             targets, trainable, total, 100 * trainable / total)
    return wrapped


def merge_lora(wrapped: Any) -> nn.Module:
    """Fold the adapters into the base weights: the plain model, as fast as before LoRA."""
    model = wrapped.merge_and_unload()
    model.requires_grad_(True)
    return model


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
