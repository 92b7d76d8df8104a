"""Goodput under faults: in-job supervision against Airflow task retries, in the same run.

A CPU pretraining job of at least --minutes minutes is run twice on the same model, data and
fault schedule (one kill, one hang, one loss spike, at 25%, 50% and 75% of the steps), both
through the local backend as the DAG's JobOperator submits it:

  supervised   the default: the in-job supervisor restarts the killed or hung worker (a hot
               spare takes its place) and the spike is rolled back in place;
  airflow      supervision off (max_restarts=0, max_rollbacks=0, no spare): every fault fails
               the job; like Airflow's retry (the DAG's retry_delay is 5 s; JobOperator polls
               every 2 s) the job is submitted again and resumes from its newest checkpoint.
               The hang is still caught by the same watchdog, so both wait the same
               hang_timeout_s (Airflow alone would wait for the task's execution_timeout).

Prints goodput (productive step time / wall time, and without the configured hang wait), the
badput buckets and each fault's recovery seconds side by side; the last line is one JSON object.

    python benchmarks/pretrain_goodput.py [--minutes 10] [--work /tmp/llmops-bench-goodput]
"""

from __future__ import annotations

import argparse
import math
import shutil
import time
from pathlib import Path

from pretrain_common import (bare_loop, isolate, last_json_line, prepared_data, run_job,
                             train_config)

from tasks.common.io import read_json
from tasks.train import telemetry as tm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/llmops-bench-goodput"))
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument("--retry-delay", type=float, default=5.0, help="Airflow's retry_delay")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    isolate(args.work)
    data = prepared_data(args.work)

    # size the run from the measured step time, so it lasts --minutes here and now
    probe = bare_loop(data, train_config(data, args.work / "probe"), steps=120)
    steps = math.ceil(args.minutes * 60 / probe["s_per_step"])
    # a checkpoint every ~1.5 s of training: an async save blocks for milliseconds, and the
    # progress a fault loses is on average half an interval
    every = max(10, round(1.5 / probe["s_per_step"]))
    faults = f"kill@{steps // 4},hang@{steps // 2},spike@{3 * steps // 4}"
    print(f"{probe['s_per_step'] * 1000:.1f} ms/step -> {steps} steps, a checkpoint every "
          f"{every} steps; faults {faults}; hang_timeout_s {args.hang_timeout}", flush=True)
    common = dict(max_steps=steps, checkpoint_interval=every, keep_checkpoints=3,
                  eval_interval=steps, log_interval=100, hang_timeout_s=args.hang_timeout,
                  spike_window=100, spike_sigma=6.0)

    runs = {}
    for name, knobs, retries in (
            ("supervised", dict(max_restarts=3, max_rollbacks=3, hot_spare=True), 0),
            ("airflow", dict(max_restarts=0, max_rollbacks=0, hot_spare=False), 10)):
        out = args.work / name
        shutil.rmtree(out, ignore_errors=True)
        cfg = train_config(data, out, **common, **knobs)
        print(f"{name}: running ...", flush=True)
        t0 = time.time()
        job = run_job(cfg, f"bench-{name}-{int(t0)}", faults=faults, retries=retries,
                      retry_delay_s=args.retry_delay)
        report = read_json(tm.run_dir(out) / "goodput.json")
        runs[name] = {"report": report, "tries": job["tries"], "job_wall_s": job["wall_s"],
                      "val_loss": job["result"]["metrics"]["val_loss"],
                      "restarts": job["result"]["metrics"].get("restarts")}
        print(f"{name}: done in {job['wall_s']:.0f}s, {job['tries']} tries, goodput "
              f"{report['goodput']:.2%}", flush=True)

    sup, base = runs["supervised"]["report"], runs["airflow"]["report"]
    print()
    print(f"{'':34}{'supervised':>14}{'airflow retry':>16}")
    rows = [("wall time to end of training (s)", sup["wall_s"], base["wall_s"], "{:.1f}"),
            ("goodput", sup["goodput"], base["goodput"], "{:.2%}"),
            ("goodput without the hang wait", sup["goodput_excluding_hang_wait"],
             base["goodput_excluding_hang_wait"], "{:.2%}"),
            ("job submissions", runs["supervised"]["tries"], runs["airflow"]["tries"], "{}")]
    rows += [(f"  {k} (s)", sup["buckets"][k], base["buckets"][k], "{:.1f}") for k in sup["buckets"]]
    for label, a, b, fmt in rows:
        print(f"{label:34}{fmt.format(a):>14}{fmt.format(b):>16}")
    print("\nper fault: recovery_s = fault (for the hang: the watchdog's kill) -> training resumed;"
          " lost_s = recomputing the steps since the checkpoint")
    by_fault = {}
    for f_sup, f_base in zip(sup["faults"], base["faults"]):
        by_fault[f_sup["fault"]] = {"supervised": f_sup, "airflow": f_base}
        print(f"  {f_sup['fault']:14} recovery {f_sup.get('recovery_s')!s:>7}s vs "
              f"{f_base.get('recovery_s')!s:>7}s | lost {f_sup.get('lost_s')!s:>6}s vs "
              f"{f_base.get('lost_s')!s:>6}s | detected by {f_sup.get('detected_by')} "
              f"in {f_sup.get('detect_s')}s")
    last_json_line({
        "benchmark": "pretrain_goodput", "minutes": args.minutes, "steps": steps,
        "ms_per_step": round(probe["s_per_step"] * 1000, 2), "faults": faults,
        "hang_timeout_s": args.hang_timeout, "retry_delay_s": args.retry_delay,
        "supervised": {"goodput": sup["goodput"],
                       "goodput_excluding_hang_wait": sup["goodput_excluding_hang_wait"],
                       "wall_s": sup["wall_s"], "buckets": sup["buckets"],
                       "tries": runs["supervised"]["tries"]},
        "airflow_retry": {"goodput": base["goodput"],
                          "goodput_excluding_hang_wait": base["goodput_excluding_hang_wait"],
                          "wall_s": base["wall_s"], "buckets": base["buckets"],
                          "tries": runs["airflow"]["tries"]},
        "recovery_s": {k: {"supervised": v["supervised"].get("recovery_s"),
                           "airflow_retry": v["airflow"].get("recovery_s")}
                       for k, v in by_fault.items()},
        "lost_s": {k: {"supervised": v["supervised"].get("lost_s"),
                       "airflow_retry": v["airflow"].get("lost_s")} for k, v in by_fault.items()},
    })


if __name__ == "__main__":
    main()
