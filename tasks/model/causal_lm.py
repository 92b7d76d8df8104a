"""Every model a stage trains, scores or serves, behind the one interface the stages use:

    model(idx, targets=None, *, positions=None, segments=None) -> (logits, loss)
    model.generate(idx, max_new_tokens, eos_id=None, stop_ids=...) -> ids   (greedy)
    model.config.vocab_size / block_size / n_layer / n_embd / n_head, model.num_params()

Two kinds satisfy it:
  - the project's GPT (tasks/model/gpt.py), the fast path on CPU for arch "gpt". It is exactly a
    Hugging Face GPT-2 (same module names; GPT-2's Conv1D stores the four projection matrices
    transposed): `gpt_to_hf` / `hf_to_gpt` convert with identical logits, so a GPT is saved
    and served as a GPT2LMHeadModel and loaded back as a GPT for training.
  - `HFCausalLM`, any transformers causal LM (Llama, Qwen2, Mistral, GPT-2 ...), loaded from a
    Hugging Face directory or built from a ModelConfig (arch "llama").

Measured (benchmarks/results/hf_models.json; 2 cores, one thread, load 2.3-2.7): a training step
of the same model as our GPT and as transformers' GPT2LMHeadModel takes 121 vs 122 ms at the demo
size (1.01x) and 3.6 vs 4.2 ms at the tiny test size (1.18x). Speed is not why the GPT stays for
arch "gpt": it is exactly GPT-2 both ways, so nothing is lost by keeping it; torch's int8 dynamic
quantization applies to its nn.Linear layers (GPT-2's Conv1D it leaves alone); and the
resilience, spike, scaling and quality tests and the demo's recorded numbers are pinned to it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tasks.configs import ModelConfig
from tasks.model.gpt import GPT, IGNORE_INDEX, segment_mask

log = logging.getLogger(__name__)

# GPT-2's Conv1D keeps these as (in, out); our nn.Linear as (out, in)
_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm default, which the GPT uses


@dataclass(frozen=True)
class LMShape:
    """The sizes callers read from `model.config`, for a transformers model."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_embd: int
    n_head: int
    arch: str


def context_length(config: Any) -> int:
    """The positions a transformers config supports (RoPE models declare a maximum too)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"{type(config).__name__} declares no context length "
                     "(max_position_embeddings); set it in config.json.")


class HFCausalLM(nn.Module):
    """A transformers causal LM with the stages' interface (see the module docstring)."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf
        c = hf.config
        self.config = LMShape(vocab_size=c.vocab_size, block_size=context_length(c),
                              n_layer=c.num_hidden_layers, n_embd=c.hidden_size,
                              n_head=c.num_attention_heads, arch=c.model_type)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None, segments: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        kwargs: dict[str, Any] = {}
        if positions is not None:
            # packed rows: positions restart per example, attention stays inside it. A 4-D mask
            # is used by transformers as given; additive (0 / -inf) suits every attention kernel
            allowed = segment_mask(segments)
            dtype = self.hf.get_input_embeddings().weight.dtype
            mask = torch.zeros(allowed.shape, dtype=dtype, device=idx.device)
            kwargs = {"position_ids": positions,
                      "attention_mask": mask.masked_fill(~allowed, torch.finfo(dtype).min)}
        logits = self.hf(input_ids=idx, use_cache=False, **kwargs).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1),
                                   ignore_index=IGNORE_INDEX)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, eos_id: int | None = None,
                 stop_ids: set[int] | frozenset[int] = frozenset()) -> torch.Tensor:
        """Greedy decoding through transformers' generate (with its KV cache), like GPT.generate:
        (B, T + new) ids; a row that stopped is padded with eos_id, callers cut at the first
        stop."""
        from transformers import GenerationConfig

        stops = sorted(set(stop_ids) | ({eos_id} if eos_id is not None else set()))
        # the model has seen at most block_size positions: keep the most recent prompt tokens
        context = idx[:, -max(1, self.config.block_size - max_new_tokens):]
        # a fresh config: a checkpoint's generation_config.json may ask for sampling
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                                  eos_token_id=stops or None,
                                  pad_token_id=eos_id if eos_id is not None else 0)
        out = self.hf.generate(input_ids=context, attention_mask=torch.ones_like(context),
                               generation_config=config)
        return torch.cat([idx, out[:, context.shape[1]:]], dim=1)

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - position_params(self) if non_embedding else n


def position_params(model: nn.Module) -> int:
    """Parameters of learned position embeddings (none for RoPE models)."""
    if isinstance(model, GPT):
        return model.transformer.wpe.weight.numel()
    if isinstance(model, HFCausalLM):
        wpe = getattr(getattr(model.hf, "transformer", None), "wpe", None)
        return wpe.weight.numel() if isinstance(wpe, nn.Embedding) else 0
    return 0


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (FSDP's units): GPT's transformer.h, or the modules transformers names
    as never to be split across devices (LlamaDecoderLayer, GPT2Block ...)."""
    if isinstance(model, GPT):
        return list(model.transformer.h)
    if isinstance(model, HFCausalLM):
        names = set(getattr(model.hf, "_no_split_modules", None) or ())
        return [m for m in model.hf.modules() if type(m).__name__ in names]
    return []


def linear_layer_names(model: nn.Module) -> list[str]:
    """Leaf names of the Linear (or GPT-2 Conv1D) layers inside the decoder blocks: the default
    LoRA targets (c_attn, c_proj, c_fc for the GPT; q/k/v/o/gate/up/down_proj for a Llama)."""
    names: set[str] = set()
    for block in decoder_layers(model):
        for name, m in block.named_modules():
            if name and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"):
                names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


# -- building from a ModelConfig ------------------------------------------------------------------


def swiglu_width(n_embd: int) -> int:
    """Llama's MLP width: 2/3 of 4 * n_embd (three matrices instead of two), to a multiple of 8."""
    return 8 * math.ceil(8 * n_embd / 3 / 8)


def llama_config(cfg: ModelConfig):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd,
                       intermediate_size=swiglu_width(cfg.n_embd), num_hidden_layers=cfg.n_layer,
                       num_attention_heads=cfg.n_head,
                       num_key_value_heads=cfg.n_kv_head or cfg.n_head,
                       max_position_embeddings=cfg.block_size, attention_dropout=cfg.dropout,
                       rms_norm_eps=LAYER_NORM_EPS, tie_word_embeddings=True,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def build_model(cfg: ModelConfig) -> nn.Module:
    """A freshly initialised model of cfg.arch (weights from torch's generator: seed first)."""
    if cfg.arch == "gpt":
        return GPT(cfg)
    if cfg.arch == "llama":
        from transformers import LlamaForCausalLM

        return HFCausalLM(LlamaForCausalLM(llama_config(cfg)))
    raise ValueError(f"ModelConfig.arch {cfg.arch!r} is not one of gpt, llama.")


# -- our GPT as a Hugging Face GPT-2 ---------------------------------------------------------------


def gpt2_config(cfg: ModelConfig):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                      n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=None,
                      # exact GELU (erf), as nn.functional.gelu; GPT-2's own is the tanh one
                      activation_function="gelu", layer_norm_epsilon=LAYER_NORM_EPS,
                      resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)


def gpt_to_hf(model: GPT):
    """A GPT2LMHeadModel with exactly this GPT's weights (copied, on the CPU, float32)."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel(gpt2_config(model.config))
    state = {k: (v.t() if k.endswith(_TRANSPOSED) else v).detach().float().cpu().contiguous()
             for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    # GPT-2's tied lm_head comes from wte; nothing else may be left out
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"GPT -> GPT-2 conversion left keys: missing {missing}, unexpected "
                           f"{unexpected}")
    return hf.eval()


def _gpt_shape(config: Any) -> ModelConfig | None:
    """The ModelConfig of a GPT-2 config that is exactly our GPT, else None."""
    c = config
    if c.model_type != "gpt2":
        return None
    same_dropout = c.attn_pdrop == c.resid_pdrop == c.embd_pdrop
    if not (c.activation_function == "gelu"
            and c.n_inner in (None, 4 * c.n_embd) and c.layer_norm_epsilon == LAYER_NORM_EPS
            and c.tie_word_embeddings and c.scale_attn_weights and same_dropout
            and not c.scale_attn_by_inverse_layer_idx and not c.reorder_and_upcast_attn):
        return None
    try:
        return ModelConfig(vocab_size=c.vocab_size, block_size=c.n_positions, n_layer=c.n_layer,
                           n_head=c.n_head, n_embd=c.n_embd, dropout=float(c.resid_pdrop))
    except ValueError:  # sizes outside our bounds: stay a transformers model
        return None


def hf_to_gpt(hf: nn.Module) -> GPT | None:
    """Our GPT with the weights of a GPT-2 that is exactly one (see _gpt_shape), else None."""
    cfg = _gpt_shape(hf.config)
    if cfg is None:
        return None
    gpt = GPT(cfg)
    state = {k: (v.t() if k.endswith(_TRANSPOSED) else v).contiguous()
             for k, v in hf.state_dict().items() if not k.endswith(".attn.bias")}
    gpt.load_state_dict(state)
    return gpt


def to_transformers(model: nn.Module) -> nn.Module:
    """The transformers model a stage saves and serves for any model of ours."""
    if isinstance(model, GPT):
        return gpt_to_hf(model)
    if isinstance(model, HFCausalLM):
        return model.hf
    raise TypeError(f"cannot save a {type(model).__name__} as a Hugging Face model.")


def from_pretrained(model_dir: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """A Hugging Face directory -> our GPT when it is one (the fast path), else HFCausalLM.
    Weights from safetensors, float32 (training keeps master weights in fp32; autocast lowers
    the compute on GPU); never code from the directory (trust_remote_code=False)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                              trust_remote_code=False, use_safetensors=True)
    gpt = hf_to_gpt(hf)
    model = gpt if gpt is not None else HFCausalLM(hf)
    return model.to(device)
