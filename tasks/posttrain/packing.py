"""Sequence packing: several SFT examples share one row, and no example sees another.

A packed row holds examples back to back. Each token carries its position inside its own example
(so position embeddings match what the model sees at inference, where a prompt starts at 0) and a
segment id; attention is causal *and* restricted to the token's own segment. Padding has segment
-1 and no loss. `packed_logits` is GPT.forward with those two changes; tests/test_post_training.py
checks it returns, for every example, exactly the logits the example gets alone.
"""

from __future__ import annotations

import torch

from tasks.model import GPT

PAD_SEGMENT = -1


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices grouped into bins whose lengths sum to at most capacity, longest first; each bin
    lists its indices in placement order. Deterministic, so a resumed job packs identically."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        if lengths[i] > capacity:
            raise ValueError(f"item {i} has length {lengths[i]} > capacity {capacity}")
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def segment_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) segment ids -> (B, 1, T, T) boolean mask: query t may attend key s when s <= t and
    both belong to the same segment. Every token sees itself, so no row of the mask is empty."""
    T = segments.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    return (same & causal)[:, None]


def packed_logits(model: GPT, inputs: torch.Tensor, positions: torch.Tensor,
                  segments: torch.Tensor) -> torch.Tensor:
    """GPT.forward over packed rows: per-example positions and a block-diagonal causal mask.
    Works on a GPT with LoRA layers injected too (it calls the same submodules)."""
    tr = model.transformer
    x = tr.drop(tr.wte(inputs) + tr.wpe(positions))
    mask = segment_mask(segments)
    for block in tr.h:
        x = x + block.attn(block.ln_1(x), attn_mask=mask)
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(tr.ln_f(x))
