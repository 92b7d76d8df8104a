"""The rungs of a scaling ladder and the shape of a recommended model. Standard library only.

A rung is the pretraining model at another width (depth, heads, vocabulary and context kept) trained
on `tokens_per_param` x N tokens, N being the non-embedding parameters 12 * n_layer * n_embd^2.
Each rung trains to the end of its own learning-rate schedule: approach 3 fits final losses.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tasks.configs import LadderConfig, ModelConfig


def non_embedding_params(n_layer: int, n_embd: int) -> int:
    """Attention (4 d^2) and MLP (8 d^2) weights per block: what the law calls N."""
    return 12 * n_layer * n_embd ** 2


@dataclass(frozen=True)
class Rung:
    index: int
    width: int
    tokens_per_param: float
    model: ModelConfig
    n_params: int      # N, non-embedding
    steps: int         # optimizer steps at tokens_per_step
    tokens: int        # D actually trained on: steps * tokens_per_step

    @property
    def compute(self) -> float:
        return 6.0 * self.n_params * self.tokens


def rungs(ladder: LadderConfig, base: ModelConfig, tokens_per_step: int) -> list[Rung]:
    """Every width x tokens_per_param, smallest compute first."""
    out = []
    for width in sorted(set(ladder.widths)):
        if width % base.n_head:
            raise ValueError(f"ladder width {width} is not a multiple of n_head ({base.n_head}); "
                             f"use multiples of {base.n_head} in ladder_widths.")
        model = dataclasses.replace(base, n_embd=width)
        n = non_embedding_params(model.n_layer, width)
        for tpp in sorted(set(ladder.tokens_per_param)):
            steps = max(1, math.ceil(tpp * n / tokens_per_step))
            out.append(Rung(0, width, float(tpp), model, n, steps, steps * tokens_per_step))
    out.sort(key=lambda r: (r.compute, r.width))
    return [dataclasses.replace(r, index=i) for i, r in enumerate(out)]


def split_held_out(points: list[dict], held_out: int) -> tuple[list[dict], list[dict]]:
    """(fit on, held out): the `held_out` points of largest compute 6ND are left out, so their
    error measures how well the law extrapolates, which is what sizing a bigger run relies on."""
    ordered = sorted(points, key=lambda p: p["n_params"] * p["tokens"])
    if held_out <= 0:
        return ordered, []
    return ordered[:-held_out], ordered[-held_out:]


def shape_for(n_params: float, base: ModelConfig) -> ModelConfig:
    """The base model's family (depth, heads) at the width whose N is closest to n_params."""
    heads = base.n_head
    width = math.sqrt(max(n_params, 1) / (12 * base.n_layer))
    n_embd = max(heads, int(round(width / heads)) * heads)
    return dataclasses.replace(base, n_embd=n_embd)


def recommend(n_opt: float, d_opt: float, base: ModelConfig, tokens_per_step: int) -> dict:
    """A runnable size for the compute-optimal (N, D): the nearest width of the base family and
    the steps that give about D tokens."""
    model = shape_for(n_opt, base)
    steps = max(1, math.ceil(d_opt / tokens_per_step))
    n = non_embedding_params(model.n_layer, model.n_embd)
    return {"n_params": n, "tokens": steps * tokens_per_step, "n_layer": model.n_layer,
            "n_head": model.n_head, "n_embd": model.n_embd, "max_steps": steps,
            "tokens_per_step": tokens_per_step, "tokens_per_param": steps * tokens_per_step / n}
