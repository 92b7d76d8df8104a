"""A GPT-style decoder (after nanoGPT): token + learned position embeddings, pre-LN blocks of
causal self-attention and an MLP, a final LayerNorm and an lm head tied to the token embedding.

Exactly a Hugging Face GPT-2 with exact GELU: every stage saves it as a GPT2LMHeadModel and loads
such a directory back as this class, which trains faster on CPU (tasks/model/causal_lm.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tasks.configs import ModelConfig

IGNORE_INDEX = -100  # targets with this value add nothing to the loss (prompt and padding tokens)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """attn_mask (bool, True = may attend) replaces the causal mask, e.g. the block-diagonal
        causal mask of packed sequences; without one the kernel masks the future itself."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, nh, T, hs): heads become a batch dimension for the fused attention kernel
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # flash / memory-efficient attention where the backend has it; is_causal masks the future
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                           is_causal=attn_mask is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        # pre-LN: the residual stream is never normalized, which keeps deep stacks trainable
        x = x + self.attn(self.ln_1(x), attn_mask=attn_mask)
        return x + self.mlp(self.ln_2(x))


def segment_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) segment ids of packed rows -> (B, 1, T, T) boolean mask: query t may attend key s
    when s <= t and both belong to the same segment. Every token sees itself, so no row of the
    mask is empty."""
    T = segments.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    return (same & causal)[:, None]


class GPT(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying: input and output embeddings share one matrix (fewer parameters, and the
        # rarely seen tokens still get a sensible output row)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2: scale the projections into the residual stream by 1/sqrt(2 * n_layer) so its
        # variance does not grow with depth
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters counted once (the tied head is the token embedding). With non_embedding,
        the position embedding is left out, as in the scaling-law papers."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None, segments: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) token ids -> logits (B, T, vocab); with targets (B, T), also the mean
        next-token cross-entropy over targets that are not IGNORE_INDEX. Packed rows pass
        positions (B, T: each token's position inside its own example) and segments (B, T: its
        example), so no example attends to another (tasks/posttrain/packing.py)."""
        B, T = idx.shape
        if positions is None and T > self.config.block_size:  # a packed row's examples are shorter
            raise ValueError(f"Sequence of length {T} is longer than block_size "
                             f"{self.config.block_size}; crop the input or raise block_size.")
        pos = positions if positions is not None else torch.arange(T, dtype=torch.long,
                                                                   device=idx.device)
        mask = segment_mask(segments) if segments is not None else None
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x, attn_mask=mask)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=IGNORE_INDEX)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, eos_id: int | None = None,
                 stop_ids: set[int] | frozenset[int] = frozenset()) -> torch.Tensor:
        """Greedy decoding: append the most likely token max_new_tokens times, or until every
        row has produced eos_id or a token in stop_ids. Returns (B, T + new) token ids; rows that
        stopped early keep growing with whatever comes next, so callers cut at the first stop."""
        stops = set(stop_ids) | ({eos_id} if eos_id is not None else set())
        stop_tensor = torch.tensor(sorted(stops), dtype=idx.dtype, device=idx.device)
        done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
        for _ in range(max_new_tokens):
            # the model has seen at most block_size positions: keep the most recent ones
            context = idx[:, -self.config.block_size:]
            logits, _ = self(context)
            next_id = logits[:, -1, :].argmax(dim=-1, keepdim=True)
            idx = torch.cat((idx, next_id), dim=1)
            if len(stops):
                done |= torch.isin(next_id.squeeze(1), stop_tensor)
                if bool(done.all()):
                    break
        return idx
