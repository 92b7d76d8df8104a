"""Losses the training loop plugs in: `loss_fn(model, batch) -> scalar tensor`."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from tasks.model.gpt import IGNORE_INDEX
from tasks.train.prepared_data import Batch

LossFn = Callable[[nn.Module, Batch], torch.Tensor]


def cross_entropy(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean next-token cross-entropy over targets that are not IGNORE_INDEX: every token for
    pretraining, only the completion for SFT (collate_sft masks the rest)."""
    _, loss = model(batch.inputs, batch.targets)
    return loss


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
            temperature: float, alpha: float) -> torch.Tensor:
    """alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE(s, targets), both
    averaged over the positions whose target is not IGNORE_INDEX.

    T^2 keeps the soft term's gradients on the same scale as the hard term's whatever T is
    (Hinton et al., 2015): softening by T shrinks the gradients by 1/T^2.
    """
    mask = targets != IGNORE_INDEX
    s = student_logits[mask].float()  # (N, V): only the positions that carry loss
    t = teacher_logits[mask].float()
    T = temperature
    kl = F.kl_div(F.log_softmax(s / T, dim=-1), F.log_softmax(t / T, dim=-1),
                  log_target=True, reduction="batchmean")
    ce = F.cross_entropy(s, targets[mask])
    return alpha * T * T * kl + (1.0 - alpha) * ce


def distillation(teacher: nn.Module, temperature: float, alpha: float) -> LossFn:
    """A loss_fn that scores the student against a frozen teacher's logits on the same batch."""

    def loss_fn(student: nn.Module, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            teacher_logits, _ = teacher(batch.inputs)
        student_logits, _ = student(batch.inputs)
        return kd_loss(student_logits, teacher_logits, batch.targets, temperature, alpha)

    return loss_fn


def topk_kd_loss(student_logits: torch.Tensor, teacher_values: torch.Tensor,
                 teacher_indices: torch.Tensor, targets: torch.Tensor, temperature: float,
                 alpha: float) -> torch.Tensor:
    """kd_loss with the teacher known only by its top-k logits per position (a cached teacher).

    The teacher's distribution is its softmax over those k logits (the tail it did not keep is
    dropped and the rest renormalized); the student's log-probabilities are taken over the full
    vocabulary and read at the teacher's k token ids. With k = vocab this is exactly kd_loss.
    teacher_values/indices: (B, T, k), meaningful where targets is not IGNORE_INDEX.
    """
    mask = targets != IGNORE_INDEX
    s = student_logits[mask].float()  # (N, V)
    t = teacher_values[mask].float()  # (N, k)
    idx = teacher_indices[mask].long()
    T = temperature
    log_p = F.log_softmax(t / T, dim=-1)
    log_q = F.log_softmax(s / T, dim=-1).gather(-1, idx)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    ce = F.cross_entropy(s, targets[mask])
    return alpha * T * T * kl + (1.0 - alpha) * ce
