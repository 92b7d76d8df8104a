"""Data prep on one file: 2 workers against 1, and the same data set from both.

    python benchmarks/data_prep_one_file.py [--mb 48] [--rounds 3] [--corpus stdlib] \
        [--out benchmarks/results/data_prep_one_file.json]

The corpus of benchmarks/data_prep_bench.py at `--mb` (16 JSONL files; 48 MB of JSONL is 46 MB of
text), built the first time under .llmops/bench-data, is also written as one JSONL file (the
files one after another). In rounds whose order alternates (a burst of load on this shared machine
hits every configuration alike), whole runs of `python -m tasks.data.prep` with engine auto, as a
user runs it, the way data_prep_bench.py runs them:
- the one file, pinned with taskset to 1 core with 1 worker (in-process) and to 2 cores with 2
  workers (this process and a pool of 1);
- the one file as data prep read it before it cut files for the workers (one shard: UNSPLIT),
  the same two ways;
- the 16 files, the same two ways: the control, what the same bytes give as several files.
Each run's manifest gives its shards and its content_hash (the sha256 of every output file): the
one file's must be the same on 1 and 2 workers. The runs are at nice -15 and, with the kernel's
autogroup scheduling, at the session's autogroup nice -20 (favour_this_session). Reports the median whole-run time of each, the
1 -> 2 core speed-up (the goal: >= 1.7x on the one file), each round's own ratio, the CPU seconds
of each run's process tree, the load, the machine and the versions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.data_prep_bench import prepared_corpora, run_ours, versions  # noqa: E402
from benchmarks.pretrain_common import write_result  # noqa: E402 - its import takes the start load

CONFIGS = (("1core", 1, 1), ("2core", 2, 2))   # name, cores, workers
# The one file as data prep read it before it cut files for the workers (a file under split_bytes
# was one shard): the same CLI with planning.SPLITS_PER_FILE = 1, which makes every split the
# whole file up to split_bytes. Only the driver plans; the pool's workers import the module as is.
UNSPLIT = ("-c", "import runpy, tasks.data.planning as planning; planning.SPLITS_PER_FILE = 1; "
                 "runpy.run_module('tasks.data.prep', run_name='__main__', alter_sys=True)")
# The session's priority against other sessions' (favour_this_session): the most nice allows. At
# -15 a 2-core run still got 1.4 cores of 2 at load 13 (autogroup weights 29154 against 1024 per
# busy session).
AUTOGROUP_NICE = -20


def one_file(corpus: Path, out: Path) -> Path:
    """Every file of `corpus` (*.jsonl, in name order) as one JSONL file in folder `out`."""
    target = out / "all.jsonl"
    if not target.exists():
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / ".all.jsonl.tmp"
        with open(tmp, "wb") as fh:
            for path in sorted(corpus.glob("*.jsonl")):
                fh.write(path.read_bytes())
        os.replace(tmp, target)
    return out


def favour_this_session() -> int | None:
    """With the kernel's autogroup scheduling (on by default), a process's nice counts only
    against its own session: the runs' nice -15 (data_prep_bench.NICE) did not keep other
    sessions' work off their cores (a 1-core run took 127 s of wall time for 30 s of CPU at load
    10). The session's own autogroup nice does; set it when allowed (AUTOGROUP_NICE). Returns the
    nice set."""
    path = Path("/proc/self/autogroup")
    if os.geteuid() != 0 or not path.exists():
        return None
    path.write_text(str(AUTOGROUP_NICE))
    return AUTOGROUP_NICE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=48, help="Corpus size, MB of JSONL.")
    parser.add_argument("--corpus", default="stdlib", choices=["stdlib", "packages"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=REPO / ".llmops" / "bench-data")
    parser.add_argument("--out", type=Path, help="Write the results JSON here.")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    autogroup_nice = favour_this_session()
    corpora, tokenizer = prepared_corpora(args.work, args.corpus, [args.mb])
    folder, stats = corpora[args.mb]
    single = one_file(folder / "jsonl", folder / "one-file")
    inputs = {"one_file": single, "one_file_unsplit": single, "16_files": folder / "jsonl"}
    runs: dict[str, dict[str, list[dict]]] = {shape: {c[0]: [] for c in CONFIGS} for shape in inputs}
    for round_ in range(args.rounds):
        order = [(shape, *c) for shape in inputs for c in CONFIGS]
        for shape, config, cores, workers in (order if round_ % 2 == 0 else order[::-1]):
            out = args.work / "runs" / f"one-file-{args.corpus}-{args.mb:g}-{shape}-{config}"
            run = run_ours(inputs[shape], out, cores, workers, tokenizer,
                           **({"launcher": UNSPLIT} if shape == "one_file_unsplit" else {}))
            manifest = json.loads((out / "manifest.json").read_text())
            run.update(content_hash=manifest["content_hash"], shards=len(manifest["documents"]["files"]))
            runs[shape][config].append(run)
            print(f"round {round_ + 1}: {shape:<8} {config}  {run['seconds']:6.2f} s (cpu "
                  f"{run['cpu_seconds']:.1f} s, load {run['load_before']:.1f}, {run['shards']} shards, "
                  f"engine {run['engine']})")

    summary: dict = {}
    for shape in inputs:
        entry: dict = {}
        for config, cores, workers in CONFIGS:
            done = runs[shape][config]
            times = [r["seconds"] for r in done]
            entry[config] = {"cores": cores, "workers": workers, "median_s": round(statistics.median(times), 2),
                             "runs_s": [round(t, 2) for t in times],
                             "cpu_s": [round(r["cpu_seconds"], 2) for r in done],
                             # how much of its cores a run got: CPU seconds / (wall x cores)
                             "cpu_share": [round(r["cpu_seconds"] / r["seconds"] / cores, 2) for r in done],
                             "load": [round(r["load_before"], 2) for r in done],
                             "engines": sorted({r["engine"] or "" for r in done}),
                             "shards": sorted({r["shards"] for r in done}),
                             "content_hashes": sorted({r["content_hash"] for r in done}),
                             "stages_last_run": done[-1]["stages"]}
        entry["speedup_1_to_2_cores"] = round(entry["1core"]["median_s"] / entry["2core"]["median_s"], 2)
        entry["speedup_per_round"] = [round(a["seconds"] / b["seconds"], 2)
                                      for a, b in zip(runs[shape]["1core"], runs[shape]["2core"])]
        hashes = {h for config, *_ in CONFIGS for h in entry[config]["content_hashes"]}
        entry["same_output_on_1_and_2_workers"] = len(hashes) == 1
        summary[shape] = entry
        print(f"{shape}: 1 core {entry['1core']['median_s']} s, 2 cores {entry['2core']['median_s']} s: "
              f"{entry['speedup_1_to_2_cores']}x (rounds {entry['speedup_per_round']}); shards "
              f"{entry['2core']['shards']}; one content_hash on 1 and 2 workers: "
              f"{entry['same_output_on_1_and_2_workers']}")
    report = {"corpus": {"name": args.corpus, "size_mb": args.mb, **stats,
                         "one_file_bytes": (inputs["one_file"] / "all.jsonl").stat().st_size},
              "rounds": args.rounds, "versions": versions(None), "results": summary,
              "priority": {"nice": -15 if os.geteuid() == 0 else 0, "autogroup_nice": autogroup_nice},
              "goal": "one file: >= 1.7x from 1 worker on 1 core to 2 workers on 2, one content_hash"}
    if args.out:
        write_result(report, args.out)
        print(f"wrote {args.out}")
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
