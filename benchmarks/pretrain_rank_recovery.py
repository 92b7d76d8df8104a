"""Time to recover from a killed rank: 2 CPU processes (torchrun, gloo), rank 1 SIGKILLed mid-run.

For each parallelism and repetition one supervised pretraining job runs under torchrun, as the
local backend launches it, with `--faults kill@K:1`:

  ddp    only rank 1's worker is restarted; rank 0's survives, leaves the broken group and
         rejoins the next round in place (tasks/train/distributed.py)
  fsdp   shards cannot re-form in place: both workers restart and resume from the checkpoint

Time to recover = from the kill (rank 1's fault_injected event, written just before it kills
itself) to the end of the first optimizer step rank 0 starts after it (steps.rank0.jsonl; a step
needs both ranks). Also split into: kill -> rank 0 hears of it (peer_failure, DDP) or its worker has
exited (FSDP) -> both ranks in the new round (joined) -> restored (resume). Work lost to the rollback to the last checkpoint is not in
the figure: it is the steps replayed after it.

Prints one line per run and a summary; the last line is one JSON object, also written to
benchmarks/results/pretrain_rank_recovery.json (machine, torch, load, settings, every value).

    python benchmarks/pretrain_rank_recovery.py [--reps 3] [--parallelism ddp fsdp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pretrain_common import RESULTS, ROOT, isolate, last_json_line, prepared_data, train_config

from tasks.configs import to_dict
from tasks.train import telemetry as tm



def run_once(data: Path, work: Path, parallelism: str, settings: dict[str, Any]) -> dict[str, Any]:
    out = work / parallelism
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = train_config(data, out / "job", parallelism=parallelism, **settings["config"])
    config = out / "config.json"
    config.write_text(json.dumps(to_dict(cfg)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tasks.pretrain", "--config", str(config), "--result", str(out / "result.json"),
           "--faults", settings["faults"]]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{parallelism} job failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    run_dir = tm.run_dir(cfg.output_dir)
    events = tm.read_events(run_dir)
    [kill] = [e for e in events if e["kind"] == "fault_injected" and e["rank"] == 1]
    t_kill = kill["t"]
    # a step that started after the kill: rank 0 may still be finishing the step before it
    after = sorted(s["t1"] for s in tm.read_steps(run_dir) if s["t0"] > t_kill)

    def first(kind: str, **match: Any) -> float | None:
        times = [e["t"] for e in events if e["kind"] == kind and e["t"] > t_kill
                 and all(e.get(k) == v for k, v in match.items())]
        return round(min(times) - t_kill, 3) if times else None

    joined = [e["t"] for e in events if e["kind"] == "joined" and e["t"] > t_kill]
    return {
        "parallelism": parallelism, "wall_s": round(wall, 2), "killed_at_step": kill["step"],
        "recover_s": round(after[0] - t_kill, 3),
        "survivor_heard_s": first("peer_failure", rank=0),  # DDP: it rejoins in place
        "survivor_exited_s": first("worker_exit", rank=0, code=1),  # FSDP: it restarts
        "replacement_spawned_s": first("spawn", rank=1),
        "both_joined_s": round(max(joined) - t_kill, 3) if len(joined) >= 2 else None,
        "restored_s": first("resume", rank=0),
        "rank0_workers": len({e["pid"] for e in events
                              if e["rank"] == 0 and e["source"] == "worker"}),
        "restarts": sum(e["kind"] == "restart" for e in events),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--parallelism", nargs="+", default=["ddp", "fsdp"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/llmops-bench-rank-recovery"))
    parser.add_argument("--out", type=Path, default=RESULTS / "pretrain_rank_recovery.json")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    isolate(args.work)
    data = prepared_data(args.work)
    settings = {
        "nproc": 2, "backend": "gloo", "faults": "kill@25:1",
        "config": dict(max_steps=40, batch_size=4, checkpoint_interval=10, eval_interval=40,
                       log_interval=10, hot_spare=False, hang_timeout_s=60.0, max_restarts=2),
    }
    load_before = os.getloadavg()
    runs = []
    for parallelism in args.parallelism:
        for rep in range(args.reps):
            run = run_once(data, args.work, parallelism, settings)
            run["rep"], run["loadavg_1m"] = rep + 1, round(os.getloadavg()[0], 2)
            runs.append(run)
            print(f"{parallelism} #{rep + 1}: recovered in {run['recover_s']:.2f}s (heard "
                  f"{run['survivor_heard_s']}s, exited {run['survivor_exited_s']}s, joined "
                  f"{run['both_joined_s']}s, restored "
                  f"{run['restored_s']}s), {run['rank0_workers']} rank-0 worker(s), "
                  f"load {run['loadavg_1m']}", flush=True)
    summary = {}
    for parallelism in args.parallelism:
        values = [r["recover_s"] for r in runs if r["parallelism"] == parallelism]
        summary[parallelism] = {"recover_s_median": round(statistics.median(values), 3),
                                "recover_s_min": min(values), "recover_s_max": max(values)}
        print(f"{parallelism}: time to recover median {summary[parallelism]['recover_s_median']:.2f}s"
              f" (min {min(values):.2f}, max {max(values):.2f}) over {len(values)} runs")
    last_json_line({"benchmark": "pretrain_rank_recovery", "settings": settings,
                    "load_avg_1_5_15_at_start": [round(x, 2) for x in load_before],
                    "summary": summary, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
