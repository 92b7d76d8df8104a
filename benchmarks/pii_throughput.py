"""Data-prep throughput with the PII step of a baseline revision against the working tree's.

    python benchmarks/pii_throughput.py --baseline-pii REV [--mb 10] [--rounds 4]

Both sides are snapshots of this tree's `tasks/` taken at start, identical but for
`tasks/data/pii.py` (the baseline's comes from `git show REV:tasks/data/pii.py`), so nothing else
that changes meanwhile (other work in the tree) enters the comparison. On the benchmark corpus
(benchmarks/data_prep_corpus.py, with its planted contact details and number tables) it runs the
whole pipeline (`python -m tasks.data.prep`, engine local, pinned to one core) alternately,
alternating which goes first, `--rounds` times, and times the PII step alone in-process over
every document too (junk included, which the pipeline drops before PII). Throughput is documents
per CPU second of the run (user + system): on a shared machine wall-clock time mostly measures the
neighbours; it is recorded too, with the load before each run. The last line is one JSON object
(what benchmarks/results/pii_throughput.json holds).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.pretrain_common import machine  # noqa: E402 - at start: the load then
from benchmarks.data_prep_bench import pinned, train_shared_tokenizer  # noqa: E402


def snapshot(work: Path, name: str, pii_source: str | None) -> Path:
    """A copy of this tree's tasks/ under work/name, with pii.py replaced by `pii_source`."""
    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(REPO / "tasks", root / "tasks", ignore=shutil.ignore_patterns("__pycache__"))
    if pii_source is not None:
        (root / "tasks" / "data" / "pii.py").write_text(pii_source)
    return root


def prep_run(tree: Path, corpus: Path, work: Path, tokenizer: Path) -> dict:
    out = work / f"out-{tree.name}"
    shutil.rmtree(out, ignore_errors=True)
    config = work / "prep.config.json"
    config.write_text(json.dumps({"engine": "local", "tokenizer_path": str(tokenizer), "seq_len": 1024,
                                  "vocab_size": 8192, "demo_sft_examples": 100}))
    load, cpu_before, started = os.getloadavg()[0], _children_cpu(), time.perf_counter()
    stdout = _run_in(tree, [*pinned(1), sys.executable, "-m", "tasks.data.prep",
                            "--input", str(corpus / "*.jsonl"), "--output", str(out),
                            "--config", str(config), "--workers", "1"])
    seconds = time.perf_counter() - started
    manifest = json.loads((out / "manifest.json").read_text())
    return {"seconds": round(seconds, 2), "cpu_seconds": round(_children_cpu() - cpu_before, 2),
            "load_1min_before": round(load, 2),
            "redacted": {k: v for k, v in manifest["steps"]["pii"].items() if k.startswith("redacted.")},
            "kept_documents": manifest["counts"]["kept_documents"]}


PII_ONLY = """
import json, sys, time
from pathlib import Path
import tasks.data.pii
assert tasks.data.pii.__file__.startswith(sys.argv[2]), tasks.data.pii.__file__
from tasks.data.pii import RedactPII
from tasks.data.steps import Doc
texts = [json.loads(l)["text"] for p in sorted(Path(sys.argv[1]).glob("*.jsonl")) for l in open(p)]
step = RedactPII()
started = time.process_time()
for i, t in enumerate(texts):
    step(Doc(str(i), t))
print(json.dumps({"cpu_seconds": time.process_time() - started, "documents": len(texts)}))
"""


def _run_in(tree: Path, cmd: list[str]) -> str:
    """Run `cmd` with `tree` as its working directory and only import root: `python -m` and
    `-c` put the working directory first on sys.path, so running from this repo would import its
    tasks/ on both sides."""
    env = {**os.environ, "PYTHONPATH": str(tree), "RAY_AUTH_MODE": "disabled"}
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "RAY_ADDRESS"):
        env.pop(name, None)  # standalone: no tracking store, no cluster
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def _children_cpu() -> float:
    """CPU seconds (user + system) of the finished children: on a shared machine a run's own
    work, where wall-clock time also counts the other processes queued on its core."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def pii_only_run(tree: Path, corpus: Path) -> float:
    stdout = _run_in(tree, [*pinned(1), sys.executable, "-c", PII_ONLY, str(corpus), str(tree)])
    return round(json.loads(stdout.strip().splitlines()[-1])["cpu_seconds"], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description="Data prep throughput: baseline PII step vs this tree's.")
    parser.add_argument("--baseline-pii", required=True, help="git revision whose tasks/data/pii.py is the baseline")
    parser.add_argument("--mb", type=float, default=10, help="corpus size in MB of text")
    parser.add_argument("--rounds", type=int, default=4, help="alternating baseline/candidate rounds")
    parser.add_argument("--work", type=Path, default=REPO / ".llmops" / "bench-pii")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)

    from benchmarks.data_prep_corpus import build_corpus

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"corpus-{args.mb:g}mb"
    if not (corpus / "stats.json").exists():
        shutil.rmtree(corpus, ignore_errors=True)
        (corpus / "stats.json").parent.mkdir(parents=True, exist_ok=True)
        stats = build_corpus(corpus / "jsonl", args.mb)
        (corpus / "stats.json").write_text(json.dumps(stats))
    stats = json.loads((corpus / "stats.json").read_text())
    tokenizer = work / "tokenizer.json"
    if not tokenizer.exists():
        train_shared_tokenizer(corpus / "jsonl", tokenizer, vocab_size=8192, sample_docs=5000)
    baseline_source = subprocess.run(["git", "show", f"{args.baseline_pii}:tasks/data/pii.py"], cwd=REPO,
                                     check=True, capture_output=True, text=True).stdout
    trees = {"baseline": snapshot(work, "baseline", baseline_source),
             "candidate": snapshot(work, "candidate", None)}
    print(f"corpus: {stats['documents']} documents, {stats['text_mb']} MB; baseline pii.py from "
          f"{args.baseline_pii}; {args.rounds} alternating rounds, 1 core each")

    runs: dict[str, list[dict]] = {"baseline": [], "candidate": []}
    pii_only: dict[str, list[float]] = {"baseline": [], "candidate": []}
    for round_ in range(args.rounds):
        # Alternate which side goes first so a drift in the machine's load hits both alike.
        order = ("baseline", "candidate") if round_ % 2 == 0 else ("candidate", "baseline")
        for side in order:
            run = prep_run(trees[side], corpus / "jsonl", work, tokenizer)
            run["round"] = round_
            runs[side].append(run)
            pii_only[side].append(pii_only_run(trees[side], corpus / "jsonl"))
            print(f"round {round_} {side:<9} prep {run['cpu_seconds']:7.2f} CPU s ({run['seconds']:.2f}s "
                  f"wall)  pii step alone {pii_only[side][-1]:6.2f} CPU s  load {run['load_1min_before']}  "
                  f"redacted {run['redacted']}")

    def summary(side: str) -> dict:
        cpu = [r["cpu_seconds"] for r in runs[side]]
        wall = [r["seconds"] for r in runs[side]]
        return {"prep_cpu_seconds": cpu, "prep_cpu_median_s": statistics.median(cpu),
                "prep_cpu_spread_s": round(max(cpu) - min(cpu), 2),
                "prep_wall_seconds": wall, "prep_wall_median_s": statistics.median(wall),
                "docs_per_cpu_s_median": round(stats["documents"] / statistics.median(cpu), 1),
                "pii_step_alone_s": pii_only[side], "pii_step_alone_median_s": statistics.median(pii_only[side]),
                "redacted": runs[side][-1]["redacted"]}

    result = {
        "what": "python -m tasks.data.prep (engine local, 1 core, taskset) on the benchmark corpus, "
                "baseline pii.py vs this tree's, alternating rounds, CPU and wall seconds; plus the "
                "PII step alone in-process (CPU seconds, every document)",
        "machine": machine(),  # platform, commit, versions, load at start and end
        "versions": {"phonenumbers": _version("phonenumbers")},
        "baseline_pii_revision": args.baseline_pii,
        "corpus": {"documents": stats["documents"], "text_mb": stats["text_mb"]},
        "baseline": summary("baseline"), "candidate": summary("candidate"),
        "runs": runs,
    }
    # Throughput per CPU second: the wall-clock ratio is reported too, but on a shared core it
    # mostly measures the neighbours.
    result["throughput_ratio_candidate_to_baseline"] = round(
        result["baseline"]["prep_cpu_median_s"] / result["candidate"]["prep_cpu_median_s"], 3)
    result["throughput_ratio_wall_clock"] = round(
        result["baseline"]["prep_wall_median_s"] / result["candidate"]["prep_wall_median_s"], 3)
    print(f"prep median CPU: baseline {result['baseline']['prep_cpu_median_s']}s, candidate "
          f"{result['candidate']['prep_cpu_median_s']}s -> throughput ratio "
          f"{result['throughput_ratio_candidate_to_baseline']} (wall clock "
          f"{result['throughput_ratio_wall_clock']})")
    print(json.dumps(result, sort_keys=True))


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()
