"""Goodput under faults: in-job supervision against the plain job retried by Airflow or by
TorchElastic, all at once.

A CPU pretraining job of about --minutes minutes is run on the same model, data and fault
schedule (one kill, one hang, one loss spike, at 25%, 50% and 75% of the steps) by every side,
all at the same time (so they share whatever load the machine has: the load is sampled through
the run and recorded):

  supervised     ours, through the local backend as the DAG's JobOperator submits it: the in-job
                 supervisor restarts the killed or hung worker (a hot spare takes its place) and
                 the spike guard skips the spiking batch in place;
  airflow_retry<D>  the plain job a user would otherwise run (no supervisor, no hot spare, no
                 spike guard) as one JobOperator task of a real Airflow deployment
                 (tests/chaos/airflow_deployment.py, benchmarks/dags/goodput_baseline.py) with
                 retries every D seconds (--retry-delays, default 0, 30 and 300, Airflow's own
                 default): the kill fails the job and the try, the next try resubmits it and it
                 resumes from its newest checkpoint. Nothing catches the spike: the update is
                 applied (gradient clipping bounds it) and the job trains on, so it costs the
                 baseline whatever it costs in loss, reported at the end. The hang is caught by
                 the same watchdog on every side (the job's hang_timeout_s; Airflow alone would
                 wait for the task's execution_timeout), so goodput is also given without it.
  torchelastic   the same plain job launched as `torchrun --standalone --nproc_per_node=1
                 --max-restarts=N` (TorchElastic, torchrun's own defaults otherwise): torchrun
                 restarts the failed process in place, at once, and it resumes from its newest
                 checkpoint. The spike is not caught either.

Prints goodput (productive step time / wall time, and without the configured hang wait), the
badput buckets, each fault's recovery seconds side by side, the final validation loss, and the
scheduler's own latency per retry (next try's start - failed try's end - retry_delay); the last
line is one JSON object, also written to --out.

    python benchmarks/pretrain_goodput.py [--minutes 10] [--retry-delays 0,30,300] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from pretrain_common import (RESULTS, ROOT, bare_loop, isolate, last_json_line, prepared_data,
                             run_job, train_config)

from tasks.common.io import read_json, write_json
from tasks.configs import to_dict
from tasks.train import telemetry as tm
from tasks.train.telemetry import read_events

DAG_PREFIX = "bench_goodput_baseline_retry"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/llmops-bench-goodput"))
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument("--retry-delays", default="0,30,300",
                        help="the baselines' retry_delay in seconds, comma-separated")
    parser.add_argument("--out", type=Path, default=RESULTS / "pretrain_goodput.json")
    args = parser.parse_args()
    delays = [float(x) for x in args.retry_delays.split(",")]
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
                  spike_window=100)
    sides = {"supervised": train_config(data, args.work / "supervised", **common, spike_sigma=6.0,
                                        max_restarts=3, max_rollbacks=3, hot_spare=True)}
    plain = dict(common, spike_sigma=0.0, max_restarts=0, max_rollbacks=0, hot_spare=False)
    for delay in delays:  # the plain job: no supervisor restarts, no spare, no spike guard
        sides[f"airflow_retry{delay:g}"] = train_config(data, args.work / f"airflow_retry{delay:g}",
                                                        **plain)
    sides["torchelastic"] = train_config(data, args.work / "torchelastic", **plain)
    for cfg in sides.values():
        shutil.rmtree(cfg.output_dir, ignore_errors=True)

    load = LoadSampler()
    runs: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def supervised() -> dict[str, Any]:
        job = run_job(sides["supervised"], f"bench-supervised-{int(time.time())}", faults=faults)
        return {"tries": 1, "val_loss": job["result"]["metrics"]["val_loss"],
                "restarts": job["result"]["metrics"].get("restarts")}

    def side(name: str, run: Callable[[], dict[str, Any]]) -> threading.Thread:
        def target() -> None:
            try:
                runs[name] = run()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the baselines
                errors.append(exc)
        return threading.Thread(target=target, name=name)

    # ours and torchrun start once the baselines' DAG runs are triggered (the deployment takes a
    # minute to come up), so that all sides train through the same minutes
    threads = [side("supervised", supervised),
               side("torchelastic", lambda: torchelastic(sides["torchelastic"], args.work, faults))]
    runs.update(airflow_baselines(args.work, {k: to_dict(v) for k, v in sides.items()
                                              if k.startswith("airflow_")}, faults, delays,
                                  triggered=lambda: [t.start() for t in threads]))
    for thread in threads:
        thread.join()
    load.stop()
    if errors:
        raise errors[0]
    for name, cfg in sides.items():
        runs[name]["report"] = read_json(tm.run_dir(cfg.output_dir) / "goodput.json")

    names = list(sides)
    reports = {n: runs[n]["report"] for n in names}
    print()
    print(f"{'':34}" + "".join(f"{n:>20}" for n in names))
    rows = [("wall time to end of training (s)", "wall_s", "{:.1f}"),
            ("goodput", "goodput", "{:.2%}"),
            ("goodput without the hang wait", "goodput_excluding_hang_wait", "{:.2%}")]
    for label, key, fmt in rows:
        print(f"{label:34}" + "".join(f"{fmt.format(reports[n][key]):>20}" for n in names))
    print(f"{'job submissions':34}" + "".join(f"{runs[n]['tries']:>20}" for n in names))
    print(f"{'final val_loss':34}" + "".join(f"{runs[n]['val_loss']:>20.4f}" for n in names))
    for bucket in reports["supervised"]["buckets"]:
        print(f"{'  ' + bucket + ' (s)':34}"
              + "".join(f"{reports[n]['buckets'][bucket]:>20.1f}" for n in names))
    by_fault: dict[str, dict[str, Any]] = {}
    for n in names:
        for f in reports[n]["faults"]:
            by_fault.setdefault(f["fault"], {})[n] = f
    print("\nper fault: recovery_s = fault (for the hang: the watchdog's kill) -> training resumed;"
          " lost_s = recomputing the steps since the checkpoint (none: nothing was recovered)")
    for fault, per in by_fault.items():
        print(f"  {fault:14}" + " | ".join(
            f"{n} {per.get(n, {}).get('recovery_s')}s/{per.get(n, {}).get('lost_s')}s" for n in names))
    result = {
        "benchmark": "pretrain_goodput", "minutes": args.minutes, "steps": steps,
        "ms_per_step": round(probe["s_per_step"] * 1000, 2), "faults": faults,
        "hang_timeout_s": args.hang_timeout, "concurrent": True,
        "load_avg_1m_during": load.summary(),
        "sides": {n: {"goodput": reports[n]["goodput"],
                      "goodput_excluding_hang_wait": reports[n]["goodput_excluding_hang_wait"],
                      "wall_s": reports[n]["wall_s"], "buckets": reports[n]["buckets"],
                      "tries": runs[n]["tries"], "final_val_loss": runs[n]["val_loss"],
                      **{k: runs[n][k] for k in ("retry_delay_s", "scheduler_latency_s",
                                                 "max_restarts")
                         if k in runs[n]}} for n in names},
        "recovery_s": {f: {n: per.get(n, {}).get("recovery_s") for n in names}
                       for f, per in by_fault.items()},
        "lost_s": {f: {n: per.get(n, {}).get("lost_s") for n in names} for f, per in by_fault.items()},
    }
    last_json_line(result, args.out)


class LoadSampler:
    """The 1-minute load average every 10 s while the sides run: they share it, and it says how
    busy the machine was."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append(round(os.getloadavg()[0], 2))
            self._stop.wait(every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float]:
        s = sorted(self.samples)
        return {"min": s[0], "median": s[len(s) // 2], "max": s[-1], "samples": len(s)}


def torchelastic(cfg: Any, work: Path, faults: str, max_restarts: int = 10) -> dict[str, Any]:
    """The plain job under TorchElastic: `torchrun --max-restarts` restarts it on this machine
    each time it fails; each start resumes from the newest checkpoint. Tries = the job's starts,
    as its event log records them (one job_start per start)."""
    import subprocess

    job = work / "torchelastic-job"
    shutil.rmtree(job, ignore_errors=True)
    job.mkdir(parents=True)
    write_json(job / "config.json", to_dict(cfg))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            f"--max-restarts={max_restarts}", "-m", "tasks.pretrain", "--config",
            str(job / "config.json"), "--result", str(job / "result.json"), "--faults", faults]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")])}
    with open(job / "output.log", "wb") as log:
        code = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL).returncode
    if code != 0:
        raise RuntimeError(f"torchrun exited {code}; see {job / 'output.log'}")
    starts = [e for e in read_events(tm.run_dir(cfg.output_dir)) if e.get("kind") == "job_start"]
    result = read_json(job / "result.json")
    print(f"  torchelastic: {len(starts)} starts", flush=True)
    return {"tries": len(starts), "max_restarts": max_restarts,
            "val_loss": result["metrics"]["val_loss"]}


def airflow_baselines(work: Path, configs: dict[str, dict[str, Any]], faults: str,
                      delays: list[float], triggered: Callable[[], None]) -> dict[str, dict[str, Any]]:
    """The plain job as a task of a real Airflow deployment, retried by its scheduler: one DAG
    per retry_delay, all triggered at once; then triggered() is called."""
    sys.path.insert(0, str(ROOT))
    from tests.chaos.airflow_deployment import AirflowDeployment, _epoch

    env = {"LLMOPS_HOME": os.environ["LLMOPS_HOME"],
           "MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"], "OMP_NUM_THREADS": "1",
           "LLMOPS_BENCH_RETRY_DELAYS": ",".join(f"{d:g}" for d in delays)}
    airflow_dir = work / "airflow-deployment"
    shutil.rmtree(airflow_dir, ignore_errors=True)
    out: dict[str, dict[str, Any]] = {}
    with AirflowDeployment(airflow_dir, dags_folder=ROOT / "benchmarks" / "dags", env=env) as dep:
        started = {}
        for delay in delays:
            dag_id = f"{DAG_PREFIX}{delay:g}"
            dep.wait_dag(dag_id)
            started[delay] = (dag_id, dep.trigger(dag_id, {"config": configs[f"airflow_retry{delay:g}"],
                                                           "faults": faults}))
        triggered()
        for delay, (dag_id, run_id) in started.items():
            state = dep.wait_run(dag_id, run_id, timeout=6 * 3600)
            if state != "success":
                raise RuntimeError(f"the baseline DAG run {dag_id} ended {state}; see {airflow_dir}")
            tries = sorted(dep.tries(dag_id, run_id, "pretrain"), key=lambda t: t["try_number"])
            result = dep.xcom(dag_id, run_id, "pretrain")
            latency = [round(_epoch(b["start_date"]) - _epoch(a["end_date"]) - delay, 2)
                       for a, b in zip(tries, tries[1:])]
            print(f"  {dag_id}: {len(tries)} tries, scheduler latency per retry {latency}s",
                  flush=True)
            out[f"airflow_retry{delay:g}"] = {
                "tries": len(tries), "retry_delay_s": delay, "scheduler_latency_s": latency,
                "val_loss": result["metrics"]["val_loss"]}
    return out


if __name__ == "__main__":
    main()
