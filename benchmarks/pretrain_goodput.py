"""Goodput under faults: in-job supervision against Airflow task retries, in the same run.

A CPU pretraining job of at least --minutes minutes is run twice on the same model, data and
fault schedule (one kill, one hang, one loss spike, at 25%, 50% and 75% of the steps):

  supervised   the default, through the local backend as the DAG's JobOperator submits it: the
               in-job supervisor restarts the killed or hung worker (a hot spare takes its
               place) and the spike is rolled back in place;
  airflow      supervision off (max_restarts=0, max_rollbacks=0, no spare), run by a real
               Airflow deployment (scheduler, dag-processor, API server, triggerer:
               tests/chaos/airflow_deployment.py) as one JobOperator task of
               benchmarks/dags/goodput_baseline.py with retries: every fault fails the job and
               the try; the scheduler retries the task after `retry_delay` (Airflow's default,
               `[core] default_task_retry_delay` = 300 s, or --retry-delay), and the new try
               resubmits the job, which resumes from its newest checkpoint. The hang is still
               caught by the same watchdog, so both wait the same hang_timeout_s (Airflow alone
               would wait for the task's execution_timeout).

Prints goodput (productive step time / wall time, and without the configured hang wait), the
badput buckets, each fault's recovery seconds side by side, and the scheduler's own latency per
retry (next try's start - failed try's end - retry_delay); the last line is one JSON object,
also written to --out.

    python benchmarks/pretrain_goodput.py [--minutes 10] [--retry-delay 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from pretrain_common import (RESULTS, ROOT, bare_loop, isolate, last_json_line, prepared_data,
                             run_job, train_config)

from tasks.common.io import read_json
from tasks.configs import to_dict
from tasks.train import telemetry as tm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/llmops-bench-goodput"))
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument("--retry-delay", type=float, default=None,
                        help="the baseline task's retry_delay in seconds (default: Airflow's "
                             "[core] default_task_retry_delay, 300)")
    parser.add_argument("--out", type=Path, default=RESULTS / "pretrain_goodput.json")
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
    out = args.work / "supervised"
    shutil.rmtree(out, ignore_errors=True)
    cfg = train_config(data, out, **common, max_restarts=3, max_rollbacks=3, hot_spare=True)
    print("supervised: running ...", flush=True)
    t0 = time.time()
    job = run_job(cfg, f"bench-supervised-{int(t0)}", faults=faults)
    runs["supervised"] = {"report": read_json(tm.run_dir(out) / "goodput.json"), "tries": 1,
                          "job_wall_s": job["wall_s"],
                          "val_loss": job["result"]["metrics"]["val_loss"],
                          "restarts": job["result"]["metrics"].get("restarts")}
    print(f"supervised: done in {job['wall_s']:.0f}s, goodput "
          f"{runs['supervised']['report']['goodput']:.2%}", flush=True)
    out = args.work / "airflow"
    shutil.rmtree(out, ignore_errors=True)
    cfg = train_config(data, out, **common, max_restarts=0, max_rollbacks=0, hot_spare=False)
    print("airflow: running the job as a task of a real Airflow deployment ...", flush=True)
    runs["airflow"] = airflow_baseline(args.work, to_dict(cfg), faults, args.retry_delay)
    runs["airflow"]["report"] = read_json(tm.run_dir(out) / "goodput.json")
    print(f"airflow: done in {runs['airflow']['job_wall_s']:.0f}s, {runs['airflow']['tries']} "
          f"tries, goodput {runs['airflow']['report']['goodput']:.2%}", flush=True)

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
    result = {
        "benchmark": "pretrain_goodput", "minutes": args.minutes, "steps": steps,
        "ms_per_step": round(probe["s_per_step"] * 1000, 2), "faults": faults,
        "hang_timeout_s": args.hang_timeout, "retry_delay_s": runs["airflow"]["retry_delay_s"],
        "scheduler_latency_s": runs["airflow"]["scheduler_latency_s"],
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
    }
    last_json_line(result, args.out)


def airflow_baseline(work: Path, config: dict[str, Any], faults: str,
                     retry_delay: float | None) -> dict[str, Any]:
    """The unsupervised job as a task of a real Airflow deployment, retried by its scheduler."""
    sys.path.insert(0, str(ROOT))
    from tests.chaos.airflow_deployment import AirflowDeployment, _epoch

    env = {"LLMOPS_HOME": os.environ["LLMOPS_HOME"],
           "MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"], "OMP_NUM_THREADS": "1"}
    if retry_delay is not None:
        env["LLMOPS_BENCH_RETRY_DELAY"] = str(retry_delay)
    airflow_dir = work / "airflow-deployment"
    shutil.rmtree(airflow_dir, ignore_errors=True)
    with AirflowDeployment(airflow_dir, dags_folder=ROOT / "benchmarks" / "dags", env=env) as dep:
        dep.wait_dag("bench_goodput_baseline")
        delay = _default_retry_delay(retry_delay)
        t0 = time.time()
        run_id = dep.trigger("bench_goodput_baseline", {"config": config, "faults": faults})
        state = dep.wait_run("bench_goodput_baseline", run_id, timeout=6 * 3600)
        wall = time.time() - t0
        tries = sorted(dep.tries("bench_goodput_baseline", run_id, "pretrain"),
                       key=lambda t: t["try_number"])
    if state != "success":
        raise RuntimeError(f"the baseline DAG run ended {state}; see {airflow_dir}")
    latency = [round(_epoch(b["start_date"]) - _epoch(a["end_date"]) - delay, 2)
               for a, b in zip(tries, tries[1:])]
    print(f"  {len(tries)} tries, retry_delay {delay:.0f}s, scheduler latency per retry {latency}s",
          flush=True)
    return {"tries": len(tries), "job_wall_s": wall, "retry_delay_s": delay,
            "scheduler_latency_s": latency}


def _default_retry_delay(retry_delay: float | None) -> float:
    if retry_delay is not None:
        return float(retry_delay)
    from airflow.configuration import conf

    return conf.getfloat("core", "default_task_retry_delay")

if __name__ == "__main__":
    main()
