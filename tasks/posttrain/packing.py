"""Sequence packing: several SFT examples share one row, and no example sees another.

A packed row holds examples back to back. Each token carries its position inside its own example
(so position embeddings match what the model sees at inference, where a prompt starts at 0) and a
segment id; attention is causal *and* restricted to the token's own segment (tasks.model.gpt.
segment_mask). Padding has segment -1 and no loss. Every model takes positions and segments in its
forward (tasks/model/causal_lm.py); tests/test_post_training.py checks that packed rows give every
example exactly the logits it gets alone, for our GPT and for a transformers Llama.
"""

from __future__ import annotations

import torch
import torch.nn as nn

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


def packed_logits(model: nn.Module, inputs: torch.Tensor, positions: torch.Tensor,
                  segments: torch.Tensor) -> torch.Tensor:
    """The forward pass over packed rows: per-example positions and a block-diagonal causal
    mask, for our GPT and transformers models alike (with LoRA layers injected too)."""
    return model(inputs, positions=positions, segments=segments)[0]
