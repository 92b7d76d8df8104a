"""benchmarks/triggerer_watch.py's run through a real `airflow triggerer` (`--airflow N`).

A real Airflow deployment (tests/chaos/airflow_deployment.py: api-server, scheduler,
dag-processor and triggerer as processes of their own, PostgreSQL as MWAA's, LocalExecutor with
8 worker slots) runs benchmarks/dags/triggerer_watch.py: N mapped JobOperator tasks, each
submitting a timed job to the simulators (SageMaker, Batch, HyperPod in turn) and deferring; the
jobs end, each at its drawn moment, after all N are deferred and past a Batch submit's 180 s look
for copies. Measured: the triggerer's CPU and resident memory (every process of its session, from
/proc: the supervisor and its trigger runner), its CPU for IDLE_SECONDS before the run while it
holds no trigger, each API's calls in the window where only the triggerer polls (every task
deferred, no job ended), each job's end against its trigger's "Trigger fired event" (the
triggerer's part of the task log) and against its task's end (REST).
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import time
from pathlib import Path
from typing import Any

from benchmarks.triggerer_watch import (ROOT, SETTLE_SECONDS, World, _percentile, against_limits,
                                        rates)

DAG_ID = "bench_triggerer_watch"
FIRED = "Trigger fired event"
STATE = re.compile(r"'state': '(\w+)'")
# A fired event in the triggerer's own (console) log: its timestamp, and the task's map index.
TRIGGERER_LOG_FIRED = re.compile(r"(\S+Z) \[info\s*\] Trigger fired event .* map_index=(\d+) ")
TICKS = os.sysconf("SC_CLK_TCK")
IDLE_SECONDS = 90.0   # the triggerer's CPU with no trigger, measured this long before the run


def _cpu_and_rss(pids: list[int]) -> tuple[float, float]:
    """(CPU seconds of the processes and their reaped children, resident MiB) of `pids`."""
    cpu = rss = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu += sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICKS   # utime stime cutime cstime
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) / 1024
        except (OSError, IndexError, ValueError):
            continue
    return cpu, rss


def _task_instances(dep: Any, run_id: str) -> list[dict[str, Any]]:
    out, offset = [], 0
    while True:
        page = dep.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances"
                                  f"?limit=100&offset={offset}")["task_instances"]
        out += page
        if len(page) < 100:
            return out
        offset += 100


def _fired(dep: Any, run_id: str) -> dict[int, list[dict[str, Any]]]:
    """Per map index, every "Trigger fired event": in the triggerers' parts of its task log, or,
    where Airflow wrote it elsewhere, in the triggerer's own log.

    Airflow 3.3's triggerer closes a trigger's log file when the trigger runner reports it
    finished (on the runner's requests socket), while its log lines come on another socket: lines
    still in flight then (the fired event, the job's last lines) go to the triggerer's own log
    (triggerer_job_runner.py's `fallback_log`). At 500 jobs 17 of 500 fired events went there
    (benchmarks/results/triggerer_watch_airflow_500.json); each task resumed with its event all
    the same."""
    from tests.chaos.airflow_deployment import _epoch

    out: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)

    def fired(index: int, timestamp: str, text: str, where: str) -> None:
        state = STATE.search(text)
        out[index].append({"at": _epoch(timestamp), "state": state.group(1) if state else "?", "where": where})

    for path in dep.log_dir(DAG_ID, run_id, "job").glob("map_index=*/attempt=*.log.trigger.*"):
        index = int(path.parent.name.split("=", 1)[1])
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == FIRED:
                fired(index, record["timestamp"], str(record.get("result", "")), "task log")
    own = dep.workdir / "components" / "triggerer.log"
    for line in own.read_text(errors="replace").splitlines() if own.exists() else []:
        found = TRIGGERER_LOG_FIRED.match(line)
        if found and f"run_id={run_id}" in line:
            fired(int(found.group(2)), found.group(1), line, "triggerer log")
    return out


def run_airflow(count: int, args: Any, work: Path) -> dict[str, Any]:
    from tests.aws_fixtures import DUMMY_CREDENTIALS
    from tests.chaos.airflow_deployment import AirflowDeployment, _epoch

    print(f"airflow: {count} deferred JobOperator tasks through a real triggerer ...", flush=True)
    world = World(work / "airflow-world", args.poll, args.line_seconds)
    env = {**world.env, "AIRFLOW_VAR_LLMOPS_BACKENDS": json.dumps(world.settings),
           "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "true", "LLMOPS_HOME": str(work / "airflow-llmops"),
           "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'airflow-mlflow.db'}", **DUMMY_CREDENTIALS}
    dep = AirflowDeployment(work / "deployment", dags_folder=ROOT / "benchmarks" / "dags", env=env,
                            database="postgresql", parallelism=8, heartbeat_timeout=60)
    samples: list[tuple[float, float, float]] = []   # (time, triggerer CPU s, triggerer RSS MiB)
    try:
        dep.start()
        dep.wait_dag(DAG_ID, timeout=240)
        # The triggerer holding no trigger (its loop, heartbeats and queries): the part of its CPU
        # that does not grow with the jobs it watches.
        idle_cpu, idle_at = _cpu_and_rss(dep.pids("triggerer"))[0], time.time()
        time.sleep(IDLE_SECONDS)
        idle_cores = (_cpu_and_rss(dep.pids("triggerer"))[0] - idle_cpu) / (time.time() - idle_at)
        rng = random.Random(args.seed)
        t0 = time.time()
        first_end = t0 + count * args.airflow_submit_seconds + SETTLE_SECONDS + args.airflow_quiet_seconds
        jobs = [{"backend": ("sagemaker", "batch", "hyperpod")[i % 3],
                 "end_at": first_end + rng.uniform(0, args.end_spread),
                 "exit_code": 1 if rng.random() < args.fail_share else 0} for i in range(count)]
        base_cpu, base_rss = _cpu_and_rss(dep.pids("triggerer"))
        load0 = os.getloadavg()
        run_id = dep.trigger(DAG_ID, {"jobs": jobs})
        deferred_all = None
        states: dict[str, int] = {}
        deadline = first_end + args.end_spread + 600
        while time.time() < deadline:
            cpu, rss = _cpu_and_rss(dep.pids("triggerer"))
            samples.append((time.time(), cpu, rss))
            tis = [ti for ti in _task_instances(dep, run_id) if ti["task_id"] == "job"]
            states = dict(collections.Counter(ti["state"] for ti in tis))
            if deferred_all is None and len(tis) == count and states.get("deferred") == count:
                deferred_all = time.time()
                print(f"  all {count} deferred after {deferred_all - t0:.0f} s", flush=True)
            if dep.run(DAG_ID, run_id)["state"] in ("success", "failed"):
                break
            time.sleep(5)
        load1 = os.getloadavg()
        tis = {ti["map_index"]: ti for ti in _task_instances(dep, run_id) if ti["task_id"] == "job"}
        fired = _fired(dep, run_id)
    finally:
        dep.stop()
        world.stop()
    # Each simulated job to its map index: JobOperator names it `job-<map index>-<hash>`.
    ended: dict[int, dict[str, Any]] = {}
    for job in world.aws.sim.report():
        state = {"Completed": "succeeded", "SUCCEEDED": "succeeded"}.get(job["status"], "failed")
        ended[int(job["name"].split("-")[1])] = {"ended_at": job["ended_at"], "state": state}
    for job in world.eks.report()["jobs"]:
        ended[int(job["name"].split("-")[1])] = {"ended_at": job["ended_at"],
                                                 "state": {"Succeeded": "succeeded"}.get(job["status"], "failed")}
    notice, task_end = [], []
    missed, duplicated, wrong = [], [], []
    for index in range(count):
        job, events = ended.get(index) or {}, [e for e in fired.get(index, []) if e["state"] != "progress"]
        if not job.get("ended_at"):
            continue
        if not events:
            missed.append(index)
            continue
        if len(events) > 1:
            duplicated.append(index)
        if events[0]["state"] != job["state"]:
            wrong.append(index)
        notice.append(events[0]["at"] - job["ended_at"])
        ti = tis.get(index) or {}
        if ti.get("end_date"):
            task_end.append(_epoch(ti["end_date"]) - job["ended_at"])
    first = min((j["ended_at"] for j in ended.values() if j.get("ended_at")), default=time.time())
    steady = (max(deferred_all or first, t0 + count * args.airflow_submit_seconds + SETTLE_SECONDS), first)
    inside = [s for s in samples if steady[0] <= s[0] <= steady[1]]
    cpu_steady = ((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])) if len(inside) > 1 else None
    steady_calls = against_limits(rates(world.samples, *steady)) if steady[1] > steady[0] + 30 else None
    return {
        "jobs": count, "submit_seconds_per_task": args.airflow_submit_seconds,
        "quiet_seconds": args.airflow_quiet_seconds, "end_spread_s": args.end_spread, "task_states": states,
        "all_deferred_after_s": round(deferred_all - t0, 1) if deferred_all else None,
        "steady_window_s": [round(steady[0] - t0, 1), round(steady[1] - t0, 1)],
        "triggerer_cpu_cores_busy_steady": round(cpu_steady, 3) if cpu_steady is not None else None,
        "triggerer_cpu_cores_idle": round(idle_cores, 3),
        "triggerer_cpu_ms_per_job_per_second_above_idle":
            round(1000 * (cpu_steady - idle_cores) / count, 3) if cpu_steady is not None else None,
        "triggerer_cpu_ms_per_job_per_poll_interval_steady":
            round(1000 * cpu_steady * args.poll / count, 2) if cpu_steady is not None else None,
        "triggerer_cpu_seconds_whole_run": round(samples[-1][1] - base_cpu, 1) if samples else None,
        "triggerer_rss_mib_before": round(base_rss, 1),
        "triggerer_rss_mib_peak": round(max(s[2] for s in samples), 1) if samples else None,
        "triggerer_rss_kib_per_job": round(1024 * (max(s[2] for s in samples) - base_rss) / count, 1) if samples else None,
        "completions": {"jobs_ended": len(notice) + len(missed), "fired": len(notice),
                        "fired_event_only_in_triggerer_log": sum(
                            1 for events in fired.values() if events and all(e["where"] != "task log" for e in events)),
                        "missed": len(missed),
                        "duplicated": len(duplicated), "wrong": len(wrong),
                        "examples": [*missed, *duplicated, *wrong][:10]},
        "notice_delay_s": {"p50": _percentile(notice, 0.5), "p99": _percentile(notice, 0.99),
                           "max": round(max(notice), 1) if notice else None,
                           "p99_in_poll_intervals": round(_percentile(notice, 0.99) / args.poll, 2) if notice else None},
        "task_end_delay_s": {"p50": _percentile(task_end, 0.5), "p99": _percentile(task_end, 0.99),
                             "max": round(max(task_end), 1) if task_end else None},
        "calls_steady": steady_calls,
        "loadavg_start": [round(x, 2) for x in load0], "loadavg_end": [round(x, 2) for x in load1],
    }
