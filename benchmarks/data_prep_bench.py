"""Data prep throughput: tasks.data.prep against datatrove, like for like, on the same cores.

    make bench-data       # creates the datatrove venv (.llmops/bench-venv), then runs this
    python benchmarks/data_prep_bench.py --datatrove-python .llmops/bench-venv/bin/python \
        [--sizes 4 16] [--rounds 3] [--corpora stdlib packages] [--out benchmarks/results/data_prep_throughput.json]

What it does, all offline:
1. builds each corpus at each size (benchmarks/data_prep_corpus.py: documents composed from the
   docstrings of the standard library, or of installed third-party packages, with planted
   copies, near copies, junk and PII), and one byte-level BPE per corpus (timed apart) that both
   pipelines tokenize with;
2. runs, in rounds whose order alternates (so a burst of load on this shared machine hits every
   configuration alike): this project's whole pipeline (`python -m tasks.data.prep`: filters, PII,
   exact + near dedup, documents, tokens, manifest) with engine auto, pinned with taskset to 1
   core (1 worker: in-process) and to 2 cores (2 workers: this process and a pool of 1); datatrove's
   equivalent pipeline
   (benchmarks/data_prep_datatrove.py) pinned to the same 1 and 2 cores (1 and 2 workers);
3. fits each configuration's median times at the sizes to time = start-up + MB / rate: the fixed
   start-up cost apart from the per-MB rate, and reports per-core throughput, the ratios on the
   same cores (1 core against 1 core, 2 against 2), the 1 -> 2 core scaling of each, the spread of
   the rounds and the machine's load; and how far the two pipelines agree on what to keep.

Times are wall-clock seconds of whole runs (interpreter, imports, worker start-up and every stage
included); CPU seconds of each run's process tree are recorded beside them. Both pipelines run
at nice -15 when this runs as root, so other work on a shared machine disturbs them less.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.pretrain_common import machine  # noqa: E402 - at start: the load then

CONFIGS = (  # name, pipeline, cores, workers
    ("ours-1core", "ours", 1, 1),
    ("datatrove-1core", "datatrove", 1, 1),
    ("ours-2core", "ours", 2, 2),
    ("datatrove-2core", "datatrove", 2, 2),
)


def pinned(cores: int) -> list[str]:
    """taskset prefix limiting a run to `cores` CPUs (the first ones this process may use)."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < cores:
        raise SystemExit(f"{cores} cores requested, only {len(allowed)} available")
    return ["taskset", "-c", ",".join(map(str, allowed[:cores]))] if shutil.which("taskset") else []


def _tree_cpu(root: int, seen: dict[int, float]) -> None:
    """Update `seen` (pid -> CPU seconds) with every live process under `root`: Ray's and
    datatrove's workers are not all reaped through this process, so rusage would miss them."""
    parents, cpu = {}, {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / TICKS
    for pid in cpu:
        ancestor = pid
        while ancestor not in (0, 1, root):
            ancestor = parents.get(ancestor, 0)
        if ancestor == root or pid == root:
            seen[pid] = max(seen.get(pid, 0.0), cpu[pid])


TICKS = os.sysconf("SC_CLK_TCK")
NICE = ["nice", "-n", "-15"] if os.geteuid() == 0 else []  # both sides alike, ahead of other work


def timed(cmd: list[str], env: dict | None = None) -> dict:
    """Run to completion at raised priority; wall seconds, CPU seconds of its whole process tree
    (sampled every 0.2 s from /proc: a process's last 0.2 s may be missed), load around it."""
    load = os.getloadavg()[0]
    seen: dict[int, float] = {}
    started = time.perf_counter()
    proc = subprocess.Popen([*NICE, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=REPO)
    out: list[str] = []
    ended: list[float] = []

    def read() -> None:  # the end is taken here, when the run's output closes, not at the next sample
        out.extend(proc.communicate())
        ended.append(time.perf_counter())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while proc.poll() is None:
        _tree_cpu(proc.pid, seen)
        time.sleep(0.2)
    reader.join()
    seconds = ended[0] - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[0][-3000:]}\n{out[1][-3000:]}")
    return {"seconds": seconds, "cpu_seconds": sum(seen.values()), "load_before": load,
            "load_after": os.getloadavg()[0], "stdout": out[0]}


def ids_in(folder: Path, column: str = "id") -> set[str]:
    import pyarrow.parquet as pq

    return {i for path in sorted(folder.glob("*.parquet"))
            for i in pq.read_table(path, columns=[column]).column(column).to_pylist()}


def train_shared_tokenizer(corpus: Path, out: Path, vocab_size: int = 8192, sample_docs: int = 20000) -> float:
    """One tokenizer for both pipelines, so both tokenize with the same vocabulary."""
    from tasks.data.tokens import train_tokenizer

    started = time.perf_counter()
    paths = sorted(corpus.glob("*.jsonl"))
    texts = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for line, _ in zip(fh, range(sample_docs // len(paths) + 1)):
                texts.append(json.loads(line)["text"])
    out.write_text(train_tokenizer(texts, vocab_size, length=len(texts)).to_str())
    return time.perf_counter() - started


def prepared_corpora(work: Path, name: str, sizes: list[float]) -> tuple[dict[float, tuple[Path, dict]], Path]:
    """{size: (folder, stats)} of corpus `name` at each size, built under `work` the first time
    (its JSONL in folder/jsonl), and the tokenizer every run on it uses (trained on the largest)."""
    from benchmarks.data_prep_corpus import build_corpus, pool

    paragraphs = None
    corpora = {}
    for size in sizes:
        folder = work / f"{name}-{size:g}mb"
        if not (folder / "stats.json").exists():
            shutil.rmtree(folder, ignore_errors=True)
            paragraphs = paragraphs if paragraphs is not None else pool(name)
            folder.mkdir(parents=True, exist_ok=True)
            stats = build_corpus(folder / "jsonl", size, paragraphs=paragraphs)
            (folder / "stats.json").write_text(json.dumps(stats))
        corpora[size] = (folder, json.loads((folder / "stats.json").read_text()))
    tokenizer = work / f"{name}-tokenizer.json"
    if not tokenizer.exists():
        train_shared_tokenizer(corpora[max(sizes)][0] / "jsonl", tokenizer)
    return corpora, tokenizer


def bench_env() -> dict:
    """The environment of our runs: standalone (no tracking store), a local Ray of exactly the
    workers asked for, whose workers run at the driver's priority: Ray starts them 15 nice
    levels below it by default, which on a machine shared with other work is what decides
    their speed, not Ray (datatrove's workers get no such handicap)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0"}
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "RAY_ADDRESS"):
        env.pop(name, None)
    return env


def run_ours(corpus: Path, out: Path, cores: int, workers: int, tokenizer: Path,
             launcher: tuple[str, ...] = ("-m", "tasks.data.prep")) -> dict:
    """One whole run of `python -m tasks.data.prep` (or of `launcher`, which takes its arguments)."""
    shutil.rmtree(out, ignore_errors=True)
    config = out.parent / f"{out.name}.config.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    # engine auto, as a user runs it: 1 worker in-process, 2 this process and a pool of 1 (choose_engine);
    # the engine and why are recorded per run.
    config.write_text(json.dumps({"engine": "auto", "tokenizer_path": str(tokenizer),
                                  "seq_len": 1024, "vocab_size": 8192, "demo_sft_examples": 100}))
    env = bench_env()
    run = timed([*pinned(cores), sys.executable, *launcher, "--input", str(corpus / "*.jsonl"),
                 "--output", str(out), "--config", str(config), "--workers", str(workers)], env)
    stdout = run.pop("stdout")
    result = json.loads(stdout[stdout.index("\n{") + 1:] if not stdout.startswith("{") else stdout)
    run["stages"] = {k[len("seconds."):]: v for k, v in result["metrics"].items() if k.startswith("seconds.")}
    run["engine"] = result.get("engine")
    run["run_seconds"] = result["seconds"]  # the CLI's own clock: from its config read to its result
    return run


def run_datatrove(python: str, corpus: Path, out: Path, cores: int, workers: int, tokenizer: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    run = timed([*pinned(cores), python, str(REPO / "benchmarks" / "data_prep_datatrove.py"), "--corpus", str(corpus),
                 "--work", str(out), "--workers", str(workers), "--tokenizer", str(tokenizer)])
    report = json.loads(run.pop("stdout").strip().splitlines()[-1])
    run["stages"] = report["seconds"]
    return run


def agreement(corpus: Path, ours: Path, datatrove: Path) -> dict:
    """Keep/drop decisions of the two pipelines on the same documents, after the filters and at
    the end (after dedup)."""
    import pyarrow.parquet as pq

    all_ids = {json.loads(line)["id"] for path in corpus.glob("*.jsonl") for line in open(path, encoding="utf-8")}
    dropped = {}
    for path in sorted((ours / "dropped").glob("*.parquet")):
        table = pq.read_table(path, columns=["id", "step"])
        dropped.update(zip(table.column("id").to_pylist(), table.column("step").to_pylist()))
    ours_after_filters = all_ids - {i for i, step in dropped.items() if step != "dedup"}
    ours_kept, dt_kept, dt_filtered = ids_in(ours / "documents"), ids_in(datatrove / "documents"), \
        ids_in(datatrove / "filtered")
    return {"documents": len(all_ids),
            "after_filters": round(1 - len(ours_after_filters ^ dt_filtered) / len(all_ids), 4),
            "final": round(1 - len(ours_kept ^ dt_kept) / len(all_ids), 4),
            "kept_after_filters": {"ours": len(ours_after_filters), "datatrove": len(dt_filtered)},
            "kept_final": {"ours": len(ours_kept), "datatrove": len(dt_kept)},
            "kept_jaccard_final": round(len(ours_kept & dt_kept) / max(1, len(ours_kept | dt_kept)), 4)}


def fit(points: dict[float, float]) -> dict:
    """time = start_up + MB * s_per_mb by least squares over (MB, median seconds)."""
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"start_up_s": round(my - slope * mx, 2), "s_per_mb": round(slope, 4), "mb_per_s": round(1 / slope, 3)}


def versions(datatrove_python: str | None) -> dict:
    import numpy
    import pyarrow
    import ray
    import tokenizers

    out = {"python": platform.python_version(), "numpy": numpy.__version__, "pyarrow": pyarrow.__version__,
           "ray": ray.__version__, "tokenizers": tokenizers.__version__}
    if datatrove_python:
        # Every package of the peer's environment: only datatrove and spacy are pinned and the rest
        # moves between installs, so a figure against it is read with the versions it ran on.
        probe = subprocess.run([datatrove_python, "-c", "import importlib.metadata as m, json; print(json.dumps("
                                "{d.metadata['Name'].lower(): d.version for d in m.distributions()}))"],
                               capture_output=True, text=True, check=True)
        peer = dict(sorted(json.loads(probe.stdout).items()))
        out["datatrove"], out["spacy"] = peer.get("datatrove", "?"), peer.get("spacy", "?")
        out["datatrove_environment"] = peer
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Data prep throughput against datatrove.")
    parser.add_argument("--sizes", type=float, nargs="+", default=[4, 16, 48], help="Corpus sizes, MB of text.")
    parser.add_argument("--datatrove-max-mb", type=float, default=16,
                        help="datatrove runs only the sizes up to this (its runs take ~6 s/MB on one core).")
    parser.add_argument("--corpora", nargs="+", default=["stdlib", "packages"], choices=["stdlib", "packages"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=REPO / ".llmops" / "bench-data")
    parser.add_argument("--datatrove-python", required=True,
                        help="Python of a venv with datatrove[io,processing] and spacy (make bench-data makes it).")
    parser.add_argument("--out", type=Path, help="Write the results JSON here.")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    results: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                 "processor": platform.processor() or platform.machine()},
                     "versions": versions(args.datatrove_python), "sizes_mb": args.sizes, "rounds": args.rounds,
                     "corpora": {}}
    for name in args.corpora:
        corpora, tokenizer = prepared_corpora(args.work, name, args.sizes)

        sizes_of = {c[0]: [s for s in args.sizes if c[1] == "ours" or s <= args.datatrove_max_mb] for c in CONFIGS}
        common = f"{max(s for s in args.sizes if s <= args.datatrove_max_mb):g}"  # the largest both ran
        runs: dict[str, dict[float, list[dict]]] = {c[0]: {s: [] for s in sizes_of[c[0]]} for c in CONFIGS}
        for round_ in range(args.rounds):
            order = CONFIGS if round_ % 2 == 0 else CONFIGS[::-1]
            for size in args.sizes:
                folder, stats = corpora[size]
                for config, pipeline, cores, workers in order:
                    if pipeline == "datatrove" and size > args.datatrove_max_mb:
                        continue
                    out = args.work / "runs" / f"{name}-{size:g}-{config}"
                    run = run_ours(folder / "jsonl", out, cores, workers, tokenizer) if pipeline == "ours" else \
                        run_datatrove(args.datatrove_python, folder / "jsonl", out, cores, workers, tokenizer)
                    runs[config][size].append(run)
                    print(f"{name} {size:g} MB round {round_ + 1}: {config:<16} {run['seconds']:7.2f} s "
                          f"(cpu {run['cpu_seconds']:.1f} s, load {run['load_before']:.1f})")

        summary: dict = {"corpus": {f"{s:g}": corpora[s][1] for s in args.sizes}, "configs": {}}
        for config, pipeline, cores, workers in CONFIGS:
            per_size = {}
            for size in sizes_of[config]:
                times = [r["seconds"] for r in runs[config][size]]
                per_size[f"{size:g}"] = {
                    "median_s": round(statistics.median(times), 2), "min_s": round(min(times), 2),
                    "max_s": round(max(times), 2), "runs_s": [round(t, 2) for t in times],
                    "cpu_s": [round(r["cpu_seconds"], 2) for r in runs[config][size]],
                    "load": [round(r["load_before"], 2) for r in runs[config][size]],
                    "stages_last_run": runs[config][size][-1]["stages"]}
            model = fit({corpora[s][1]["text_mb"]: statistics.median(r["seconds"] for r in runs[config][s])
                         for s in sizes_of[config]})
            model["mb_per_s_per_core"] = round(model["mb_per_s"] / cores, 3)
            summary["configs"][config] = {"cores": cores, "workers": workers, "sizes": per_size, "model": model}
        c = summary["configs"]
        largest, common_size = common, float(common)
        summary["ratios"] = {
            "per_mb_1core": round(c["ours-1core"]["model"]["mb_per_s"] / c["datatrove-1core"]["model"]["mb_per_s"], 2),
            "per_mb_2core": round(c["ours-2core"]["model"]["mb_per_s"] / c["datatrove-2core"]["model"]["mb_per_s"], 2),
            f"whole_run_1core_{largest}mb": round(c["datatrove-1core"]["sizes"][largest]["median_s"]
                                                 / c["ours-1core"]["sizes"][largest]["median_s"], 2),
            f"whole_run_2core_{largest}mb": round(c["datatrove-2core"]["sizes"][largest]["median_s"]
                                                 / c["ours-2core"]["sizes"][largest]["median_s"], 2),
            # Each round's own ratio, ours and datatrove from the same round: the spread of the noise.
            f"whole_run_1core_{largest}mb_per_round": [
                round(d["seconds"] / o["seconds"], 2) for o, d in
                zip(runs["ours-1core"][common_size], runs["datatrove-1core"][common_size])],
            f"whole_run_2core_{largest}mb_per_round": [
                round(d["seconds"] / o["seconds"], 2) for o, d in
                zip(runs["ours-2core"][common_size], runs["datatrove-2core"][common_size])],
        }
        summary["scaling_1_to_2_cores"] = {
            pipeline: {"per_mb": round(c[f"{pipeline}-2core"]["model"]["mb_per_s"]
                                       / c[f"{pipeline}-1core"]["model"]["mb_per_s"] / 2, 3),
                       f"whole_run_{largest}mb": round(c[f"{pipeline}-1core"]["sizes"][largest]["median_s"]
                                                      / c[f"{pipeline}-2core"]["sizes"][largest]["median_s"] / 2, 3)}
            for pipeline in ("ours", "datatrove")}
        # The 1 -> 2 core speed-up of whole runs at every size both ran (goal for ours: >= 1.8x).
        summary["speedup_1_to_2_cores"] = {
            pipeline: {f"{size:g}mb": round(c[f"{pipeline}-1core"]["sizes"][f"{size:g}"]["median_s"]
                                            / c[f"{pipeline}-2core"]["sizes"][f"{size:g}"]["median_s"], 2)
                       for size in sizes_of[f"{pipeline}-2core"]}
            for pipeline in ("ours", "datatrove")}
        summary["engines"] = {config: sorted({r.get("engine") or "" for runs_ in runs[config].values()
                                              for r in runs_}) for config, pipeline, *_ in CONFIGS
                              if pipeline == "ours"}
        summary["agreement"] = {cores: agreement(corpora[common_size][0] / "jsonl",
                                                 args.work / "runs" / f"{name}-{largest}-ours-{cores}",
                                                 args.work / "runs" / f"{name}-{largest}-datatrove-{cores}")
                                for cores in ("1core", "2core")}
        results["corpora"][name] = summary

        print(f"\n{name}: {'config':<16} {'start-up s':>10} {'s/MB':>7} {'MB/s/core':>10}   median s per size")
        for config, entry in c.items():
            sizes = "  ".join(f"{s} MB {v['median_s']:.1f} [{v['min_s']:.1f}-{v['max_s']:.1f}]"
                              for s, v in entry["sizes"].items())
            print(f"{name}: {config:<16} {entry['model']['start_up_s']:>10} {entry['model']['s_per_mb']:>7} "
                  f"{entry['model']['mb_per_s_per_core']:>10}   {sizes}")
        print(f"{name}: per-MB throughput ratio, same cores: 1 core {summary['ratios']['per_mb_1core']}x, "
              f"2 cores {summary['ratios']['per_mb_2core']}x; whole runs at {largest} MB: "
              f"{summary['ratios'][f'whole_run_1core_{largest}mb']}x and "
              f"{summary['ratios'][f'whole_run_2core_{largest}mb']}x")
        print(f"{name}: 1 -> 2 cores, whole-run speed-up: {summary['speedup_1_to_2_cores']} "
              f"(engines {summary['engines']})")
        print(f"{name}: 1 -> 2 cores: {summary['scaling_1_to_2_cores']}")
        print(f"{name}: agreement {summary['agreement']}\n")

    results["load_average_end"] = os.getloadavg()
    results["machine"] = {**results["machine"], **machine()}  # commit, versions, load
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
