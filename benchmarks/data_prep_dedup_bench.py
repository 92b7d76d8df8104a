"""Data prep at scale, measured: the sharded near-dedup against the one-process step, and 1 -> 2
workers.

    python benchmarks/data_prep_dedup_bench.py [--mb 24] [--buckets 2 8 32] [--scaling-sizes 16 48] \
        [--rounds 3] [--out benchmarks/results/data_prep_dedup_scaling.json]

1. Dedup: the benchmark corpus (benchmarks/data_prep_corpus.py, stdlib prose with planted copies
   and near copies) goes through the per-shard stage (`prepare(stage="shards")`, split into shards
   of --split-mb); then on the same shards
   - the one-process step (dedup.find_duplicates, what data prep did before): every document's
     content hash and band keys read into one process;
   - the sharded step with B buckets: each bucket task as a worker runs it (prep.dedup_bucket:
     memory-mapped slices of every shard's sorted index, its pairs written out), then the union
     of the pairs (dedup.resolve_pairs);
   it checks that the decisions (which documents go, which kept one each duplicates, exact or
   near, and the counts) are identical, and reports the peak memory each allocates (tracemalloc:
   Python and numpy allocations, the arrays a worker holds; memory-mapped pages are the page
   cache's) and its time.
2. Scaling: the whole pipeline on Ray Data with 1 worker pinned to 1 core and with 2 workers on 2
   cores, in alternating rounds, at two sizes: the per-MB rate of each (start-up cost apart), the
   efficiency rate_2 / (2 rate_1), and that of whole runs and of the per-shard stages alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.pretrain_common import machine  # noqa: E402 - at start: the load then
from benchmarks.data_prep_bench import bench_env, fit, pinned, timed, versions  # noqa: E402


def measured(fn, *args):
    """fn(*args), its peak traced allocation in bytes, and its seconds."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    started = time.perf_counter()
    value = fn(*args)
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return value, peak, seconds


def one_process_step(out: Path, shards: list[dict], bands: int):
    """What the global step did: every document's hash and band keys in one process."""
    from tasks.data.dedup import find_duplicates
    from tasks.data.markers import shard_files

    hashes, keys = [], []
    for index, shard in enumerate(shards):  # rebuilt in row order from the shard's sorted files
        exact, near = np.load(shard_files(out, index)["exact"]), np.load(shard_files(out, index)["near"])
        h = np.zeros((shard["kept"], 2), np.uint64)
        h[exact[2].astype(np.int64)] = exact[:2].T
        k = np.zeros((shard["kept"], bands), np.uint64)
        starts = shard["band_starts"]
        for band in range(bands):
            k[near[1, starts[band]:starts[band + 1]].astype(np.int64), band] = near[0, starts[band]:starts[band + 1]]
        hashes.append(h)
        keys.append(k)
    duplicate_of, kind, stats = find_duplicates(np.concatenate(hashes), np.concatenate(keys))
    removed = np.flatnonzero(kind)
    return removed, duplicate_of[removed], kind[removed], stats


def sharded_step(out: Path, shards: list[dict], bands: int, buckets: int) -> dict:
    from tasks.data.dedup import resolve_pairs
    from tasks.data.planning import write_dedup_plan
    from tasks.data.prep import dedup_bucket

    offsets = write_dedup_plan(out, shards, bands)
    peaks, seconds = [], []
    for bucket in range(buckets):
        _, peak, secs = measured(dedup_bucket, {"out_dir": str(out), "bucket": bucket, "buckets": buckets,
                                                "bands": bands, "exact": True, "key": f"bench-{buckets}"})
        peaks.append(peak)
        seconds.append(secs)

    def union():
        exact, near = [], []
        for bucket in range(buckets):
            with np.load(out / "staging" / "dedup" / f"{bucket:05d}.npz") as pairs:
                exact.append(pairs["exact"])
                near.append(pairs["near"])
        return resolve_pairs(int(offsets[-1]), np.concatenate(exact), np.concatenate(near))

    decisions, union_peak, union_seconds = measured(union)
    return {"decisions": decisions, "bucket_peak_bytes": peaks, "bucket_seconds": seconds,
            "union_peak_bytes": union_peak, "union_seconds": union_seconds,
            "pairs": int(sum(len(np.load(out / "staging" / "dedup" / f"{b:05d}.npz")["near"]) for b in range(buckets)))}


def dedup_section(corpus: Path, work: Path, buckets_list: list[int], split_mb: float) -> dict:
    from tasks.configs import DataPrepConfig
    from tasks.data.prep import prepare

    out = work / "dedup-shards"
    shutil.rmtree(out, ignore_errors=True)
    config = DataPrepConfig(inputs=[str(corpus / "*.jsonl")], output_dir=str(out), engine="local",
                            split_bytes=int(split_mb * 1e6))
    started = time.perf_counter()
    prepare(config, stage="shards")
    shard_seconds = time.perf_counter() - started
    shards = [json.loads(p.read_text()) for p in sorted((out / "completions").glob("shard_*.json"))]
    documents = sum(s["kept"] for s in shards)
    bands = config.minhash_bands
    reference, global_peak, global_seconds = measured(one_process_step, out, shards, bands)
    report = {"shards": len(shards), "documents_compared": documents, "shard_stage_seconds": round(shard_seconds, 1),
              "one_process": {"peak_bytes": global_peak, "bytes_per_document": round(global_peak / documents, 1),
                              "seconds": round(global_seconds, 3), "stats": reference[3]},
              "sharded": {}}
    print(f"dedup: {documents} documents in {len(shards)} shards; one process: peak {global_peak / 1e6:.1f} MB "
          f"({global_peak / documents:.0f} B/document), {global_seconds:.2f} s; {reference[3]}")
    for buckets in buckets_list:
        result = sharded_step(out, shards, bands, buckets)
        removed, kept_of, kind, stats = result["decisions"]
        identical = bool(np.array_equal(removed, reference[0]) and np.array_equal(kept_of, reference[1])
                         and np.array_equal(kind, reference[2]) and stats == reference[3])
        peak = max(result["bucket_peak_bytes"])
        report["sharded"][str(buckets)] = {
            "identical_decisions": identical, "max_bucket_peak_bytes": peak,
            "bucket_peak_bytes": result["bucket_peak_bytes"],
            "max_bucket_over_one_process": round(peak / global_peak, 3),
            "bucket_seconds_total": round(sum(result["bucket_seconds"]), 3),
            "union_peak_bytes": result["union_peak_bytes"], "union_seconds": round(result["union_seconds"], 3),
            "near_pairs": result["pairs"]}
        print(f"dedup: {buckets:>3} buckets: identical decisions {identical}; peak per bucket worker "
              f"{peak / 1e6:.2f} MB ({peak / global_peak:.0%} of one process), buckets {sum(result['bucket_seconds']):.2f} s "
              f"in all; union of {result['pairs']} near pairs: peak {result['union_peak_bytes'] / 1e6:.2f} MB, "
              f"{result['union_seconds']:.3f} s")
        if not identical:
            raise SystemExit(f"sharded dedup with {buckets} buckets decided differently from the one-process step")
    shutil.rmtree(out, ignore_errors=True)
    return report


def scaling_section(corpora: dict[float, tuple[Path, dict]], work: Path, rounds: int) -> dict:
    configs = (("ray-1worker", 1), ("ray-2workers", 2))
    runs: dict[str, dict[float, list[dict]]] = {name: {s: [] for s in corpora} for name, _ in configs}
    env = bench_env()
    for round_ in range(rounds):
        for size, (folder, _) in corpora.items():
            for name, workers in (configs if round_ % 2 == 0 else configs[::-1]):
                out = work / "runs" / f"scaling-{size:g}-{name}"
                shutil.rmtree(out, ignore_errors=True)
                config = work / "runs" / f"scaling-{name}.config.json"
                config.parent.mkdir(parents=True, exist_ok=True)
                config.write_text(json.dumps({"engine": "ray", "seq_len": 1024, "vocab_size": 8192,
                                              "tokenizer_path": str(work / "stdlib-tokenizer.json"),
                                              "demo_sft_examples": 100}))
                run = timed([*pinned(workers), sys.executable, "-m", "tasks.data.prep", "--input",
                             str(folder / "jsonl" / "*.jsonl"), "--output", str(out), "--config", str(config),
                             "--workers", str(workers)], env)
                stdout = run.pop("stdout")
                metrics = json.loads(stdout[stdout.index("\n{") + 1:])["metrics"]
                run["stages"] = {k[len("seconds."):]: v for k, v in metrics.items() if k.startswith("seconds.")}
                runs[name][size].append(run)
                print(f"scaling {size:g} MB round {round_ + 1}: {name:<13} {run['seconds']:6.2f} s "
                      f"(shards {run['stages'].get('shards', 0):.1f} s, documents and tokens "
                      f"{run['stages'].get('documents_and_tokens', 0):.1f} s; load {run['load_before']:.1f})")
    report: dict = {"configs": {}}
    for name, workers in configs:
        sizes = {}
        for size in corpora:
            times = [r["seconds"] for r in runs[name][size]]
            parallel = [r["stages"].get("shards", 0) + r["stages"].get("documents_and_tokens", 0) + r["stages"].get("dedup", 0)
                        for r in runs[name][size]]
            sizes[f"{size:g}"] = {"median_s": round(statistics.median(times), 2), "runs_s": [round(t, 2) for t in times],
                                  "parallel_stages_median_s": round(statistics.median(parallel), 2),
                                  "load": [round(r["load_before"], 2) for r in runs[name][size]]}
        model = fit({corpora[s][1]["text_mb"]: statistics.median(r["seconds"] for r in runs[name][s]) for s in corpora})
        report["configs"][name] = {"workers": workers, "cores": workers, "sizes": sizes, "model": model}
    one, two = report["configs"]["ray-1worker"], report["configs"]["ray-2workers"]
    largest = f"{max(corpora):g}"
    report["efficiency"] = {
        "per_mb": round(two["model"]["mb_per_s"] / one["model"]["mb_per_s"] / 2, 3),
        f"whole_run_{largest}mb": round(one["sizes"][largest]["median_s"] / two["sizes"][largest]["median_s"] / 2, 3),
        f"parallel_stages_{largest}mb": round(one["sizes"][largest]["parallel_stages_median_s"]
                                             / two["sizes"][largest]["parallel_stages_median_s"] / 2, 3),
        f"whole_run_{largest}mb_per_round": [round(a["seconds"] / b["seconds"] / 2, 3) for a, b in
                                            zip(runs["ray-1worker"][max(corpora)], runs["ray-2workers"][max(corpora)])],
    }
    print(f"scaling 1 -> 2 workers: {report['efficiency']}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=24, help="Dedup corpus size, MB of text.")
    parser.add_argument("--split-mb", type=float, default=1.0, help="Shard size (split_bytes) for the dedup part.")
    parser.add_argument("--buckets", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--scaling-sizes", type=float, nargs="+", default=[16, 48])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=REPO / ".llmops" / "bench-data")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--skip-scaling", action="store_true")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    from benchmarks.data_prep_bench import train_shared_tokenizer
    from benchmarks.data_prep_corpus import build_corpus

    corpora = {}
    for size in sorted({args.mb, *args.scaling_sizes}):
        folder = args.work / f"stdlib-{size:g}mb"
        if not (folder / "stats.json").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            (folder / "stats.json").write_text(json.dumps(build_corpus(folder / "jsonl", size)))
        corpora[size] = (folder, json.loads((folder / "stats.json").read_text()))
    if not (args.work / "stdlib-tokenizer.json").exists():
        train_shared_tokenizer(corpora[max(corpora)][0] / "jsonl", args.work / "stdlib-tokenizer.json")
    results = {"machine": {"cpus": os.cpu_count()}, "versions": versions(None),
               "load_average_start": os.getloadavg(),
               "corpus": corpora[args.mb][1], "dedup": dedup_section(corpora[args.mb][0] / "jsonl", args.work,
                                                                    args.buckets, args.split_mb)}
    if not args.skip_scaling:
        results["scaling"] = scaling_section({s: corpora[s] for s in args.scaling_sizes}, args.work, args.rounds)
    results["load_average_end"] = os.getloadavg()
    results["machine"] = {**results["machine"], **machine()}  # commit, versions, load
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, sort_keys=True, default=int) + "\n")
    print(json.dumps(results, sort_keys=True, default=int))


if __name__ == "__main__":
    main()
