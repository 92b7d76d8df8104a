"""LoRA fine-tuning through peft: low-rank adapters on the decoder blocks' linear layers, the
base weights frozen, merged back at the end so the stage still hands on a plain model directory;
the adapters alone are also saved in peft's own format beside it.

peft injects its layers into the model in place (c_attn becomes a lora.Linear wrapping the
original), so the same module object trains, checkpoints and resumes through the shared loop;
the optimizer sees only the adapters (the loop optimizes parameters that require grad). For a
transformers model the adapters go into the transformers module itself, so the saved adapter's
keys are the ones `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), dir)`
expects; our GPT's module names are GPT-2's, so its adapter loads onto the GPT-2 it is saved as.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.nn as nn

log = logging.getLogger(__name__)

PEFT_HINT = "LoRA needs peft: pip install peft==0.21.2 (pinned in docker/requirements-job.txt)."
ADAPTER_DIR = "adapter"


class Adapters:
    """The adapters injected into `model`: merge them into its weights, or save them."""

    def __init__(self, model: nn.Module, wrapped: Any, targets: list[str]) -> None:
        self.model, self.wrapped, self.targets = model, wrapped, targets

    def merge(self) -> nn.Module:
        """Fold the adapters into the base weights: the plain model, as fast as before LoRA."""
        self.wrapped.merge_and_unload()  # in place: `model` holds the merged layers now
        self.model.requires_grad_(True)
        return self.model

    def save(self, out_dir: str | Path, base_model: str) -> Path:
        """peft's adapter directory (adapter_config.json, adapter_model.safetensors), naming the
        base model it applies to. Call before merge."""
        from tasks.common.io import publish_dir, read_json, write_json

        out_dir = Path(out_dir)
        tmp = out_dir.with_name(f".{out_dir.name}.tmp")
        self.wrapped.save_pretrained(str(tmp))
        config = read_json(tmp / "adapter_config.json")
        # our GPT has nn.Linear where the GPT-2 it is saved as has Conv1D (weights transposed)
        fan_in_fan_out = getattr(self.model, "hf", None) is None
        config.update(base_model_name_or_path=base_model, task_type="CAUSAL_LM",
                      fan_in_fan_out=fan_in_fan_out or config.get("fan_in_fan_out", False))
        write_json(tmp / "adapter_config.json", config)
        return publish_dir(tmp, out_dir)


def add_lora(model: nn.Module, rank: int, alpha: float, dropout: float,
             targets: list[str] | None = None) -> Adapters:
    """Inject adapters into `model` (in place). targets: leaf names of the layers to adapt;
    empty = every linear layer of the decoder blocks (tasks.model.causal_lm.linear_layer_names)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # optional: full fine-tuning does not need it
        raise ImportError(PEFT_HINT) from exc
    from tasks.model.causal_lm import linear_layer_names

    available = linear_layer_names(model)
    targets = list(targets or available)
    unknown = sorted(set(targets) - set(available))
    if unknown:
        raise ValueError(f"FinetuneConfig.lora_targets {unknown} name no linear layer of this "
                         f"model's blocks; it has {available} (empty = all of them).")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=targets, bias="none")
    inner = getattr(model, "hf", model)  # a transformers model: adapters on its own modules
    wrapped = get_peft_model(inner, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("LoRA r=%d alpha=%g on %s: %d of %d parameters train (%.2f%%)", rank, alpha,
             targets, trainable, total, 100 * trainable / total)
    return Adapters(model, wrapped, targets)


def merge_lora(adapters: Adapters) -> nn.Module:
    return adapters.merge()


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
