"""End-of-job idle time of a 2-node pretraining job whose nodes share no disk: seconds between
the job's last training step in its log and the job's end, and when the nodes without rank 0
exit (they have nothing left to do after the last step: any time they spend is idle), per backend, this commit's workload
code against an earlier commit's (`--before REV`: the same simulator runs that commit's tasks/ and
docker/job_entry.py, as an image built from it would), in one run, on the same machine.

    .venv/bin/python benchmarks/multinode_end_of_job.py [--before 37a045d] [--before-backends batch]

The jobs run in tests/chaos (fake_aws: Batch and SageMaker; fake_eks: HyperPod, both job kinds),
each node a process tree on its own empty disk. Before the fix, the node without rank 0 waited
for rank 0's result file on its own disk until torchrun's exit barrier (300 s) gave up: every
GPU of the job idle that long. The GPU-hours figure scales the other nodes' idle time to a
64-node job (63 such nodes x 8 GPUs).
Writes benchmarks/results/multinode_end_of_job.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]

OUT = ROOT / "benchmarks" / "results" / "multinode_end_of_job.json"
STEPS, INTERVAL = 40, 10


def snapshot(rev: str, into: Path) -> Path:
    """tasks/ and docker/ of git revision `rev`, unpacked under `into`."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "tasks", "docker"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def one_job(server, name: str, work: Path, code: str) -> dict:
    """Run one clean 2-node job; its idle time after the last step and its wall time."""
    from llmops.jobs.backends import JobState
    from tests.chaos import multinode as mn

    platform = mn.platform(server, name, work)
    try:
        spec = mn.pretrain_spec(f"eoj-{code}-{name.lower()[:9]}", max_steps=STEPS, interval=INTERVAL,
                                instance_type=platform.instance_type)
        started = time.time()
        handle = platform.backend.submit(spec)
        status = mn.wait_state(platform.backend, handle,
                               {JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED}, 1200)
        last_step = max(t for t, line in platform.events(handle) if mn.STEP_LINE.search(line))
        ended = platform.ended_at(handle)
        nodes = platform.node_ends(handle)
        # node 0 (rank 0) publishes the model and uploads the outputs after the last step: work.
        # The other nodes have nothing left to do: what they spend after it is idle.
        others = max(t for t in nodes[1:]) - last_step
        return {"backend": name, "code": code, "state": status.state.value,
                "job_end_after_last_step_s": round(ended - last_step, 1),
                "other_nodes_exit_after_last_step_s": round(others, 1),
                "job_wall_s": round(ended - started, 1),
                "idle_gpu_hours_at_64x8": round(others * 63 * 8 / 3600, 1)}
    finally:
        platform.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="37a045d",
                        help="the commit whose workload code gives the 'before' figure ('' = none)")
    parser.add_argument("--before-backends", default="batch",
                        help="comma-separated; each 'before' job waits ~300 s, so one by default")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    load_start = [round(x, 2) for x in os.getloadavg()]
    work = Path(tempfile.mkdtemp(prefix="llmops-eoj-"))
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
    os.environ["OMP_NUM_THREADS"] = "1"

    from tasks.configs import tiny
    from tasks.data.prep import prepare
    from tests.chaos import multinode as mn

    data = tiny().data
    data.output_dir, data.engine = str(work / "data"), "local"
    prepare(data)
    server = mn.start_fake(work / "fake-aws", Path(data.output_dir))
    rows = []
    try:
        with mn.connected(server):
            for name in mn.BACKENDS:
                rows.append(one_job(server, name, work / f"after-{name}", "this"))
                print(json.dumps(rows[-1]), flush=True)
            if args.before:
                os.environ["LLMOPS_SIM_IMAGE_ROOT"] = str(snapshot(args.before, work / "before"))
                try:
                    for name in [b for b in args.before_backends.split(",") if b]:
                        rows.append(one_job(server, name, work / f"before-{name}", "before"))
                        print(json.dumps(rows[-1]), flush=True)
                finally:
                    os.environ.pop("LLMOPS_SIM_IMAGE_ROOT")
    finally:
        server.stop()

    import platform

    import torch

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    report = {"benchmark": "multinode_end_of_job", "steps": STEPS, "nodes": 2,
              "before_commit": args.before, "rows": rows,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "python": platform.python_version(), "torch": torch.__version__,
                          "git_commit": commit, "load_avg_1_5_15_at_start": load_start,
                          "load_avg_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
                          "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}
    print("\n".join(f"{r['backend']:<20} {r['code']:<7} job end {r['job_end_after_last_step_s']:>6} s, "
                    f"other nodes exit {r['other_nodes_exit_after_last_step_s']:>6} s after the last step "
                    f"(63 idle nodes x 8 GPUs: {r['idle_gpu_hours_at_64x8']} GPU-h)" for r in rows))
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
