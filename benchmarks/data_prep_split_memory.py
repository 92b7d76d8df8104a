"""The data prep driver's memory for the train/validation split and the tokenizer's sample, at
10^8 documents: it streams the kept ids (tasks.data.split.plan_split) instead of listing them.

    python benchmarks/data_prep_split_memory.py [--documents 100000000] [--out FILE]

Synthetic kept documents (shard, row, id) are generated on the fly, 10^6 to a shard, and fed to
plan_split with the defaults of DataPrepConfig (val_fraction, tokenizer_sample_docs, seq_len). The
process's peak resident memory is read as the pass goes (every tenth of it), so a memory that grows
with the corpus would show as a rising column. Beside it, what the driver did before, a list of
every kept (shard, row, id), is measured at 10^6 documents with tracemalloc and scaled: that is the
memory this pass does not need.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import tracemalloc
from pathlib import Path

from pretrain_common import RESULTS, last_json_line

from tasks.configs import DataPrepConfig
from tasks.data.split import plan_split
from tasks.train.telemetry import Progress

PER_SHARD = 1_000_000


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: KiB


def document(i: int) -> tuple[int, int, str]:
    return i // PER_SHARD, i % PER_SHARD, f"synthetic/{i:014d}"


def listed_bytes_per_document(n: int = 1_000_000) -> float:
    """Bytes per kept document of the old driver-side list of (shard, row, id) tuples."""
    tracemalloc.start()
    kept = [document(i) for i in range(n)]
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del kept
    return size / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=100_000_000)
    parser.add_argument("--out", type=Path, default=RESULTS / "data_prep_split_memory.json")
    args = parser.parse_args()
    defaults = DataPrepConfig(output_dir="unused")   # only its defaults are read
    checkpoints = {max(1, args.documents * k // 10) for k in range(1, 11)}
    rss: dict[int, float] = {}
    progress = Progress(args.documents)
    started = time.perf_counter()
    baseline = rss_mb()

    def documents():
        for i in range(args.documents):
            yield document(i)
            if i + 1 in checkpoints:
                rss[i + 1] = round(rss_mb(), 1)
                print(f"{i + 1:>13,} ids: peak RSS {rss[i + 1]:8.1f} MB | {progress.line(i + 1)}", flush=True)

    plan = plan_split(documents(), defaults.seed, defaults.val_fraction, defaults.tokenizer_sample_docs,
                      defaults.seq_len + 1)
    seconds = time.perf_counter() - started
    per_doc = listed_bytes_per_document()
    growth = rss[args.documents] - rss[min(rss)]
    print(f"\n{args.documents:,} kept ids in {seconds:.0f} s: peak RSS {rss[args.documents]:.0f} MB "
          f"(before the pass {baseline:.0f} MB; growth from the first tenth to the end {growth:.1f} MB).")
    print(f"A list of every kept id, as the driver held before: {per_doc:.0f} B/document, "
          f"{per_doc * args.documents / 1e9:.1f} GB here, {per_doc * 1e9 / 1e9:.0f} GB at 10^9.")
    last_json_line({"benchmark": "data_prep_split_memory", "documents": args.documents,
                    "seconds": round(seconds, 1), "rss_mb_before": round(baseline, 1),
                    "peak_rss_mb_by_documents": {str(k): v for k, v in sorted(rss.items())},
                    "rss_growth_mb_first_tenth_to_end": round(growth, 1),
                    "plan": {"kept": plan.kept, "train": plan.train, "sample": len(plan.sample),
                             "lendable": len(plan.lendable)},
                    "settings": {"val_fraction": defaults.val_fraction,
                                 "tokenizer_sample_docs": defaults.tokenizer_sample_docs,
                                 "row_len": defaults.seq_len + 1},
                    "listed_ids_bytes_per_document": round(per_doc, 1),
                    "listed_ids_gb_at_this_size": round(per_doc * args.documents / 1e9, 2),
                    "listed_ids_gb_at_1e9": round(per_doc, 1)}, args.out)


if __name__ == "__main__":
    sys.exit(main())
