"""Post-training int8 quantization of a model for CPU serving, measured against the float model.

Dynamic quantization (torch.ao.quantization.quantize_dynamic): the transformer blocks' Linear
layers store int8 weights with a per-tensor scale, and activations are quantized on the fly per
batch, so no calibration data is needed. The token embedding and the lm_head tied to it stay
float (one shared matrix). What it buys depends on the shapes: in a small model the embedding is
a large share of the bytes and most time is spent outside the matmuls, so measure rather than
assume (compare_int8).

    <output_dir>/model_int8/
        model_int8.pt       the quantized state dict (loads with weights_only=True)
        model_config.json   the float architecture it was quantized from (our GPT; a
                            transformers model has its config.json instead)
        tokenizer.json      as the float model's
        meta.json           lineage and the measured comparison; written last
"""

from __future__ import annotations

import copy
import io
import logging
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from tasks.common.io import publish_dir, read_json, write_json
from tasks.model.causal_lm import HFCausalLM, decoder_layers
from tasks.configs import ModelConfig, from_dict, to_dict
from tasks.model.gpt import GPT

log = logging.getLogger(__name__)

INT8_DIR = "model_int8"


def quantize_int8(model: GPT) -> GPT:
    """A CPU copy of model with int8 dynamic Linear layers; the float model is left untouched."""
    with warnings.catch_warnings():
        # torch 2.13 flags the quantized-tensor API for removal in favour of torchao; until that
        # ships pinned in our image this is the int8 path that needs no extra dependency
        warnings.simplefilter("ignore")
        from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

        torch.backends.quantized.engine = _engine()
        copied = copy.deepcopy(model).float().cpu().eval()
        # the blocks' Linear layers only: lm_head shares its matrix with the token embedding,
        # and an int8 copy of it would add a second embedding-sized tensor instead of saving one
        in_blocks = {id(m) for block in decoder_layers(copied) for m in block.modules()}
        spec = {name: default_dynamic_qconfig for name, m in copied.named_modules()
                if isinstance(m, nn.Linear) and id(m) in in_blocks}
        return quantize_dynamic(copied, spec, dtype=torch.qint8)


def _engine() -> str:
    engines = torch.backends.quantized.supported_engines
    for name in ("x86", "fbgemm", "qnnpack"):  # x86/fbgemm on Intel/AMD, qnnpack on ARM
        if name in engines:
            return name
    raise RuntimeError(f"this torch build has no int8 CPU engine (supported: {engines}).")


def state_bytes(model: nn.Module) -> int:
    """Bytes of the serialized state dict: what a model file costs on disk and on the wire."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(model.state_dict(), buffer)
    return buffer.tell()


@torch.no_grad()
def tokens_per_second(model: nn.Module, inputs: torch.Tensor, repeats: int = 5) -> float:
    """Forward throughput on a fixed CPU batch: best of `repeats` after one warm-up pass (the
    best, not the mean, because other processes share the cores)."""
    model.eval()
    model(inputs)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        model(inputs)
        best = min(best, time.perf_counter() - start)
    return inputs.numel() / best


def compare_int8(model: GPT, quantized: GPT, inputs: torch.Tensor,
                 quality: Callable[[nn.Module], dict[str, float]]) -> dict[str, float]:
    """Size, CPU speed and quality of the float model and its int8 copy, side by side."""
    cpu_float = copy.deepcopy(model).float().cpu().eval()
    report: dict[str, float] = {}
    for name, m in (("float", cpu_float), ("int8", quantized)):
        report[f"size_bytes_{name}"] = state_bytes(m)
        report[f"tokens_per_s_{name}"] = tokens_per_second(m, inputs.cpu())
        for key, value in quality(m).items():
            report[f"{key}_{name}"] = value
    report["size_ratio"] = report["size_bytes_int8"] / report["size_bytes_float"]
    report["speedup"] = report["tokens_per_s_int8"] / report["tokens_per_s_float"]
    return report


def export_int8(quantized: GPT, output_dir: str | Path, tokenizer_path: str | Path,
                meta: dict[str, Any]) -> Path:
    """Write output_dir/model_int8/ atomically (assembled beside it, renamed in)."""
    output_dir = Path(output_dir)
    final, tmp = output_dir / INT8_DIR, output_dir / f".{INT8_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with open(tmp / "model_int8.pt", "wb") as fh, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.save(quantized.state_dict(), fh)
            fh.flush()
            os.fsync(fh.fileno())
        if isinstance(quantized, GPT):
            write_json(tmp / "model_config.json", to_dict(quantized.config))
        else:  # a transformers model: its own config rebuilds the float architecture
            quantized.hf.config.save_pretrained(str(tmp))
        shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
        write_json(tmp / "meta.json", {**meta, "quantization": "int8 dynamic (nn.Linear)"})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish_dir(tmp, final)


def load_int8(model_dir: str | Path) -> tuple[GPT, dict[str, Any]]:
    """Rebuild an int8 model directory: the float architecture, quantized, then its weights."""
    model_dir = Path(model_dir)
    if (model_dir / "model_config.json").is_file():
        float_model = GPT(from_dict(ModelConfig, read_json(model_dir / "model_config.json")))
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
        float_model = HFCausalLM(AutoModelForCausalLM.from_config(config))
    model = quantize_int8(float_model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = torch.load(model_dir / "model_int8.pt", map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    return model, read_json(model_dir / "meta.json")
