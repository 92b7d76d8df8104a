"""Scoring a model: held-out loss on token shards or on completions, and exact-match accuracy of
greedy answers. Used during training (val loss) and by fine-tuning, distillation and evaluation."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tasks.model.gpt import IGNORE_INDEX
from tasks.train.prepared_data import Batch, SFTExample, TokenRows, collate_sft
from tasks.train.runtime import autocast


@torch.no_grad()
def _token_weighted_loss(model: nn.Module, batches: list[Batch], device: torch.device) -> float:
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device, dtype=torch.float64), 0
    try:
        for batch in batches:
            batch = batch.to(device)
            with autocast(device):
                logits, _ = model(batch.inputs)
            # summed, not averaged per batch: batches with more scored tokens weigh more
            total += F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(),
                                     ignore_index=IGNORE_INDEX, reduction="sum").double()
            count += int((batch.targets != IGNORE_INDEX).sum())
    finally:
        model.train(was_training)
    return float(total) / max(count, 1)


def shard_loss(model: nn.Module, rows: TokenRows, batch_size: int, max_batches: int,
               device: torch.device) -> float:
    """Mean next-token loss over the first max_batches batches of a split (a fixed val set)."""
    batches = [rows.take(i) for i in rows.in_order(batch_size, max_batches)]
    return _token_weighted_loss(model, batches, device)


def completion_loss(model: nn.Module, examples: list[SFTExample], batch_size: int,
                    device: torch.device) -> float:
    """Mean loss per completion token (prompts are context, not scored)."""
    # the pad id is irrelevant: padding sits after every real token (causal attention never
    # looks ahead) and its targets are ignored
    batches = [collate_sft(examples[i:i + batch_size], model.config.block_size, pad_id=0)
               for i in range(0, len(examples), batch_size)]
    return _token_weighted_loss(model, batches, device)


def answer_budget(examples: list[SFTExample]) -> int:
    """Greedy decoding budget: the longest reference completion plus a little slack, so a wrong
    answer that rambles is cut off quickly."""
    return max(len(e.completion_ids) for e in examples) + 2


def newline_token_ids(tokenizer) -> frozenset[int]:
    """Tokens whose text contains a newline: an answer ends at the first of them."""
    return frozenset(i for i in range(tokenizer.get_vocab_size())
                     if "\n" in tokenizer.decode([i], skip_special_tokens=False))


@torch.no_grad()
def exact_match(model: nn.Module, tokenizer, examples: list[SFTExample], eos_id: int,
                max_new_tokens: int, device: torch.device, batch_size: int = 64,
                keep_samples: int = 5) -> dict[str, Any]:
    """Greedy-decode each prompt until EOS or a newline and compare the stripped answer with the
    stripped completion. Returns accuracy, per-skill accuracy, counts, a few samples and whether each
    example was right."""
    was_training = model.training
    model.eval()
    stops = newline_token_ids(tokenizer)
    answers: dict[int, str] = {}
    # Prompts of equal token length decode together: no padding, so batching changes nothing.
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, ex in enumerate(examples):
        by_length[len(ex.prompt_ids)].append(i)
    try:
        for length, members in sorted(by_length.items()):
            for j in range(0, len(members), batch_size):
                chunk = members[j:j + batch_size]
                idx = torch.tensor([examples[i].prompt_ids for i in chunk], dtype=torch.long,
                                   device=device)
                with autocast(device):
                    out = model.generate(idx, max_new_tokens, eos_id=eos_id, stop_ids=stops)
                for i, row in zip(chunk, out[:, length:].tolist()):
                    if eos_id in row:
                        row = row[: row.index(eos_id)]
                    answers[i] = tokenizer.decode(row).split("\n")[0]
    finally:
        model.train(was_training)
    right: dict[str, list[bool]] = defaultdict(list)
    samples, correct = [], []
    for i, ex in enumerate(examples):
        ok = answers[i].strip() == ex.completion.strip()
        right[ex.skill].append(ok)
        correct.append(ok)
        if len(samples) < keep_samples:
            samples.append({"prompt": ex.prompt, "expected": ex.completion, "answer": answers[i],
                            "correct": ok})
    n_right = sum(sum(v) for v in right.values())
    return {
        "accuracy": n_right / max(len(examples), 1),
        "n": len(examples),
        "per_skill": {skill: sum(v) / len(v) for skill, v in sorted(right.items())},
        "samples": samples,
        "correct": correct,   # per example, in the order given: paired comparisons need items
    }
