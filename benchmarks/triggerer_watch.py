"""One triggerer watching many jobs: CPU per watched job per poll and AWS calls per job-minute,
this checkout's code beside an earlier commit's, on the same machine, the same jobs, in one run.

    .venv/bin/python -m benchmarks.triggerer_watch [--jobs 500] [--seconds 120] [--poll 15]
        [--before REV] [--out benchmarks/results/triggerer_watch.json]

What runs: tests/chaos/fake_aws/ (moto behind the proxy that counts every request by operation)
holds `--jobs` jobs, half SageMaker training jobs and half 2-node AWS Batch jobs, queued for
capacity (the simulator's `capacity_wait_seconds`: SageMaker InProgress/Starting, Batch RUNNABLE,
with the services' capacity messages) so no container runs; a feeder puts one line every `--poll`
seconds into each SageMaker job's `algo-1` CloudWatch stream, straight into moto, standing in for
the training container (a queued Batch job has no node container, so no stream: Batch's numbers
are its describe calls). Then, for each side (the earlier commit's code, from a `git worktree` of
`--before`, then this checkout's), one child process imports that side's `llmops` and runs the
real trigger the operator defers to (llmops.triggers.job.JobTrigger) for every job at once in one
asyncio loop, as Airflow's triggerer does (its polls in the loop's default thread pool), each
trigger's first poll at a random moment within the first interval, for `--seconds`. Measured:
the child's CPU time (getrusage, all threads), its polls (JobWatch.poll calls), the proxy's count
of each operation during the side's run, the machine's load before and after.

What is not real: the jobs never start (the watch of a running job adds its result fetch at the
end, nothing per poll), the lines come from the feeder, the AWS is moto on this machine (latency
of a local HTTP call, not a region's), and the load of the fake AWS itself (proxy, moto, feeder)
shares the machine's cores with the child being measured, as it does for both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONN = "llmops_bench"
BUCKET = "llmops-bench"
QUEUE = "llmops-bench-queue"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llmops:bench"
SM_GROUP = "/aws/sagemaker/TrainingJobs"
# The services' published request rates, per account and region. Where AWS publishes none for an
# operation, the entry says so.
LIMITS = {
    "DescribeTrainingJob": {
        "tps": None,
        "note": "SageMaker publishes no TPS for DescribeTrainingJob; its quotas page says the "
                "management APIs' throttling limits (CreateJob, DescribeJob, ...) are not adjustable",
        "source": "https://docs.aws.amazon.com/sagemaker/latest/dg/model-customize-mtrl-quotas.html"},
    "DescribeJobs": {
        "tps": 50,
        "note": "AWS Batch: 50 TPS per account for Batch API calls, DescribeJobs and SubmitJob "
                "included, a fixed limit (the Batch quotas page lists 50 TPS for SubmitJob)",
        "source": "https://repost.aws/knowledge-center/aws-batch-requests-error"},
    "GetLogEvents": {
        "tps": 25,
        "note": "CloudWatch Logs: GetLogEvents 25 TPS per account and region, a hard limit that "
                "cannot be raised (AWS's knowledge center: GetLogEvents and FilterLogEvents 'have "
                "a hard limit, and they don't qualify for a limit increase')",
        "source": "https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/cloudwatch_limits_cwl.html; "
                  "https://repost.aws/knowledge-center/cloudwatch-logs-throttling"},
    "DescribeLogStreams": {
        "tps": 25,
        "note": "botocore's service model (1.44.8) documents DescribeLogStreams as 'a limit of 25 "
                "transactions per second'; older SDK docs said 5",
        "source": "https://docs.aws.amazon.com/AmazonCloudWatchLogs/latest/APIReference/API_DescribeLogStreams.html"},
}


# -- the child: one side's code, every trigger in one loop ---------------------------------------

def child(code: str, handles_file: str, seconds: float, poll: float, seed: int) -> None:
    sys.path[:0] = [str(Path(code) / "plugins"), code]
    import logging

    from llmops.jobs import watch as watch_mod
    from llmops.triggers.job import JobTrigger

    # Imported before the clock starts, on both sides: imports are a one-off of any process, and
    # a side with few polls (the earlier code, starved of CPU) would otherwise carry them all.
    import airflow.providers.amazon.aws.hooks.batch_client  # noqa: F401
    import airflow.providers.amazon.aws.hooks.logs  # noqa: F401
    import airflow.providers.amazon.aws.hooks.s3  # noqa: F401
    import llmops.jobs.backends.batch.backend  # noqa: F401
    import llmops.jobs.backends.sagemaker.backend  # noqa: F401
    import llmops.jobs.backends.sagemaker.hook  # noqa: F401

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage()[:300])

    logging.basicConfig(level=logging.WARNING, handlers=[Keep(level=logging.WARNING)], force=True)
    polls = collections.Counter()
    real_poll = watch_mod.JobWatch.poll

    def counted(self):
        polls[self.handle["backend"]] += 1
        return real_poll(self)

    watch_mod.JobWatch.poll = counted
    handles = json.loads(Path(handles_file).read_text())
    rng = random.Random(seed)
    triggers = [JobTrigger(handle=h, poll_interval=poll, max_run_seconds=86400.0, grace_seconds=0.0)
                for h in handles]
    events: list[dict[str, Any]] = []

    async def watch(trigger: Any, delay: float) -> None:
        await asyncio.sleep(delay)   # triggers arrive spread out, as tasks defer
        async for event in trigger.run():
            events.append(event.payload)

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    async def main() -> dict[str, Any]:
        tasks = [asyncio.create_task(watch(t, rng.uniform(0, poll))) for t in triggers]
        await asyncio.sleep(seconds)
        for task in tasks:
            task.cancel()
        return {}

    cpu0, wall0 = cpu(), time.monotonic()
    asyncio.run(_bounded(main(), seconds + 30))
    cpu1, wall1 = cpu(), time.monotonic()
    builds = {}
    try:
        from llmops.aws import clients

        builds = dict(clients.builds)
    except ImportError:
        pass   # the earlier code has no cache to count
    print(json.dumps({"cpu_seconds": cpu1 - cpu0, "wall_seconds": wall1 - wall0, "polls": dict(polls),
                      "events": [{k: e.get(k) for k in ("state", "message")} for e in events][:10],
                      "warnings": len(warnings), "first_warnings": warnings[:5],
                      "client_builds": builds}), flush=True)
    os._exit(0)   # polls still in their threads would hold the exit; they are not measured


async def _bounded(coro: Any, timeout: float) -> Any:
    return await asyncio.wait_for(coro, timeout)


# -- the parent: the fake AWS, the jobs, both sides ----------------------------------------------

def _moto(server: Any, service: str) -> Any:
    from tests.chaos.multinode import moto

    return moto(server, service)


def _proxy(server: Any, service: str) -> Any:
    import boto3

    from tests.aws_fixtures import REGION

    return boto3.client(service, endpoint_url=server.url, region_name=REGION,
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def make_jobs(server: Any, count: int, poll: float) -> tuple[list[dict[str, Any]], list[str]]:
    """`count` queued jobs (half SageMaker, half Batch), their handles, and the SageMaker streams."""
    from tests.aws_fixtures import REGION
    from tests.chaos.multinode import batch_queue

    s3 = _moto(server, "s3")
    s3.create_bucket(Bucket=BUCKET)
    iam = _moto(server, "iam")
    batch_queue(_moto(server, "batch"), iam, QUEUE)
    role = iam.create_role(RoleName="bench-sagemaker", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    definition = _moto(server, "batch").register_job_definition(
        jobDefinitionName="llmops-bench", type="multinode", nodeProperties={
            "numNodes": 2, "mainNode": 0, "nodeRangeProperties": [{"targetNodes": "0:", "container": {
                "image": IMAGE, "command": ["true"], "resourceRequirements": [
                    {"type": "VCPU", "value": "1"}, {"type": "MEMORY", "value": "512"}]}}]})
    sagemaker, batch, logs = _proxy(server, "sagemaker"), _proxy(server, "batch"), _moto(server, "logs")
    logs.create_log_group(logGroupName=SM_GROUP)
    watch = {"poll_interval": poll, "deadline_grace_seconds": 0, "max_queue_seconds": 0}
    handles, streams = [], []
    for i in range(count):
        name = f"bench-{i:04d}"
        prefix = f"s3://{BUCKET}/staging/{name}/{name}"
        common = {"name": name, "job_name": name, "attempt": 1, "aws_conn_id": CONN, "region_name": REGION,
                  "result_uri": f"{prefix}/result.json", "staging_prefix": prefix, "copy_back": {},
                  "output_uri": f"{prefix}/output", "reattached": False, "kms_key_id": "", "image": IMAGE,
                  **watch}
        if i % 2 == 0:
            sagemaker.create_training_job(
                TrainingJobName=name, RoleArn=role,
                AlgorithmSpecification={"TrainingImage": IMAGE, "TrainingInputMode": "File"},
                OutputDataConfig={"S3OutputPath": f"{prefix}/output"},
                ResourceConfig={"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 10},
                StoppingCondition={"MaxRuntimeInSeconds": 86400})
            stream = f"{name}/algo-1-{int(time.time())}"
            logs.create_log_stream(logGroupName=SM_GROUP, logStreamName=stream)
            streams.append(stream)
            handles.append({"backend": "sagemaker", **common, "checkpoint_uri": f"{prefix}/checkpoints",
                            "instance_type": "ml.m5.xlarge", "instance_count": 1})
        else:
            job_id = batch.submit_job(jobName=name, jobQueue=QUEUE,
                                      jobDefinition=definition["jobDefinitionArn"],
                                      nodeOverrides={"numNodes": 2})["jobId"]
            handles.append({"backend": "batch", **common, "job_id": job_id,
                            "instance_type": "m5.xlarge", "instance_count": 2})
    return handles, streams


def feed(server: Any, streams: list[str], every: float, stop: threading.Event) -> None:
    """One line per SageMaker job every `every` seconds, as its training container would log."""
    logs = _moto(server, "logs")
    step = 0
    while not stop.wait(every):
        step += 1
        for stream in streams:
            if stop.is_set():
                return   # the fake AWS is going away
            logs.put_log_events(logGroupName=SM_GROUP, logStreamName=stream, logEvents=[
                {"timestamp": int(time.time() * 1000), "message": f"step {step}/100000 | loss 2.0 | 1.0 tok/s"}])


def clear_cursors(server: Any) -> None:
    """Each side starts reading the logs from the start (no log cursor saved by the other)."""
    s3 = _moto(server, "s3")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="staging/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", []) if o["Key"].endswith("log-cursor.json")]
        if keys:
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


def run_side(server: Any, code: str, handles_file: str, seconds: float, poll: float, env: dict) -> dict:
    before = dict(server.report()["operations"])
    load0 = os.getloadavg()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.triggerer_watch", "--child", code,
                           "--handles", handles_file, "--seconds", str(seconds), "--poll", str(poll)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=seconds + 300)
    load1 = os.getloadavg()
    after = dict(server.report()["operations"])
    if proc.returncode != 0:
        raise RuntimeError(f"the {code} side failed: {proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["operations"] = {op: after[op] - before.get(op, 0) for op in after if after[op] - before.get(op, 0)}
    result["loadavg_start"], result["loadavg_end"] = list(load0), list(load1)
    return result


def summarize(side: dict, jobs: int, seconds: float) -> dict:
    polls = sum(side["polls"].values())
    job_minutes = jobs * seconds / 60
    ops = side["operations"]
    return {
        "polls": polls, "polls_by_backend": side["polls"],
        "achieved_poll_interval_s": round(jobs * seconds / polls, 1) if polls else None,
        "cpu_seconds": round(side["cpu_seconds"], 2),
        "cpu_seconds_per_job_per_poll": round(side["cpu_seconds"] / polls, 5) if polls else None,
        "cpu_cores_busy": round(side["cpu_seconds"] / side["wall_seconds"], 2),
        "calls_per_job_minute": {op: round(n / job_minutes, 2) for op, n in sorted(ops.items())},
        "calls_per_poll": {op: round(n / polls, 3) for op, n in sorted(ops.items())} if polls else {},
        "operations": dict(sorted(ops.items())),
        "client_builds": side["client_builds"], "warnings": side["warnings"],
        "first_warnings": side["first_warnings"], "events": side["events"],
        "loadavg_start": side["loadavg_start"], "loadavg_end": side["loadavg_end"],
    }


def against_limits(summary: dict, jobs: int, interval: float = 30.0) -> dict:
    """Account-wide requests per second of `jobs` jobs polled every `interval` s (Airflow's
    default 30 s), from the calls per poll measured, against each published limit."""
    out = {}
    for op, limit in LIMITS.items():
        per_poll = summary["calls_per_poll"].get(op, 0.0)
        tps = per_poll * jobs / interval
        out[op] = {"calls_per_poll": per_poll, f"tps_at_{jobs}_jobs_every_{interval:.0f}s": round(tps, 2),
                   "limit_tps": limit["tps"],
                   "share_of_limit": round(tps / limit["tps"], 2) if limit["tps"] else None}
    return out


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("apache-airflow", "apache-airflow-providers-amazon", "boto3",
                                    "botocore", "moto")} | {"python": platform.python_version()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=120.0, help="how long each side watches")
    parser.add_argument("--poll", type=float, default=15.0, help="the triggers' poll interval")
    parser.add_argument("--before", default="0e5c2d2^", help="the earlier commit (a git worktree of it is made)")
    parser.add_argument("--after", default="", help="a later commit to measure instead of this checkout")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/triggerer_watch.json"))
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--handles", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.handles, args.seconds, args.poll, args.seed)

    sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]
    from tests.aws_fixtures import free_port
    from tests.chaos.fake_aws import CREDENTIALS, FakeAws

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    before_rev = subprocess.run(["git", "rev-parse", args.before], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "plugins"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip())
    work = Path(tempfile.mkdtemp(prefix="triggerer-watch-"))
    trees = {"before": work / "before", "after": work / "after" if args.after else ROOT}
    after_rev = commit
    if args.after:
        after_rev = subprocess.run(["git", "rev-parse", args.after], cwd=ROOT, capture_output=True,
                                   text=True, check=True).stdout.strip()
    for label, rev in (("before", before_rev), ("after", after_rev if args.after else "")):
        if rev:
            subprocess.run(["git", "worktree", "add", "--detach", str(trees[label]), rev], cwd=ROOT,
                           check=True, capture_output=True)
    load_start = os.getloadavg()
    server = FakeAws(free_port(), work / "fake-aws", capacity_wait_seconds=10**7, pending_seconds=10**7).start()
    stop = threading.Event()
    try:
        print(f"creating {args.jobs} queued jobs ...", flush=True)
        handles, streams = make_jobs(server, args.jobs, args.poll)
        handles_file = work / "handles.json"
        handles_file.write_text(json.dumps(handles))
        feeder = threading.Thread(target=feed, args=(server, streams, args.poll, stop), daemon=True)
        feeder.start()
        env = {**os.environ, **CREDENTIALS, f"AIRFLOW_CONN_{CONN.upper()}": json.dumps(server.connection()),
               "AIRFLOW_HOME": str(work / "airflow"), "PYTHONPATH": str(ROOT)}
        sides = {}
        for label, code in (("before", str(trees["before"])), ("after", str(trees["after"]))):
            clear_cursors(server)
            print(f"{label}: {code}, {args.jobs} triggers for {args.seconds:.0f} s ...", flush=True)
            sides[label] = summarize(run_side(server, code, str(handles_file), args.seconds, args.poll, env),
                                     args.jobs, args.seconds)
    finally:
        stop.set()
        if "feeder" in locals():
            feeder.join(timeout=60)
        server.stop()
        for tree in trees.values():
            if tree != ROOT:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    load_end = os.getloadavg()
    b, a = sides["before"], sides["after"]

    def ratio(x: float | None, y: float | None) -> float | None:
        return round(y / x, 3) if x and y is not None else None

    ops = sorted(set(b["calls_per_poll"]) | set(a["calls_per_poll"]))
    comparison = {
        "cpu_seconds_per_job_per_poll": {"before": b["cpu_seconds_per_job_per_poll"],
                                         "after": a["cpu_seconds_per_job_per_poll"],
                                         "after_over_before": ratio(b["cpu_seconds_per_job_per_poll"],
                                                                    a["cpu_seconds_per_job_per_poll"])},
        "achieved_poll_interval_s": {"before": b["achieved_poll_interval_s"],
                                     "after": a["achieved_poll_interval_s"], "asked": args.poll},
        "calls_per_poll": {op: {"before": b["calls_per_poll"].get(op, 0), "after": a["calls_per_poll"].get(op, 0),
                                "after_over_before": ratio(b["calls_per_poll"].get(op), a["calls_per_poll"].get(op, 0))}
                           for op in ops},
    }
    result = {
        "benchmark": "benchmarks/triggerer_watch.py",
        "what": __doc__.split("\n\n")[2].strip(),
        "git_commit": commit, "before_commit": before_rev, "after_commit": after_rev,
        "after_is_checkout_with_uncommitted_plugin_changes": dirty and not args.after,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.machine()},
        "versions": versions(),
        "load": {"loadavg_start": list(load_start), "loadavg_end": list(load_end)},
        "setup": {"jobs": args.jobs, "sagemaker_jobs": len(streams), "batch_jobs": args.jobs - len(streams),
                  "batch_nodes": 2, "seconds_per_side": args.seconds, "poll_interval_s": args.poll,
                  "log_lines_per_sagemaker_job_per_poll": 1},
        "comparison": comparison,
        "against_published_limits_at_30s": {"before": against_limits(b, args.jobs),
                                            "after": against_limits(a, args.jobs)},
        "limits": LIMITS,
        "before": b, "after": a,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'':34}{'before':>12}{'after':>12}{'after/before':>14}")
    row = comparison["cpu_seconds_per_job_per_poll"]
    print(f"{'CPU s per job per poll':34}{row['before']:>12}{row['after']:>12}{str(row['after_over_before']):>14}")
    print(f"{'achieved poll interval (s)':34}{b['achieved_poll_interval_s']!s:>12}{a['achieved_poll_interval_s']!s:>12}")
    for op in ops:
        row = comparison["calls_per_poll"][op]
        print(f"{op + ' per poll':34}{row['before']:>12}{row['after']:>12}{str(row['after_over_before']):>14}")
    print(f"\nload {load_start} -> {load_end}; written {args.out}")


if __name__ == "__main__":
    main()
