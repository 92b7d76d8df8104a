"""The building blocks of the stage configs: the decoder's shape (`ModelConfig`, arch gpt or
llama) and the optimizer and its learning-rate schedule (`OptimConfig`), shared by pretraining,
fine-tuning, distillation and the scaling ladder."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.configs.fields import bounded, check, check_bounds


MODEL_ARCHS = ("gpt", "llama")


@dataclass(kw_only=True)
class ModelConfig:
    """A decoder built from scratch. Parameters ~ 12 * n_layer * n_embd^2 + vocab_size * n_embd.

    arch "gpt": the project's GPT (tasks/model/gpt.py; learned positions, LayerNorm, GELU MLP),
    saved as a Hugging Face GPT-2. "llama": transformers' LlamaForCausalLM (RoPE, RMSNorm,
    SwiGLU MLP, grouped-query attention with n_kv_head key/value heads)."""

    vocab_size: int = bounded(1024, minimum=64, maximum=1 << 20, help="Tokenizer vocabulary size.")
    block_size: int = bounded(128, minimum=8, maximum=1 << 16, help="Context length in tokens.")
    n_layer: int = bounded(2, minimum=1, maximum=256, help="Transformer blocks.")
    n_head: int = bounded(4, minimum=1, maximum=256, help="Attention heads per block.")
    n_embd: int = bounded(128, minimum=8, maximum=65536, help="Hidden size; a multiple of n_head.")
    dropout: float = bounded(0.0, minimum=0.0, maximum=0.9, help="Dropout probability.")
    arch: str = bounded("gpt", choices=MODEL_ARCHS,
                        help="gpt (the built-in GPT, fastest on CPU) or llama (transformers' "
                             "Llama: RoPE, RMSNorm, SwiGLU, grouped-query attention).")
    n_kv_head: int = bounded(0, minimum=0, maximum=256,
                             help="llama: key/value heads (grouped-query attention); 0 = n_head.")

    def __post_init__(self) -> None:
        check_bounds(self)
        check(self.n_embd % self.n_head == 0,
               f"ModelConfig.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head}).")
        check(self.n_kv_head == 0 or (self.arch == "llama" and self.n_head % self.n_kv_head == 0),
               f"ModelConfig.n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head}) and "
               "applies to arch 'llama' only; 0 = as many as n_head.")

    @property
    def approx_params(self) -> int:
        return 12 * self.n_layer * self.n_embd**2 + self.vocab_size * self.n_embd


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to min_lr_ratio * lr."""

    lr: float = bounded(3e-3, minimum=1e-6, maximum=1.0, help="Peak learning rate.")
    min_lr_ratio: float = bounded(0.1, minimum=0.0, maximum=1.0, help="Final lr as a share of lr.")
    warmup_steps: int = bounded(20, minimum=0, maximum=1_000_000, help="Linear warmup steps.")
    weight_decay: float = bounded(0.1, minimum=0.0, maximum=1.0, help="AdamW weight decay.")
    beta1: float = bounded(0.9, minimum=0.0, maximum=0.9999)
    beta2: float = bounded(0.95, minimum=0.0, maximum=0.99999)
    grad_clip: float = bounded(1.0, minimum=0.0, maximum=1e6, help="Max global grad norm; 0 = off.")

    def __post_init__(self) -> None:
        check_bounds(self)
