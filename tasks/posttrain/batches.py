"""The batch of one fine-tuning or distillation step: SFT examples, padded or packed, plus a share
of pretraining rows replayed so the model keeps its general language ability.

Why replay: fine-tuning only on a narrow task moves every weight towards that task, and the
model forgets prose (measured on the demo recipe: held-out perplexity 56 before, 25 million after
1500 SFT steps). Mixing pretraining rows into every step, with their loss counted as ordinary
language-model loss, keeps prose perplexity near where it was at little cost to the task.

Like every batch source of the loop, batch `step` is a pure function of (seed, step), so a
resumed job reads exactly the batches the uninterrupted job would have.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tasks.model.gpt import IGNORE_INDEX
from tasks.posttrain.packing import PAD_SEGMENT, first_fit_decreasing
from tasks.train.prepared_data import (Batch, EpochSampler, SFTExample, TokenRows, collate_sft,
                                       sft_sequence, trained_ranges)


@dataclass
class SFTStepBatch(Batch):
    """A Batch (inputs, targets, tokens: the SFT part) with what post-training adds."""

    positions: torch.Tensor | None = None  # (B, T) position within its example, when packed
    segments: torch.Tensor | None = None  # (B, T) example slot per token, PAD_SEGMENT on padding
    teacher_values: torch.Tensor | None = None  # (B, T, k) cached teacher top-k logits
    teacher_indices: torch.Tensor | None = None  # (B, T, k) their token ids
    replay: "SFTStepBatch | None" = None  # pretraining rows trained on in the same step

    def to(self, device: torch.device) -> "SFTStepBatch":
        if device.type != "cuda":
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory().to(device, non_blocking=True)

        return SFTStepBatch(move(self.inputs), move(self.targets), self.tokens,
                            positions=move(self.positions), segments=move(self.segments),
                            teacher_values=move(self.teacher_values),
                            teacher_indices=move(self.teacher_indices),
                            replay=None if self.replay is None else self.replay.to(device))


def collate_packed(rows: list[list[SFTExample]], block_size: int, pad_id: int) -> SFTStepBatch:
    """Rows of several examples each, back to back; positions restart at every example and the
    segment id keeps attention inside it. Loss positions are those collate_sft would use."""
    seqs = [[sft_sequence(ex, block_size) for ex in row] for row in rows]
    T = max(sum(len(ids) - 1 for ids, _ in row) for row in seqs)
    B = len(rows)
    inputs = torch.full((B, T), pad_id, dtype=torch.long)
    targets = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((B, T), dtype=torch.long)
    segments = torch.full((B, T), PAD_SEGMENT, dtype=torch.long)
    tokens = 0
    for b, row in enumerate(seqs):
        offset = 0
        for slot, (ids, carries) in enumerate(row):
            n = len(ids) - 1
            ids_t = torch.tensor(ids, dtype=torch.long)
            inputs[b, offset:offset + n] = ids_t[:-1]
            targets[b, offset:offset + n] = torch.where(torch.tensor(carries[1:]), ids_t[1:],
                                                        torch.tensor(IGNORE_INDEX))
            positions[b, offset:offset + n] = torch.arange(n)
            segments[b, offset:offset + n] = slot
            offset += n
            tokens += n
    return SFTStepBatch(inputs, targets, tokens, positions=positions, segments=segments)


def replay_split(batch_size: int, replay_fraction: float) -> tuple[int, int]:
    """(SFT units, replayed pretraining rows) per step: the replay share rounded, at least one
    of each when the share is strictly between 0 and 1."""
    if replay_fraction <= 0:
        return batch_size, 0
    if batch_size < 2:
        raise ValueError(f"batch_size {batch_size} cannot hold SFT examples and replayed rows; "
                         "use batch_size >= 2 or replay_fraction 0.")
    n_replay = min(batch_size - 1, max(1, round(batch_size * replay_fraction)))
    return batch_size - n_replay, n_replay


class SFTSteps:
    """Batch `step`: `batch_size` units, of which round(batch_size * replay_fraction) are
    pretraining rows and the rest SFT units (one example each, or one packed row each).

    With a teacher cache, each part also carries the teacher's top-k logits at its loss positions.
    """

    def __init__(self, examples: list[SFTExample], *, batch_size: int, seed: int, block_size: int,
                 pad_id: int, packing: bool = False, replay_rows: TokenRows | None = None,
                 replay_fraction: float = 0.0, teacher_cache: Any = None) -> None:
        if replay_fraction > 0 and replay_rows is None:
            raise ValueError("replay_fraction > 0 needs the pretraining rows to replay.")
        self.examples, self.block_size, self.pad_id = examples, block_size, pad_id
        self.packing, self.replay_rows, self.cache = packing, replay_rows, teacher_cache
        self.n_sft, self.n_replay = replay_split(batch_size, replay_fraction)
        if packing:
            lengths = [len(sft_sequence(ex, block_size)[0]) - 1 for ex in examples]
            self.units = first_fit_decreasing(lengths, block_size)
        else:
            self.units = [[i] for i in range(len(examples))]
        self.sampler = EpochSampler(len(self.units), self.n_sft, seed)
        self.replay_sampler = (EpochSampler(replay_rows.rows, self.n_replay, seed + 1)
                               if self.n_replay else None)

    def seen(self, cursor: int, skipped: set[int] | frozenset[int] = frozenset()) -> dict[str, Any]:
        """What the steps before `cursor` (less the skipped ones) trained on, for the checkpoint
        (tasks/train/seen.py): the SFT sampler (seed, units per step, the trained step ranges),
        the examples behind each unit when packed (which examples share a row depends on the
        tokenizer, so it is recorded, not recomputed), the ids' count and hash (the data file
        must be the same one), and the replayed pretraining rows' sampler (with their data's
        content hash)."""
        ids = "\n".join(ex.id for ex in self.examples)
        out: dict[str, Any] = {
            "kind": "sft", "sampler": "epoch_permutation", "seed": self.sampler.seed,
            "global_batch": self.n_sft, "units": len(self.units), "examples": len(self.examples),
            "examples_sha256": hashlib.sha256(ids.encode()).hexdigest(),
            "packed_units": self.units if self.packing else None,
            "batches": trained_ranges(cursor, skipped)}
        if self.replay_sampler is not None:
            out["replay"] = {"seed": self.replay_sampler.seed, "global_batch": self.n_replay,
                             "rows": self.replay_rows.rows, "data_hash": self.replay_rows.content_hash}
        return out

    def replay_indices(self, step: int) -> np.ndarray:
        """The pretraining rows replayed at `step` (the teacher cache job precomputes these)."""
        if self.replay_sampler is None:
            return np.zeros(0, dtype=np.int64)
        return self.replay_sampler.indices(step)

    def __call__(self, step: int) -> SFTStepBatch:
        chosen = [self.units[u] for u in self.sampler.indices(step)]
        if self.packing:
            batch = collate_packed([[self.examples[i] for i in unit] for unit in chosen],
                                   self.block_size, self.pad_id)
        else:
            plain = collate_sft([self.examples[unit[0]] for unit in chosen], self.block_size,
                                self.pad_id)
            batch = SFTStepBatch(plain.inputs, plain.targets, plain.tokens)
        if self.cache is not None:
            # loss positions in row-major order are the examples' loss positions in placement order
            values, indices = self.cache.sft_topk([i for unit in chosen for i in unit])
            attach_teacher(batch, values, indices)
        if self.n_replay:
            rows = self.replay_indices(step)
            plain = self.replay_rows.take(rows)
            batch.replay = SFTStepBatch(plain.inputs, plain.targets, plain.tokens)
            if self.cache is not None:
                values, indices = self.cache.replay_topk(rows)
                batch.replay.teacher_values, batch.replay.teacher_indices = values, indices
            batch.tokens += plain.tokens
        return batch


def attach_teacher(batch: SFTStepBatch, values: torch.Tensor, indices: torch.Tensor) -> None:
    """Scatter (P, k) teacher top-k rows onto the batch's P loss positions."""
    mask = batch.targets != IGNORE_INDEX
    if int(mask.sum()) != values.shape[0]:
        raise ValueError(f"the teacher cache holds {values.shape[0]} positions for this batch, "
                         f"the batch has {int(mask.sum())} loss positions; the cache was built "
                         "for other data or another block_size. Rebuild it.")
    k = values.shape[1]
    batch.teacher_values = torch.zeros((*batch.targets.shape, k), dtype=values.dtype)
    batch.teacher_indices = torch.zeros((*batch.targets.shape, k), dtype=torch.long)
    batch.teacher_values[mask] = values
    batch.teacher_indices[mask] = indices.long()
