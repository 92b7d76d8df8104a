"""The train/validation split and the tokenizer's sample, decided by each document's id alone.

A document is validation when split_score(id, seed) < val_fraction, so its split never depends on
the others, on the shard it is in or on how many workers ran. The choices that do look at every
kept document (the tokenizer's sample, documents lent to a too-small validation split) are made
shard by shard, on the workers: each shard reports only its documents whose scores fall below a
cut (shard_candidates), and one process merges those few (merge_candidates). The cuts are set
from the number of kept documents so that they let through a little more than is picked; a merge
that finds too few candidates says so and the pass runs again with wider cuts, so the plan is
always the one a single pass over every id in input order makes (plan_split, which is exactly
that pass with no cut). Hashing every kept id was one process's work: 9.8 us an id, ~2.7 h at
10^9 documents (benchmarks/data_prep_split_memory.py).
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

log = logging.getLogger(__name__)


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


def _smallest_first_keyed(heap: list) -> list[tuple[tuple, Any]]:
    """The heap's (key, item) pairs, smallest key first."""
    return [(tuple(-k for k in negated), item) for negated, item in sorted(heap, reverse=True)]


@dataclass
class SplitPlan:
    """What the tokenizer and the split need from the kept documents, in memory bounded by
    tokenizer_sample_docs + seq_len documents whatever the corpus size (plan_split)."""
    kept: int                                   # kept documents
    train: int                                  # of them in the training split
    val: list[tuple[int, int, str]] | None      # the validation documents, while fewer than a row
    lendable: list[tuple[int, int, str]]        # the row_len training documents of lowest split score
    sample: list[tuple[int, int, str]]          # the tokenizer's sample, in input order


# How far past the expected count a cut reaches: this many standard deviations of the binomial
# count of scores below it (plus a floor for tiny picks), so that a second pass is all but never
# needed: the chance of a count that short is below 10^-15.
CUT_MARGIN_SIGMAS = 8
CUT_MARGIN_FLOOR = 16


@dataclass(frozen=True)
class SplitCuts:
    """What a shard reports (shard_candidates): training documents whose sample score is below
    sample_below, those whose split score is below lend_below, and up to val_limit validation
    documents. Cuts of 1.0 and a val_limit of row_len report everything a plan can pick."""
    sample_below: float = 1.0
    lend_below: float = 1.0
    val_limit: int | None = None   # None: row_len

    @classmethod
    def for_corpus(cls, kept: int, val_fraction: float, sample_docs: int, row_len: int) -> "SplitCuts":
        """Cuts for `kept` documents: scores are uniform in [0, 1), so about kept * width of them
        fall below a cut of that width; each cut lets through its picks plus a margin."""
        def width(picks: int, population: float) -> float:
            wanted = picks + CUT_MARGIN_SIGMAS * math.sqrt(picks) + CUT_MARGIN_FLOOR
            return wanted / population if population > 0 else 1.0

        train = kept * (1 - val_fraction)
        expected_val = kept * val_fraction
        return cls(sample_below=min(1.0, width(sample_docs, train)),
                   lend_below=min(1.0, val_fraction + width(row_len, kept)),
                   # the validation documents matter only when they fill less than a row
                   val_limit=None if expected_val < 4 * row_len else 0)

    def wider(self, val_fraction: float) -> "SplitCuts":
        """Four times the room past each cut (a pass whose candidates fell short runs again)."""
        return SplitCuts(sample_below=min(1.0, 4 * self.sample_below),
                         lend_below=min(1.0, val_fraction + 4 * (self.lend_below - val_fraction)),
                         val_limit=None)


def shard_candidates(documents: Iterable[tuple[int, int, str]], seed: int, val_fraction: float,
                     sample_docs: int, row_len: int, cuts: SplitCuts = SplitCuts()) -> dict[str, Any]:
    """One shard's part of the plan, from its kept documents (shard, row, id) in input order: its
    counts, and the documents below `cuts` that a plan could pick (at most sample_docs, row_len and
    val_limit of each kind: no more can be picked from one shard). JSON-able, for any engine."""
    val_limit = row_len if cuts.val_limit is None else cuts.val_limit
    kept = train = val_count = 0
    val: list = []
    lendable: list = []
    sample: list = []
    for shard, row, doc_id in documents:
        kept += 1
        score = split_score(doc_id, seed)
        if score < val_fraction:
            val_count += 1
            if len(val) < val_limit:
                val.append([shard, row, doc_id])
            continue
        train += 1
        # (shard, row) orders documents as input order does: a tie in score breaks the same way
        if score < cuts.lend_below:
            _keep_smallest(lendable, row_len, (score, shard, row), doc_id)
        if sample_docs and (second := split_score(doc_id, seed + 1)) < cuts.sample_below:
            _keep_smallest(sample, sample_docs, (second, score, shard, row), doc_id)
    return {"kept": kept, "train": train, "val_count": val_count, "val": val,
            "lendable": [[*key, doc_id] for key, doc_id in _smallest_first_keyed(lendable)],
            "sample": [[*key, doc_id] for key, doc_id in _smallest_first_keyed(sample)]}


def merge_candidates(parts: list[dict[str, Any]], sample_docs: int, row_len: int,
                     cuts: SplitCuts) -> SplitPlan | None:
    """The plan from every shard's candidates (parts in shard order), or None when a cut let
    through fewer than the plan picks: some of its picks may then lie past the cut, and the
    shards must report again with wider cuts."""
    kept = sum(p["kept"] for p in parts)
    train = sum(p["train"] for p in parts)
    val_count = sum(p["val_count"] for p in parts)
    val = [(d[0], d[1], d[2]) for p in parts for d in p["val"]]
    lendable = sorted(tuple(c) for p in parts for c in p["lendable"])
    sample = sorted(tuple(c) for p in parts for c in p["sample"])
    if val_count < row_len and len(val) < val_count:
        return None
    if cuts.lend_below < 1 and len(lendable) < min(row_len, train):
        return None
    if cuts.sample_below < 1 and len(sample) < min(sample_docs, train):
        return None
    return SplitPlan(kept, train, val if val_count < row_len else None,
                     [(c[1], c[2], c[3]) for c in lendable[:row_len]],
                     sorted((c[2], c[3], c[4]) for c in sample[:sample_docs]))


def plan_by_shard(report: Callable[[SplitCuts], list[dict[str, Any]]], kept: int, val_fraction: float,
                  sample_docs: int, row_len: int, cuts: SplitCuts | None = None) -> SplitPlan:
    """The plan of `kept` documents from every shard's candidates: report(cuts) runs
    shard_candidates once per shard (one job each, anywhere) and returns the parts in shard order.
    The cuts are set from `kept` unless given; while a merge finds that they let too few
    through, the shards report again with wider ones."""
    cuts = cuts or SplitCuts.for_corpus(kept, val_fraction, sample_docs, row_len)
    while (plan := merge_candidates(report(cuts), sample_docs, row_len, cuts)) is None:
        log.info("split: the cuts %s let through too few candidates; again with wider cuts", cuts)
        cuts = cuts.wider(val_fraction)
    return plan


def plan_split(documents: Iterable[tuple[int, int, str]], seed: int, val_fraction: float,
               sample_docs: int, row_len: int) -> SplitPlan:
    """One pass over the kept documents (shard, row, id), in input order. A document is
    validation when split_score(id, seed) < val_fraction. Of the training documents it keeps
    only the `sample_docs` of lowest split_score(id, seed + 1) (the tokenizer's sample: a second
    hash, so the sample is not the validation neighbours) and the `row_len` of lowest
    split_score(id, seed) (lent to a validation split that holds less than one row); of the
    validation documents, only the first `row_len` (only then are their tokens counted). Ties
    break as a stable sort by split score, then by the second score, would. A shard's
    candidates with no cut, merged: what the sharded plan must equal."""
    plan = merge_candidates([shard_candidates(documents, seed, val_fraction, sample_docs, row_len)],
                            sample_docs, row_len, SplitCuts())
    assert plan is not None  # no cut: nothing can fall short
    return plan
