"""The train/validation split and the tokenizer's sample at 10^8 kept documents: the driver's
memory, and the time of the pass that hashes every kept id, serial against split by shard.

    python benchmarks/data_prep_split_memory.py [--documents 100000000] [--compare-documents 10000000]
        [--out FILE]

Synthetic kept documents (shard, row, id), 10^6 to a shard, with the defaults of DataPrepConfig
(val_fraction, tokenizer_sample_docs, seq_len):
1. at --documents, the plan as data prep makes it: one job per shard on 2 worker processes
   (tasks.data.split.shard_candidates, each job generating its shard's ids), the driver merging
   the few candidates they report (merge_candidates). The driver's peak resident memory is read
   as the parts arrive (every tenth), so a memory that grew with the corpus would show as a
   rising column; the candidates it merged are counted.
2. at --compare-documents, like for like in one run: the single pass over every id in one process
   that the driver made before (plan_split), the sharded pass on 1 worker and on 2, and the plans
   compared (they must be equal).
Beside them, what the driver did before it streamed the ids, a list of every kept (shard, row,
id), is measured at 10^6 documents with tracemalloc and scaled: the memory neither pass needs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import sys
import time
import tracemalloc
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

from pretrain_common import RESULTS, last_json_line

from tasks.configs import DataPrepConfig
from tasks.data.split import SplitCuts, SplitPlan, plan_by_shard, plan_split, shard_candidates
from tasks.train.telemetry import Progress

PER_SHARD = 1_000_000
DEFAULTS = DataPrepConfig(output_dir="unused")   # only its defaults are read
ROW_LEN = DEFAULTS.seq_len + 1


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: KiB


def document(i: int) -> tuple[int, int, str]:
    return i // PER_SHARD, i % PER_SHARD, f"synthetic/{i:014d}"


def shard_documents(shard: int, documents: int) -> Iterator[tuple[int, int, str]]:
    return (document(i) for i in range(shard * PER_SHARD, min(documents, (shard + 1) * PER_SHARD)))


def shard_job(job: tuple[int, int, dict[str, Any]]) -> dict[str, Any]:
    """One shard's candidates, as data prep's split_candidates job computes them."""
    shard, documents, cuts = job
    return shard_candidates(shard_documents(shard, documents), DEFAULTS.seed, DEFAULTS.val_fraction,
                            DEFAULTS.tokenizer_sample_docs, ROW_LEN, SplitCuts(**cuts))


def sharded_plan(documents: int, workers: int,
                 on_part: Callable[[int], None] = lambda done: None) -> tuple[SplitPlan, int, int]:
    """(plan, passes, candidates the driver merged): the sharded pass on `workers` processes, as
    data prep plans its split (tasks.data.split.plan_by_shard)."""
    from dataclasses import asdict

    shards = -(-documents // PER_SHARD)
    reports: list[list[dict[str, Any]]] = []
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        def report(cuts: SplitCuts) -> list[dict[str, Any]]:
            parts: list[dict[str, Any]] = []
            for part in pool.map(shard_job, [(s, documents, asdict(cuts)) for s in range(shards)]):
                parts.append(part)
                on_part(len(parts))
            reports.append(parts)
            return parts

        plan = plan_by_shard(report, documents, DEFAULTS.val_fraction, DEFAULTS.tokenizer_sample_docs, ROW_LEN)
    merged = sum(len(p[kind]) for p in reports[-1] for kind in ("val", "lendable", "sample"))
    return plan, len(reports), merged


def listed_bytes_per_document(n: int = 1_000_000) -> float:
    """Bytes per kept document of the old driver-side list of (shard, row, id) tuples."""
    tracemalloc.start()
    kept = [document(i) for i in range(n)]
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del kept
    return size / n


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    return fn(), round(time.perf_counter() - started, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=100_000_000)
    parser.add_argument("--compare-documents", type=int, default=10_000_000)
    parser.add_argument("--out", type=Path, default=RESULTS / "data_prep_split_memory.json")
    args = parser.parse_args()
    baseline = rss_mb()

    # 1. the driver's memory at --documents, the plan made by shard on 2 workers
    shards = -(-args.documents // PER_SHARD)
    checkpoints = {max(1, shards * k // 10) for k in range(1, 11)}
    rss: dict[int, float] = {}
    progress = Progress(shards)

    def on_part(done: int) -> None:
        if done in checkpoints:
            rss[min(args.documents, done * PER_SHARD)] = round(rss_mb(), 1)
            print(f"{done:>5} of {shards} shards: driver peak RSS {rss_mb():8.1f} MB | {progress.line(done)}",
                  flush=True)

    (plan, passes, merged), seconds = timed(lambda: sharded_plan(args.documents, 2, on_part))
    growth = rss[max(rss)] - rss[min(rss)]
    print(f"\n{args.documents:,} kept ids by shard on 2 workers in {seconds:.0f} s ({passes} pass): the "
          f"driver merged {merged:,} candidates; its peak RSS {rss[max(rss)]:.0f} MB (before {baseline:.0f} "
          f"MB; growth from the first tenth to the end {growth:.1f} MB).")

    # 2. like for like at --compare-documents: the serial pass, and by shard on 1 and 2 workers
    n = args.compare_documents
    serial, serial_s = timed(lambda: plan_split((document(i) for i in range(n)), DEFAULTS.seed,
                                                DEFAULTS.val_fraction, DEFAULTS.tokenizer_sample_docs, ROW_LEN))
    (one, _, _), one_s = timed(lambda: sharded_plan(n, 1))
    (two, _, _), two_s = timed(lambda: sharded_plan(n, 2))
    if not serial == one == two:
        raise SystemExit("the sharded plan differs from the serial pass's")
    print(f"{n:,} kept ids: serial {serial_s:.1f} s, by shard on 1 worker {one_s:.1f} s, on 2 workers "
          f"{two_s:.1f} s ({serial_s / two_s:.2f}x the serial pass); the plans are equal.")

    per_doc = listed_bytes_per_document()
    print(f"A list of every kept id, as the driver held before: {per_doc:.0f} B/document, "
          f"{per_doc * args.documents / 1e9:.1f} GB at {args.documents:,}, {per_doc:.0f} GB at 10^9.")
    last_json_line({"benchmark": "data_prep_split_memory", "documents": args.documents,
                    "sharded": {"workers": 2, "seconds": seconds, "passes": passes,
                                "candidates_merged_by_driver": merged, "rss_mb_before": round(baseline, 1),
                                "driver_peak_rss_mb_by_documents": {str(k): v for k, v in sorted(rss.items())},
                                "driver_rss_growth_mb_first_tenth_to_end": round(growth, 1),
                                "plan": {"kept": plan.kept, "train": plan.train, "sample": len(plan.sample),
                                         "lendable": len(plan.lendable)}},
                    "like_for_like": {"documents": n, "serial_pass_s": serial_s, "by_shard_1_worker_s": one_s,
                                      "by_shard_2_workers_s": two_s,
                                      "speedup_2_workers_over_serial": round(serial_s / two_s, 2),
                                      "plans_equal": True},
                    "settings": {"val_fraction": DEFAULTS.val_fraction,
                                 "tokenizer_sample_docs": DEFAULTS.tokenizer_sample_docs,
                                 "row_len": ROW_LEN, "documents_per_shard": PER_SHARD},
                    "listed_ids_bytes_per_document": round(per_doc, 1),
                    "listed_ids_gb_at_this_size": round(per_doc * args.documents / 1e9, 2),
                    "listed_ids_gb_at_1e9": round(per_doc, 1)}, args.out)


if __name__ == "__main__":
    sys.exit(main())
