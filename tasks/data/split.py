"""The train/validation split and the tokenizer's sample, decided by each document's id alone.

A document is validation when split_score(id, seed) < val_fraction, so its split never depends on
the others, on the shard it is in or on how many workers ran. plan_split makes the choices that
do look at every kept document (the tokenizer's sample, documents lent to a too-small validation
split) in one streamed pass whose memory does not grow with the corpus.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from dataclasses import dataclass
from typing import Any, Iterable


def split_score(doc_id: str, seed: int) -> float:
    """Uniform in [0, 1) from the id alone, so a document's split never depends on the others."""
    value = hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()
    return int.from_bytes(value[:8], "big") / 2**64


def mix_repeats(doc_id: str, weight: float, seed: int) -> int:
    """How many times a training document enters the rows under its source's mix weight:
    floor(weight), plus one more for a seeded fraction of the documents (weight's remainder)."""
    whole, part = int(math.floor(weight)), weight - math.floor(weight)
    return whole + (1 if part and split_score(doc_id, seed + 2) < part else 0)


def _keep_smallest(heap: list, size: int, key: tuple, item: Any) -> None:
    """Keep in `heap` the `size` items of smallest key seen so far (a max-heap on negated keys)."""
    full = len(heap) >= size
    if full and (not size or key[0] > -heap[0][0][0]):   # the cheap test first: past the first
        return                                           # few, most keys stop here
    entry = (tuple(-k for k in key), item)
    if not full:
        heapq.heappush(heap, entry)
    elif entry > heap[0]:
        heapq.heapreplace(heap, entry)


def _smallest_first(heap: list) -> list:
    return [item for _, item in sorted(heap, reverse=True)]


@dataclass
class SplitPlan:
    """What the tokenizer and the split need from the kept documents, in memory bounded by
    tokenizer_sample_docs + seq_len documents whatever the corpus size (plan_split)."""
    kept: int                                   # kept documents
    train: int                                  # of them in the training split
    val: list[tuple[int, int, str]] | None      # the validation documents, while fewer than a row
    lendable: list[tuple[int, int, str]]        # the row_len training documents of lowest split score
    sample: list[tuple[int, int, str]]          # the tokenizer's sample, in input order


def plan_split(documents: Iterable[tuple[int, int, str]], seed: int, val_fraction: float,
               sample_docs: int, row_len: int) -> SplitPlan:
    """One pass over the kept documents (shard, row, id), in input order. A document is
    validation when split_score(id, seed) < val_fraction. Of the training documents it keeps
    only the `sample_docs` of lowest split_score(id, seed + 1) (the tokenizer's sample: a second
    hash, so the sample is not the validation neighbours) and the `row_len` of lowest
    split_score(id, seed) (lent to a validation split that holds less than one row); of the
    validation documents, only the first `row_len` (only then are their tokens counted). Ties
    break as a stable sort by split score, then by the second score, would."""
    kept = train = 0
    val: list | None = []
    lendable: list = []
    sample: list = []
    for position, document in enumerate(documents):
        kept += 1
        score = split_score(document[2], seed)
        if score < val_fraction:
            if val is not None:
                val.append(document)
                if len(val) >= row_len:
                    val = None
            continue
        train += 1
        _keep_smallest(lendable, row_len, (score, position), document)
        _keep_smallest(sample, sample_docs, (split_score(document[2], seed + 1), score, position), document)
    return SplitPlan(kept, train, val, _smallest_first(lendable), sorted(_smallest_first(sample)))
