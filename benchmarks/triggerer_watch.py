"""One triggerer watching N jobs that run and end: its CPU and memory per job, the AWS and
Kubernetes calls per minute per API against each API's published limit, and how late each job's
end is noticed, for N = 100, 500 and 1,000 mixed SageMaker, Batch and HyperPod jobs; the code
before shared polling beside this checkout's, in one run.

    .venv/bin/python -m benchmarks.triggerer_watch [--jobs 100,500,1000] [--poll 30]
        [--run 120:300] [--before REV | --before none] [--airflow 100] [--out FILE]

What runs, per N and side: a fresh simulated AWS (tests/chaos/fake_aws/: moto behind the proxy
that counts every request by operation, and its job simulator) and a fresh simulated HyperPod
cluster (tests/chaos/fake_eks.py behind its real Kubernetes REST front, which counts every
call), both in `timed` mode: a job runs no container, only a timer (its SIM_RUN_SECONDS, drawn
uniformly from `--run`; SIM_EXIT_CODE 1 for a `--fail-share` of them), logging a line at its
start, every `--line-seconds` and at its end into its CloudWatch stream or pod log, and on
success writing the result JSON its entry would write. The N jobs, one third each SageMaker
training (1 instance), Batch multi-node (2 nodes) and HyperPodPyTorchJob (2 pods), are submitted
through the backends' own submit() (the handles a deferred task carries), then one child process
imports that side's `llmops` and runs the real trigger JobOperator defers to
(llmops.airflow.triggers.job_trigger.JobTrigger) for every job at once in one asyncio loop, as
Airflow's triggerer runs its triggers (their polls in the loop's default thread pool), each trigger
started at a random moment within the first poll interval, until every trigger has fired or the
jobs' longest run plus 4 poll intervals has passed.

Measured, per side: the child's CPU time (getrusage: every thread) and its resident memory
before the triggers and at its peak; each API's calls (the proxy's and the Kubernetes front's
counts, sampled every 5 s) as a mean rate over the window in which every trigger ran and as the
busiest 60 s, each against the API's published limit (LIMITS: the source of each, or that AWS
publishes none); each job's end as the simulator records it (the status flip) against the time
its trigger fired, as p50 / p99 / max seconds and in poll intervals; completions missed (a job
ended, its trigger never fired), duplicated (a trigger fired twice), wrong (fired with another
end than the job's) or early (fired before the job ended).

With `--airflow N` (a real `airflow triggerer`): a real Airflow deployment (tests/chaos/
airflow_deployment.py: api-server, scheduler, dag-processor and triggerer as their own processes,
PostgreSQL, LocalExecutor) runs benchmarks/dags/triggerer_watch.py: N mapped JobOperator tasks
that submit N timed jobs through the same simulators and defer; measured: the triggerer's CPU
and memory (every process of its session, from /proc), each API's calls in the window between
the last deferral and the first job end (only the triggerer polls then), and each job's end
against its trigger's "Trigger fired event" (the triggerer's task log) and against its task's
end (the REST API). The harness above is how N = 500 and 1,000 are measured on this 2-core
machine (each JobOperator task costs a worker process seconds of CPU, twice); this run, beside
the harness at the same N, shows how far the harness agrees with the real triggerer.

What is not real: the services are simulators on this machine (a local HTTP round trip, not a
region's), their own CPU shares the machine's two cores with the process measured (CPU time is
robust to that, delays are not: the load is recorded at both ends), jobs never fail mid-run on
their own besides the drawn exit codes, and a job's log is a few lines.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
CONN = "llmops_bench"
KUBE_CONN = "llmops_bench_kube"
# The submitter's own connections, to the same services through doors of their own, so that
# its calls are not counted with the triggers' (World).
SUBMIT_CONN, SUBMIT_KUBE_CONN = "llmops_bench_submit", "llmops_bench_submit_kube"
BUCKET = "llmops-bench"
QUEUE = "llmops-bench-queue"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llmops:bench"
BACKENDS = ("sagemaker", "batch", "hyperpod")
SAMPLE_SECONDS = 5.0
MAX_RUN_SECONDS = 3600   # every job's max_run_seconds (its deadline is never near)
SETTLE_SECONDS = 180.0   # a Batch status looks for copies of its submission this long after it
# The services' published request rates (per account and Region, or per S3 prefix), and where
# AWS publishes none. `group`: calls that share one limit.
LIMITS = {
    "DescribeTrainingJob": {
        "tps": None, "service": "sagemaker",
        "note": "SageMaker publishes no request rate for DescribeTrainingJob (its quotas page lists "
                "none for the management APIs' Describe/List calls; throttling answers "
                "ThrottlingException)",
        "source": "https://docs.aws.amazon.com/sagemaker/latest/dg/regions-quotas.html"},
    "ListTrainingJobs": {
        "tps": None, "service": "sagemaker",
        "note": "SageMaker publishes no request rate for ListTrainingJobs",
        "source": "https://docs.aws.amazon.com/sagemaker/latest/dg/regions-quotas.html"},
    "DescribeJobs": {
        "tps": 50, "service": "batch", "group": "batch",
        "note": "AWS Batch: at most 50 transactions per second per account for Batch API calls, "
                "DescribeJobs and SubmitJob included, a fixed limit",
        "source": "https://repost.aws/knowledge-center/aws-batch-requests-error"},
    "ListJobs": {
        "tps": 50, "service": "batch", "group": "batch",
        "note": "AWS Batch: the same 50 TPS per account for every Batch API call",
        "source": "https://repost.aws/knowledge-center/aws-batch-requests-error"},
    "GetLogEvents": {
        "tps": 25, "service": "logs",
        "note": "CloudWatch Logs: GetLogEvents 25 TPS per account and Region, a hard limit "
                "(AWS's knowledge center: GetLogEvents and FilterLogEvents 'have a hard limit')",
        "source": "https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/cloudwatch_limits_cwl.html; "
                  "https://repost.aws/knowledge-center/cloudwatch-logs-throttling"},
    "DescribeLogStreams": {
        "tps": 25, "service": "logs",
        "note": "CloudWatch Logs: 'This operation has a limit of 25 transactions per second' "
                "(the API reference, as botocore's model carries it)",
        "source": "https://docs.aws.amazon.com/AmazonCloudWatchLogs/latest/APIReference/API_DescribeLogStreams.html"},
    "GetObject": {
        "tps": 5500, "service": "s3",
        "note": "S3: 5,500 GET/HEAD requests per second per partitioned prefix (the log cursors and "
                "results are under each job's own prefix)",
        "source": "https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html"},
    "PutObject": {
        "tps": 3500, "service": "s3",
        "note": "S3: 3,500 PUT/COPY/POST/DELETE requests per second per partitioned prefix",
        "source": "https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html"},
    "k8s:get_namespaced_custom_object": {
        "tps": None, "service": "kubernetes",
        "note": "Kubernetes publishes no request rate: the API server bounds concurrent requests "
                "(API Priority and Fairness, --max-requests-inflight 400 by default), and EKS "
                "publishes no rate for its control plane",
        "source": "https://kubernetes.io/docs/concepts/cluster-administration/flow-control/"},
    "k8s:list_namespaced_custom_object": {
        "tps": None, "service": "kubernetes", "note": "as above: concurrency, not a rate",
        "source": "https://kubernetes.io/docs/concepts/cluster-administration/flow-control/"},
    "k8s:list_namespaced_pod": {
        "tps": None, "service": "kubernetes", "note": "as above: concurrency, not a rate",
        "source": "https://kubernetes.io/docs/concepts/cluster-administration/flow-control/"},
    "k8s:read_namespaced_pod_log": {
        "tps": None, "service": "kubernetes", "note": "as above: concurrency, not a rate",
        "source": "https://kubernetes.io/docs/concepts/cluster-administration/flow-control/"},
}


# -- the child: one side's code, every trigger in one loop ---------------------------------------

def child(code: str, handles_file: str, out_file: str, poll: float, timeout: float, seed: int) -> None:
    """Run a JobTrigger, in one asyncio loop, for each job the parent submits."""
    sys.path[:0] = [str(Path(code) / "plugins"), code]
    import logging

    from llmops.airflow.triggers.job_trigger import JobTrigger
    from llmops.jobs import watch as watch_mod

    # Imported before the clock starts, on both sides: a one-off of any process.
    import llmops.jobs.backends.batch.batch_backend  # noqa: F401
    import llmops.jobs.backends.hyperpod.hyperpod_backend  # noqa: F401
    import llmops.jobs.backends.sagemaker.sagemaker_backend  # noqa: F401

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
    rng = random.Random(seed)
    started: dict[int, float] = {}
    events: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    rss_samples: list[float] = []
    cpu_samples: list[tuple[float, float]] = []   # (time, CPU seconds so far)

    async def watch(index: int, handle: dict, delay: float) -> None:
        await asyncio.sleep(delay)   # the task's defer, a moment after its submit
        started[index] = time.time()
        await watch_job(handle, poll, events[index].append)

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    async def sample_rss() -> None:
        while True:
            rss_samples.append(_rss_mib())
            cpu_samples.append((time.time(), cpu()))
            await asyncio.sleep(SAMPLE_SECONDS)

    async def main() -> None:
        """A trigger for each handle as the parent submits its job (one JSON line each in
        `handles_file`, then {"done": true}), until every trigger fired or `timeout` passed."""
        sampler = asyncio.create_task(sample_rss())
        deadline = time.monotonic() + timeout
        tasks: list[asyncio.Task] = []
        offset, done = 0, False
        while not done and time.monotonic() < deadline:
            with open(handles_file) as fh:
                fh.seek(offset)
                chunk = fh.read()
            complete = chunk[:chunk.rfind("\n") + 1]
            offset += len(complete.encode())
            for line in complete.splitlines():
                record = json.loads(line)
                if record.get("done"):
                    done = True
                    break
                tasks.append(asyncio.create_task(watch(len(tasks), record, rng.uniform(0.5, 2.0))))
            await asyncio.sleep(0.5)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(1.0, deadline - time.monotonic()))
            for task in pending:
                task.cancel()
        sampler.cancel()

    rss_before = _rss_mib()
    cpu0, wall0 = cpu(), time.time()
    asyncio.run(main())
    cpu1, wall1 = cpu(), time.time()
    builds = {}
    try:
        from llmops.infra.aws import clients

        builds = dict(clients.builds)
    except ImportError:
        pass
    Path(out_file).write_text(json.dumps({
        "cpu_seconds": cpu1 - cpu0, "wall_start": wall0, "wall_end": wall1, "polls": dict(polls),
        "rss_mib_before": rss_before, "rss_mib_peak": max(rss_samples or [rss_before]),
        "cpu_samples": cpu_samples,
        "started": {str(k): v for k, v in started.items()},
        "events": {str(k): v for k, v in events.items()},
        "warnings": len(warnings), "first_warnings": warnings[:8], "client_builds": builds}))
    os._exit(0)   # polls still in their threads would hold the exit; they are not measured


async def watch_job(handle: dict[str, Any], poll: float, record: Callable[[dict[str, Any]], None]) -> None:
    """Run the trigger JobOperator defers to for this job until it fires (again from a
    checkpoint, as the task defers again), recording each event with its time."""
    from llmops.airflow.triggers.job_trigger import JobTrigger

    # What JobOperator defers with (llmops.airflow.operators.job_operator: _watch), for a job of the
    # handle's.
    trigger: Any = JobTrigger(handle=handle, poll_interval=poll, max_run_seconds=MAX_RUN_SECONDS,
                              grace_seconds=float(handle.get("deadline_grace_seconds", 1800)),
                              max_queue_seconds=handle.get("max_queue_seconds") or None,
                              submitted_at=handle.get("submitted_at"))
    while trigger is not None:
        again = None
        async for event in trigger.run():   # a trigger's first event ends it
            payload = event.payload
            record({"at": time.time(), "state": payload.get("state"),
                    "message": str(payload.get("message"))[:200]})
            if payload.get("state") == "progress":   # the task defers again from the checkpoint
                again = JobTrigger(**payload["trigger"])
        trigger = again


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# -- the simulated services ----------------------------------------------------------------------

class World:
    """The fake AWS and the HyperPod cluster (both timed), the connections to them, the backends'
    settings, and a sampler of every API's call counts."""

    def __init__(self, workdir: Path, poll: float, line_seconds: float):
        from tests.aws_fixtures import REGION, free_port, sagemaker_settings
        from tests.chaos.fake_aws import CREDENTIALS, FakeAws
        from tests.chaos.fake_eks import FakeEks
        from tests.chaos.fake_eks_http import KubeApiServer
        from tests.chaos.multinode import batch_queue, moto

        self.aws = FakeAws(free_port(), workdir / "aws", pending_seconds=1.0, timed_jobs=True,
                           timed_line_seconds=line_seconds).start()
        self.eks = FakeEks(workdir / "eks", {**CREDENTIALS, "AWS_ENDPOINT_URL": self.aws.moto_url,
                                             "AWS_ENDPOINT_URL_S3": self.aws.moto_url})
        self.eks.time_pods(line_seconds=line_seconds)
        self.kube = KubeApiServer(self.eks).start()
        # The submitter's own door to each service: its calls are not counted with the triggers'
        # (the proxy counts the jobs' port apart; each Kubernetes front counts its own).
        self.submit_kube = KubeApiServer(self.eks).start()
        moto(self.aws, "s3").create_bucket(Bucket=BUCKET)
        batch_queue(moto(self.aws, "batch"), moto(self.aws, "iam"), QUEUE)
        staging = f"s3://{BUCKET}/staging"
        every = {"poll_interval_seconds": int(poll)}
        self.settings = {
            "sagemaker": {**sagemaker_settings(BUCKET, aws_conn_id=CONN, staging_uri=staging,
                                               instance_type="ml.m5.xlarge"), **every},
            "batch": {"aws_conn_id": CONN, "job_queue": QUEUE, "staging_uri": staging, "image": IMAGE,
                      "instance_type": "m5.xlarge", **every},
            "hyperpod": {"kubernetes_conn_id": KUBE_CONN, "aws_conn_id": CONN, "staging_uri": staging,
                         "image": IMAGE, "kind": "HyperPodPyTorchJob", "max_retry_count": 0, **every}}
        submit_aws = self.aws.connection()
        submit_aws["extra"] = {**submit_aws["extra"], "endpoint_url": self.aws.jobs_url}
        self.env = {f"AIRFLOW_CONN_{CONN.upper()}": json.dumps(self.aws.connection()),
                    f"AIRFLOW_CONN_{KUBE_CONN.upper()}": json.dumps(self.kube.connection()),
                    f"AIRFLOW_CONN_{SUBMIT_CONN.upper()}": json.dumps(submit_aws),
                    f"AIRFLOW_CONN_{SUBMIT_KUBE_CONN.upper()}": json.dumps(self.submit_kube.connection()),
                    **CREDENTIALS, "AWS_DEFAULT_REGION": REGION}
        self.submit_settings = json.loads(json.dumps(self.settings).replace(f'"{KUBE_CONN}"', f'"{SUBMIT_KUBE_CONN}"')
                                          .replace(f'"{CONN}"', f'"{SUBMIT_CONN}"'))
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True, name="bench-sampler")
        self._sampler.start()

    @staticmethod
    def watched(handle: dict[str, Any]) -> dict[str, Any]:
        """A handle the submitter made, as the triggers watch it: through their own doors."""
        return {**handle, "aws_conn_id": CONN,
                **({"kubernetes_conn_id": KUBE_CONN} if handle.get("kubernetes_conn_id") else {})}

    def counts(self) -> dict[str, int]:
        with self.aws.lock:
            counts = dict(self.aws.operations)
        with self.kube.lock:
            counts.update({f"k8s:{k}": v for k, v in self.kube.counts.items()})
        return counts

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self.counts()))
            self._stop.wait(SAMPLE_SECONDS)

    def ended(self) -> dict[str, dict[str, Any]]:
        """Every job the simulators ran: its key (SageMaker name, Batch id, HyperPod name), when
        the service showed its end, and how it ended."""
        out = {}
        for job in self.aws.sim.report():
            key = job["name"] if job["service"] == "sagemaker" else job["job_id"]
            state = {"Completed": "succeeded", "SUCCEEDED": "succeeded"}.get(job["status"], "failed")
            out[key] = {"ended_at": job["ended_at"], "state": state if job["ended_at"] else None}
        for job in self.eks.report()["jobs"]:
            state = {"Succeeded": "succeeded", "Failed": "failed"}.get(job["status"])
            out[job["name"]] = {"ended_at": job["ended_at"], "state": state if job["ended_at"] else None}
        return out

    def stop(self) -> None:
        self._stop.set()
        self._sampler.join(10)
        self.kube.stop()
        self.submit_kube.stop()
        self.eks.shutdown()
        self.aws.stop()


def job_key(handle: dict[str, Any]) -> str:
    return {"sagemaker": handle.get("job_name"), "batch": handle.get("job_id"),
            "hyperpod": handle.get("k8s_name")}[handle["backend"]]


def job_specs(count: int, tag: str, ends_from: float, spread: float, fail_share: float,
              seed: int) -> list[tuple[Any, float]]:
    """`count` (JobSpec, end time) pairs, a third per backend, each a timed job ending at its own
    moment drawn from [ends_from, ends_from + spread] (epoch s), SIM_EXIT_CODE 1 for
    `fail_share` of them."""
    from llmops.jobs.spec import JobSpec

    rng = random.Random(seed)
    specs = []
    for i in range(count):
        backend = BACKENDS[i % 3]
        specs.append((JobSpec(stage="bench", entrypoint="benchmarks.timed_job", name=f"w{tag}-{i:04d}",
                              backend=backend, image=IMAGE, max_run_seconds=MAX_RUN_SECONDS,
                              env={"SIM_EXIT_CODE": "1" if rng.random() < fail_share else "0"},
                              instance_type={"sagemaker": "ml.m5.xlarge", "batch": "m5.xlarge",
                                             "hyperpod": "ml.g5.2xlarge"}[backend],
                              instance_count=1 if backend == "sagemaker" else 2),
                      ends_from + rng.uniform(0, spread)))
    return specs


def submit_each(settings: dict[str, Any], items: list[tuple[Any, float | None]],
                on_handle: Callable[[dict[str, Any]], None], threads: int = 4) -> None:
    """Submit every (JobSpec, end time) through its backend's own submit(), `threads` at once,
    its SIM_END_AT set to the end time (None: the spec's own SIM_RUN_SECONDS); `on_handle(handle)`
    as each comes (under a lock)."""
    # Imported here, not in the pool's threads (concurrent first imports of airflow deadlock).
    import airflow.providers.cncf.kubernetes.hooks.kubernetes  # noqa: F401
    import llmops.jobs.backends.batch.batch_hook  # noqa: F401
    import llmops.jobs.backends.sagemaker.sagemaker_hook  # noqa: F401
    from llmops.jobs.backends import get_backend

    backends = {name: type(get_backend(name))(settings={name: settings[name]}) for name in BACKENDS}
    lock = threading.Lock()

    def submit(item: tuple[Any, float]) -> None:
        spec, end_at = item
        if end_at is not None:
            spec = spec.replace(env={**spec.env, "SIM_END_AT": f"{end_at:.3f}"})
        handle = backends[spec.backend].submit(spec)
        with lock:
            on_handle(handle)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(submit, items))


def submitter(specs_file: str, handles_file: str, settings_json: str) -> None:
    """The submitting process (`--submit`): submit_each for every spec of `specs_file` (JSON
    lines: the spec and its end time), each handle appended to `handles_file` as it comes (the
    triggers' process starts its trigger), then {"done": true}. Its own process: the simulators'
    and the triggers' processes keep their cores."""
    sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]
    from llmops.jobs.spec import JobSpec

    items = [json.loads(line) for line in Path(specs_file).read_text().splitlines()]

    def append(handle: dict[str, Any]) -> None:
        with open(handles_file, "a") as fh:
            fh.write(json.dumps(World.watched(handle) if "backend" in handle else handle) + "\n")

    submit_each(json.loads(settings_json), [(JobSpec(**i["spec"]), i["end_at"]) for i in items], append)
    append({"done": True})


# -- one side ------------------------------------------------------------------------------------

def run_side(label: str, code: str, count: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Submit `count` jobs (in a process of their own) while a child process runs `code`'s
    trigger for each as it is submitted (a task defers right after its submit); every job ends
    within `--end-spread` seconds after `--quiet-seconds` past the last submission's due time,
    so that all N are watched at once for a while."""
    world = World(work / f"{label}-{count}", args.poll, args.line_seconds)
    child_proc = None
    try:
        handles_file = work / f"{label}-{count}-handles.jsonl"
        handles_file.write_text("")
        out_file = work / f"{label}-{count}-child.json"
        submit_due = count * args.submit_seconds
        ends_from = submit_due + args.quiet_seconds
        timeout = ends_from + args.end_spread + 6 * args.poll + 120
        env = {**os.environ, **world.env, "AIRFLOW_HOME": str(work / "airflow"), "PYTHONPATH": str(ROOT)}
        load0 = os.getloadavg()
        child_proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.triggerer_watch", "--child", code, "--handles", str(handles_file),
             "--child-out", str(out_file), "--poll", str(args.poll), "--timeout", str(timeout),
             "--seed", str(args.seed)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
            stderr=open(work / f"{label}-{count}-child.log", "w"))
        print(f"  {label}: submitting {count} jobs while the child watches ...", flush=True)
        created0 = time.time()
        specs_file = work / f"{label}-{count}-specs.jsonl"
        specs_file.write_text("".join(json.dumps({"spec": dataclasses.asdict(spec), "end_at": end_at}) + "\n"
                                      for spec, end_at in job_specs(count, f"{label[0]}{count}",
                                                                    created0 + ends_from, args.end_spread,
                                                                    args.fail_share, args.seed + count)))
        subprocess.run([sys.executable, "-m", "benchmarks.triggerer_watch", "--submit", str(specs_file),
                        "--handles", str(handles_file), "--settings", json.dumps(world.submit_settings)],
                       cwd=ROOT, env={**os.environ, **world.env, "AIRFLOW_HOME": str(work / "airflow"),
                                      "PYTHONPATH": str(ROOT)},
                       check=True, timeout=timeout, stdout=subprocess.DEVNULL,
                       stderr=open(work / f"{label}-{count}-submit.log", "w"))
        created1 = time.time()
        handles = [h for h in map(json.loads, handles_file.read_text().splitlines()) if not h.get("done")]
        print(f"  {label}: submitted in {created1 - created0:.0f} s (due {submit_due:.0f} s); watching ...",
              flush=True)
        code_ = child_proc.wait(timeout + 300)
        load1 = os.getloadavg()
        if code_ != 0 or not out_file.exists():
            raise RuntimeError(f"the {label} side failed: {(work / f'{label}-{count}-child.log').read_text()[-3000:]}")
        result = json.loads(out_file.read_text())
        time.sleep(SAMPLE_SECONDS)
        return summarize(world, handles, result, count, args.poll, created0, created1, load0, load1)
    finally:
        if child_proc is not None and child_proc.poll() is None:
            child_proc.kill()
        world.stop()


def _cores(samples: list, window: tuple[float, float] | None) -> float | None:
    """CPU cores busy over `window` from (time, CPU seconds) samples."""
    inside = [(t, c) for t, c in samples if window and window[0] <= t <= window[1]]
    if len(inside) < 2:
        return None
    return round((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]), 3)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))], 1)


def rates(samples: list[tuple[float, dict[str, int]]], start: float, end: float) -> dict[str, dict[str, float]]:
    """Per API: the mean calls per second over [start, end] and the busiest 60 s within it."""
    inside = [(t, c) for t, c in samples if start <= t <= end]
    if len(inside) < 2:
        return {}
    ops = sorted({op for _, c in inside for op in c})
    out = {}
    for op in ops:
        total = inside[-1][1].get(op, 0) - inside[0][1].get(op, 0)
        peak = 0.0
        for i, (t0, c0) in enumerate(inside):
            later = [(t, c) for t, c in inside[i:] if t - t0 <= 60.0]
            t1, c1 = later[-1]
            if t1 - t0 >= 30:
                peak = max(peak, (c1.get(op, 0) - c0.get(op, 0)) / (t1 - t0))
        if total:
            out[op] = {"mean_per_minute": round(60 * total / (inside[-1][0] - inside[0][0]), 1),
                       "peak_60s_per_second": round(peak, 2)}
    return out


def against_limits(measured: dict[str, dict[str, float]]) -> dict[str, Any]:
    out = {}
    batch_peak = sum(v["peak_60s_per_second"] for op, v in measured.items() if LIMITS.get(op, {}).get("group") == "batch")
    for op, limit in LIMITS.items():
        m = measured.get(op, {"mean_per_minute": 0.0, "peak_60s_per_second": 0.0})
        peak = batch_peak if limit.get("group") == "batch" else m["peak_60s_per_second"]
        out[op] = {**m, "limit_tps": limit["tps"],
                   "peak_share_of_limit": round(peak / limit["tps"], 3) if limit["tps"] else None,
                   "under_limit": (peak < limit["tps"]) if limit["tps"] else None}
        if limit.get("group") == "batch":
            out[op]["peak_compared"] = "every Batch API's peak together, against their shared limit"
    return out


def summarize(world: World, handles: list[dict], child_result: dict, count: int, poll: float,
              created0: float, created1: float, load0: tuple, load1: tuple) -> dict[str, Any]:
    ended = world.ended()
    delays, by_backend = [], collections.defaultdict(list)
    missed, duplicated, wrong, early, not_ended = [], [], [], [], []
    for i, handle in enumerate(handles):
        job = ended.get(job_key(handle)) or {}
        fired = [e for e in child_result["events"].get(str(i), []) if e["state"] != "progress"]
        if not job.get("ended_at"):
            not_ended.append(handle["name"])
            if fired:
                early.append(handle["name"])
            continue
        if not fired:
            missed.append(handle["name"])
            continue
        if len(fired) > 1:
            duplicated.append(handle["name"])
        if fired[0]["state"] != job["state"]:
            wrong.append(f"{handle['name']}: fired {fired[0]['state']}, ended {job['state']}")
        delay = fired[0]["at"] - job["ended_at"]
        if delay < 0:
            early.append(handle["name"])
        delays.append(delay)
        by_backend[handle["backend"]].append(delay)
    started = sorted(child_result["started"].values())
    first_end = min((e["ended_at"] for e in ended.values() if e.get("ended_at")), default=time.time())
    last_fire = max((e["at"] for evs in child_result["events"].values() for e in evs), default=time.time())
    # Every job watched, none in its first minutes (a Batch submit's 180 s look for copies of a
    # resent SubmitJob, llmops.jobs.backends.batch) and none ended yet.
    steady_from = max(started[-1] + poll, created1 + SETTLE_SECONDS) if started else first_end
    steady = (steady_from, first_end) if first_end > steady_from + 30 else None
    watch_window = (child_result["wall_start"], child_result["wall_end"])
    polls = sum(child_result["polls"].values())
    wall = child_result["wall_end"] - child_result["wall_start"]
    # How often each trigger really polled: its watched time over the polls made (a side whose
    # calls saturate the simulators, or its own process, polls less often than asked).
    watched = sum((evs[0]["at"] if evs else child_result["wall_end"]) - child_result["started"][k]
                  for k, evs in ((k, child_result["events"].get(k, [])) for k in child_result["started"]))
    measured_all = rates(world.samples, *watch_window)
    return {
        "jobs": count, "by_backend": dict(collections.Counter(h["backend"] for h in handles)),
        "submit_seconds": round(created1 - created0, 1),
        "cpu_seconds": round(child_result["cpu_seconds"], 2),
        "watch_seconds": round(wall, 1),
        "cpu_cores_busy": round(child_result["cpu_seconds"] / wall, 3),
        "cpu_cores_busy_steady": _cores(child_result["cpu_samples"], steady),
        "cpu_ms_per_job_per_poll_interval": round(1000 * child_result["cpu_seconds"] / (watched / poll), 2)
        if watched else None,
        "polls": polls, "polls_by_backend": child_result["polls"],
        "achieved_poll_interval_s": round(watched / polls, 1) if polls else None,
        "rss_mib_before": round(child_result["rss_mib_before"], 1),
        "rss_mib_peak": round(child_result["rss_mib_peak"], 1),
        "rss_kib_per_job": round(1024 * (child_result["rss_mib_peak"] - child_result["rss_mib_before"]) / count, 1),
        "completions": {"jobs_ended": len(delays) + len(missed), "fired": len(delays), "missed": len(missed),
                        "duplicated": len(duplicated), "wrong": len(wrong), "early": len(early),
                        "not_ended_in_time": len(not_ended), "examples": (missed + wrong + duplicated + early)[:10]},
        "notice_delay_s": {"p50": _percentile(delays, 0.5), "p99": _percentile(delays, 0.99),
                           "max": round(max(delays), 1) if delays else None,
                           "p99_in_poll_intervals": round(_percentile(delays, 0.99) / poll, 2) if delays else None,
                           "by_backend_p99": {b: _percentile(v, 0.99) for b, v in sorted(by_backend.items())}},
        "calls_steady_window_s": [round(steady[0] - created1, 1), round(steady[1] - created1, 1)] if steady else None,
        "calls_steady": against_limits(rates(world.samples, *steady)) if steady else None,
        "calls_whole_watch": against_limits(measured_all),
        "calls_whole_watch_other": {op: v for op, v in measured_all.items() if op not in LIMITS},
        "last_fire_after_submit_s": round(last_fire - created1, 1),
        "warnings": child_result["warnings"], "first_warnings": child_result["first_warnings"],
        "client_builds": child_result["client_builds"],
        "loadavg_start": [round(x, 2) for x in load0], "loadavg_end": [round(x, 2) for x in load1],
    }


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("apache-airflow", "apache-airflow-providers-amazon", "boto3",
                                    "botocore", "moto", "kubernetes")} | {"python": platform.python_version()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="100,500,1000", help="comma-separated N")
    parser.add_argument("--poll", type=float, default=30.0, help="the backends' poll_interval_seconds")
    parser.add_argument("--submit-seconds", type=float, default=0.3,
                        help="submission time allowed per job: every job ends after N x this + 2 polls")
    parser.add_argument("--quiet-seconds", type=float, default=240.0,
                        help="from the last submission due to the first end: every job is watched then")
    parser.add_argument("--end-spread", type=float, default=150.0, help="the jobs' ends spread over this (s)")
    parser.add_argument("--line-seconds", type=float, default=60.0, help="a log line this often per job")
    parser.add_argument("--fail-share", type=float, default=0.1)
    parser.add_argument("--before", default="a331722", help="the code before shared polling ('none': skip)")
    parser.add_argument("--airflow", type=int, default=0, help="N for the run through a real triggerer (0: none)")
    parser.add_argument("--airflow-submit-seconds", type=float, default=3.0,
                        help="the real run: time allowed per task to submit and defer")
    parser.add_argument("--airflow-quiet-seconds", type=float, default=60.0,
                        help="the real run: from the submissions' budget (plus a Batch look for copies) "
                             "to the first end, while only the triggerer polls: the window its CPU is read in")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/triggerer_watch.json"))
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--handles", help=argparse.SUPPRESS)
    parser.add_argument("--submit", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.handles, args.child_out, args.poll, args.timeout, args.seed)
    if args.submit:
        return submitter(args.submit, args.handles, args.settings)
    sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "plugins"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip())
    work = Path(tempfile.mkdtemp(prefix="triggerer-watch-"))
    os.environ["AIRFLOW_HOME"] = str(work / "airflow")   # nothing of Airflow's lands in ~/airflow
    import logging

    for name in ("fake_aws", "fake_eks", "llmops"):   # a line per job would bury the table
        logging.getLogger(name).setLevel(logging.WARNING)
    sides = {"after": str(ROOT)}
    before_rev = ""
    if args.before != "none":
        before_rev = subprocess.run(["git", "rev-parse", args.before], cwd=ROOT, capture_output=True,
                                    text=True, check=True).stdout.strip()
        subprocess.run(["git", "worktree", "add", "--detach", str(work / "before"), before_rev], cwd=ROOT,
                       check=True, capture_output=True)
        sides = {"before": str(work / "before"), **sides}
    load_start = os.getloadavg()
    results: dict[str, Any] = {}
    try:
        for count in [int(x) for x in args.jobs.split(",") if x]:
            print(f"N = {count}", flush=True)
            results[str(count)] = {label: run_side(label, code, count, args, work) for label, code in sides.items()}
            _print_table(results[str(count)], args.poll)
        airflow = None
        if args.airflow:
            from benchmarks.triggerer_watch_airflow import run_airflow

            airflow = run_airflow(args.airflow, args, work)
    finally:
        if before_rev:
            subprocess.run(["git", "worktree", "remove", "--force", str(work / "before")], cwd=ROOT,
                           capture_output=True)
    load_end = os.getloadavg()
    result = {
        "benchmark": "benchmarks/triggerer_watch.py",
        "what": __doc__.split("\n\n")[2].strip(),
        "git_commit": commit, "uncommitted_plugin_changes": dirty, "before_commit": before_rev,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.machine()},
        "versions": versions(),
        "load": {"loadavg_start": [round(x, 2) for x in load_start], "loadavg_end": [round(x, 2) for x in load_end],
                 "note": "2 cores shared with other work: CPU time (getrusage, /proc) is robust to load, "
                         "delays are not; each side's load is in its own entry"},
        "setup": {"jobs": args.jobs, "poll_interval_s": args.poll,
                  "ends": f"each job ends at a moment drawn uniformly from [N x {args.submit_seconds} s + "
                          f"{args.quiet_seconds:g} s, + {args.end_spread:g} s] after the first submission",
                  "log_line_every_s": args.line_seconds, "fail_share": args.fail_share,
                  "mix": "one third each: SageMaker training (1 instance), Batch multi-node (2 nodes), "
                         "HyperPodPyTorchJob (2 pods)"},
        "limits": LIMITS,
        "results": results,
        "airflow": airflow,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nload {load_start} -> {load_end}; written {args.out}")


def _print_table(by_side: dict[str, dict], poll: float) -> None:
    labels = list(by_side)
    rows = [("CPU cores busy (all N watched)", "cpu_cores_busy_steady"),
            ("CPU ms / job / poll interval", "cpu_ms_per_job_per_poll_interval"),
            ("RSS KiB / job", "rss_kib_per_job"), ("achieved poll interval (s)", "achieved_poll_interval_s")]
    print(f"  {'':34}" + "".join(f"{label:>14}" for label in labels))
    for title, key in rows:
        print(f"  {title:34}" + "".join(f"{by_side[label][key]!s:>14}" for label in labels))
    for key in ("p50", "p99", "max"):
        print(f"  {'notice delay ' + key + ' (s)':34}" + "".join(
            f"{by_side[label]['notice_delay_s'][key]!s:>14}" for label in labels))
    for key in ("missed", "duplicated", "wrong", "early"):
        print(f"  {'completions ' + key:34}" + "".join(
            f"{by_side[label]['completions'][key]!s:>14}" for label in labels))
    ops = sorted({op for label in labels for op, v in (by_side[label]["calls_steady"] or by_side[label]["calls_whole_watch"]).items()
                  if v["mean_per_minute"]})
    for op in ops:
        cells = []
        for label in labels:
            v = (by_side[label]["calls_steady"] or by_side[label]["calls_whole_watch"]).get(op, {})
            cells.append(f"{v.get('mean_per_minute', 0)}/{v.get('peak_60s_per_second', 0)}")
        print(f"  {op + ' /min, peak /s':34}" + "".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    main()
