"""Where data prep's 1 -> 2 core speed-up goes: each part of a whole run measured, and the bound
the parts set.

    python benchmarks/data_prep_scaling.py [--corpora stdlib packages] [--sizes 16 48] [--rounds 3] \
        [--out benchmarks/results/data_prep_scaling.json]

On the corpora and tokenizers of benchmarks/data_prep_bench.py (built the first time), rounds
alternate a whole run of `python -m tasks.data.prep` on 1 core (1 worker: in-process) and on 2
(2 workers: this process and a pool of 1), pinned and at the priority data_prep_bench.py runs
them. Each run goes through a probe (this file, `--probe`) that starts the CLI in the same process
and records, without changing what the run does:
- each engine map (one per stage function): its wall time, the CPU it cost this process (all its
  threads) and the CPU it cost the pool's worker (from /proc);
- when the pool was asked for and when its worker was ready to take a job;
- the CPU of the forkserver the worker was forked from (it imports the shard code first).

From the 1-core runs (medians over the rounds):
- outside: the whole run less the CLI's own clock: interpreter, imports, arguments, exit;
- driver: the CLI's clock less the maps: the plan, dedup's clustering, the split, the tokenizer,
  the manifest, the gaps between stages; it runs in one process whatever the workers;
- maps: the map jobs, the only part a second process can take half of.
Then the bounds on the 2-core run: `ideal` = outside + driver + maps / 2 (the jobs halved exactly,
a second process for free); `with measured costs` = outside + driver + the 2-core runs' map CPU
(both processes) / 2 + the wait for the pool's worker / 2. What the 2-core run measures beyond the
second bound is the jobs' uneven end and time neither process spent on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) of a live process. (data_prep_bench._tree_cpu reads the same
    fields; the probe does not import it from there: that module's imports run git, which would
    be timed as part of the run.)"""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def probe(out: Path, argv: list[str]) -> None:
    """Run `python -m tasks.data.prep argv` in this process with its engine maps and pool timed;
    write what was measured to `out` when it ends. Only the stdlib and the engine (stdlib only)
    are imported before the CLI, so its own import time is measured as a user's run has it."""
    import multiprocessing.forkserver
    import runpy
    import threading

    import tasks.data.engine as engine

    started = time.perf_counter()
    record: dict = {"maps": [], "pool": {}}
    start_pool, map_local, map_pool, close_pool = (engine.ProcessEngine.start, engine.LocalEngine.map,
                                                   engine.ProcessEngine.map, engine.ProcessEngine.close)

    def start(self: engine.ProcessEngine) -> None:
        first = self._pool is None
        asked = time.perf_counter() - started
        start_pool(self)
        if first and self._starting is not None:
            record["pool"]["asked_s"] = round(asked, 3)

            def ready(thread: threading.Thread = self._starting) -> None:
                thread.join()
                record["pool"]["ready_s"] = round(time.perf_counter() - started, 3)
            threading.Thread(target=ready, daemon=True).start()

    def timed_map(original):  # noqa: ANN001, ANN202 - wraps LocalEngine.map / ProcessEngine.map
        def run(self, fn, jobs):  # noqa: ANN001, ANN202
            pool = getattr(self, "_pool", None)
            worker_pids = list(pool._processes or {}) if pool is not None else []
            worker_before = {pid: _cpu(pid) for pid in worker_pids}
            cpu, wall = time.process_time(), time.perf_counter()
            results = original(self, fn, jobs)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            worker_pids = list(pool._processes or {}) if pool is not None else []
            # A worker forked during the map (the pool comes up in the first one) started at 0 s.
            worker = sum(_cpu(pid) - worker_before.get(pid, 0.0) for pid in worker_pids)
            record["maps"].append({"fn": fn.__name__, "jobs": len(jobs), "wall_s": round(wall, 4),
                                   "this_process_cpu_s": round(cpu, 4), "worker_cpu_s": round(worker, 3)})
            return results
        return run

    def close(self: engine.ProcessEngine) -> None:
        if self._starting is not None:
            self._starting.join()
        if self._pool is not None:
            server = multiprocessing.forkserver._forkserver._forkserver_pid
            record["pool"]["forkserver_cpu_s"] = round(_cpu(server), 3) if server else None
        close_pool(self)

    engine.ProcessEngine.start = start
    engine.LocalEngine.map, engine.ProcessEngine.map = timed_map(map_local), timed_map(map_pool)
    engine.ProcessEngine.close = close
    sys.argv = ["python -m tasks.data.prep", *argv]
    try:
        runpy.run_module("tasks.data.prep", run_name="__main__", alter_sys=True)
    finally:
        out.write_text(json.dumps(record))


def parts(run: dict) -> dict:
    """One run's parts, in seconds."""
    maps = run["probe"]["maps"]
    map_wall = sum(m["wall_s"] for m in maps)
    out = {"whole": run["seconds"], "outside": run["seconds"] - run["run_seconds"],
           "driver": run["run_seconds"] - map_wall, "maps": map_wall,
           "map_cpu": sum(m["this_process_cpu_s"] + m["worker_cpu_s"] for m in maps)}
    pool = run["probe"]["pool"]
    if "ready_s" in pool:  # asked for when the engine opens, just before the first map
        out["pool_wait"] = pool["ready_s"] - pool["asked_s"]
        out["forkserver_cpu"] = pool.get("forkserver_cpu_s") or 0.0
    return out


def summarize(runs: dict[int, list[dict]]) -> dict:
    """Medians over the rounds of each part (`parts` of each run), the measured speed-up and the
    two bounds."""
    one, two = ({k: statistics.median(run["parts"][k] for run in runs[cores]) for k in runs[cores][0]["parts"]}
                for cores in (1, 2))
    serial = one["outside"] + one["driver"]
    ideal = serial + one["maps"] / 2
    costed = serial + two["map_cpu"] / 2 + two.get("pool_wait", 0.0) / 2
    r = lambda x: round(x, 3)  # noqa: E731
    return {"one_core_s": {k: r(v) for k, v in one.items()}, "two_cores_s": {k: r(v) for k, v in two.items()},
            "speedup": r(one["whole"] / two["whole"]),
            "bound_ideal": {"two_cores_s": r(ideal), "speedup": r(one["whole"] / ideal)},
            "bound_with_measured_costs": {"two_cores_s": r(costed), "speedup": r(one["whole"] / costed)},
            "map_cpu_two_over_one": r(two["map_cpu"] / one["map_cpu"]),
            "engines": sorted({run.get("engine") or "" for n in runs for run in runs[n]})}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--probe":  # inside a run: see probe()
        sys.path.insert(0, str(REPO))
        probe(Path(sys.argv[2]), sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description="Where data prep's 1 -> 2 core speed-up goes.")
    parser.add_argument("--corpora", nargs="+", default=["stdlib", "packages"], choices=["stdlib", "packages"])
    parser.add_argument("--sizes", type=float, nargs="+", default=[16, 48], help="Corpus sizes, MB of text.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=REPO / ".llmops" / "bench-data")
    parser.add_argument("--out", type=Path, help="Write the results JSON here.")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.path.insert(0, str(REPO))
    from benchmarks.data_prep_bench import prepared_corpora, run_ours
    from benchmarks.pretrain_common import write_result  # its import records the start: commit, load

    results: dict = {"what": __doc__.split("\n\n")[0], "rounds": args.rounds, "sizes_mb": args.sizes,
                     "corpora": {}}
    for name in args.corpora:
        corpora, tokenizer = prepared_corpora(args.work, name, args.sizes)
        results["corpora"][name] = {}
        for size in args.sizes:
            folder, _ = corpora[size]
            runs: dict[int, list[dict]] = {1: [], 2: []}
            for round_ in range(args.rounds):
                for cores in ((1, 2) if round_ % 2 == 0 else (2, 1)):
                    record = args.work / "runs" / f"scaling-{name}-{size:g}-{cores}.probe.json"
                    run = run_ours(folder / "jsonl", args.work / "runs" / f"scaling-{name}-{size:g}-{cores}",
                                   cores, cores, tokenizer,
                                   launcher=(str(Path(__file__).resolve()), "--probe", str(record)))
                    run["probe"] = json.loads(record.read_text())
                    p = run["parts"] = parts(run)
                    runs[cores].append(run)
                    print(f"{name} {size:g} MB round {round_ + 1}, {cores} core(s): whole {p['whole']:.2f} s "
                          f"(outside {p['outside']:.2f}, driver {p['driver']:.2f}, maps {p['maps']:.2f}; "
                          f"map CPU {p['map_cpu']:.2f}" + (f", pool wait {p['pool_wait']:.2f}" if "pool_wait" in p
                                                           else "") + ")")
            summary = summarize(runs)
            summary["runs"] = {cores: [{k: round(v, 3) for k, v in run["parts"].items()} for run in runs[cores]]
                               for cores in runs}
            results["corpora"][name][f"{size:g}"] = summary
            print(f"{name} {size:g} MB: speed-up {summary['speedup']}x; bounds: ideal "
                  f"{summary['bound_ideal']['speedup']}x, with measured costs "
                  f"{summary['bound_with_measured_costs']['speedup']}x; map CPU on 2 cores / on 1: "
                  f"{summary['map_cpu_two_over_one']}")
    if args.out:
        write_result(results, args.out)
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
