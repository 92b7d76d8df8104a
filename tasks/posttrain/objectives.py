"""Loss functions for post-training, `loss_fn(model, batch) -> scalar`, as the loop expects.

Each scores the SFT part of an SFTStepBatch (padded or packed) and, when the step replays
pretraining rows, adds their loss with the replay share as its weight:
    loss = (1 - r) * loss(SFT part) + r * loss(replayed rows)
For fine-tuning the replayed rows' loss is plain next-token cross-entropy; for distillation it is
the same KD loss as the SFT part, so the student learns prose from the teacher's logits too.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from tasks.model.gpt import IGNORE_INDEX
from tasks.posttrain.packing import packed_logits
from tasks.train.prepared_data import Batch
from tasks.train.losses import LossFn, kd_loss, topk_kd_loss


def logits_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    """(B, T, vocab) logits; packed rows go through packed_logits."""
    if getattr(batch, "positions", None) is not None:
        return packed_logits(model, batch.inputs, batch.positions, batch.segments)
    return model(batch.inputs)[0]


def next_token_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    logits = logits_of(model, batch)
    return F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(),
                           ignore_index=IGNORE_INDEX)


def online_kd(teacher: nn.Module, temperature: float, alpha: float) -> LossFn:
    """KD against a frozen teacher's full logits on the same batch (one teacher forward)."""

    def loss_fn(student: nn.Module, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            teacher_logits = logits_of(teacher, batch)
        return kd_loss(logits_of(student, batch), teacher_logits, batch.targets, temperature, alpha)

    return loss_fn


def cached_kd(temperature: float, alpha: float) -> LossFn:
    """KD against the teacher's cached top-k logits the batch carries (no teacher in the job)."""

    def loss_fn(student: nn.Module, batch: Batch) -> torch.Tensor:
        if getattr(batch, "teacher_values", None) is None:
            raise ValueError("cached_kd needs batches built with a teacher cache.")
        return topk_kd_loss(logits_of(student, batch), batch.teacher_values,
                            batch.teacher_indices, batch.targets, temperature, alpha)

    return loss_fn


def with_replay(loss_fn: LossFn, replay_fraction: float) -> LossFn:
    """(1 - r) * loss_fn(SFT part) + r * loss_fn(replayed rows); just loss_fn without replay."""

    def combined(model: nn.Module, batch: Batch) -> torch.Tensor:
        main = loss_fn(model, batch)
        replay = getattr(batch, "replay", None)
        if replay is None:
            return main
        return (1.0 - replay_fraction) * main + replay_fraction * loss_fn(model, replay)

    return combined


Objective = Callable[[nn.Module, Batch], torch.Tensor]
