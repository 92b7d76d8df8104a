"""Many deferred jobs watched by one triggerer process: every job's end is noticed, once, with
the state it ended in, within two poll intervals; the triggers' status reads are shared (one
DescribeJobs for many Batch jobs, one list of changed SageMaker jobs, one Kubernetes list for a
run's HyperPod jobs and their pods); and a throttling storm on those reads misses no job.

Simulated (tests/chaos/fake_aws/, tests/chaos/fake_eks.py over its HTTP front): the services and
their jobs, timed jobs without a container (each runs its SIM_RUN_SECONDS and ends with its
SIM_EXIT_CODE, as benchmarks/triggerer_watch.py runs hundreds); real: the backends' submit, the
trigger JobOperator defers to (llmops.airflow.triggers.job_trigger.JobTrigger), all in one asyncio
loop with its polls in the loop's thread pool, as Airflow's triggerer runs them, and botocore and
the kubernetes client against the simulators over HTTP.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import time

import pytest

from benchmarks import triggerer_watch as bench

POLL = 5.0       # the backends' shortest poll interval (remote_settings.MIN_POLL_INTERVAL)
LOG_LAG = 5.0    # min(poll interval, the CloudWatch backends' 10 s): the read after a job's end
JOBS = 18        # six per backend


@pytest.fixture
def world(tmp_path, monkeypatch):
    world = bench.World(tmp_path / "world", POLL, line_seconds=2.0)
    for key, value in world.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AIRFLOW__LLMOPS__CLOUDWATCH_LOG_READS_PER_SECOND", "0")
    from llmops.infra.aws import clients
    from llmops.jobs.backends.hyperpod import hyperpod_hook

    clients.clear()
    hyperpod_hook._CLIENTS.clear()
    try:
        yield world
    finally:
        world.stop()


def watch(world, run: tuple[float, float], fail_share: float = 0.25, seed: int = 3, submitted=lambda: None):
    """Submit JOBS timed jobs, each running a time drawn from `run` (s), and run a trigger for
    each as its job is submitted (a task defers right after its submit), all in one loop until
    every trigger fired; (handles, events per job, polls per backend, calls of the triggers).
    `submitted()` is called once every job is submitted and its trigger started."""
    from llmops.jobs import watch as watch_module

    rng = random.Random(seed)
    specs = [(spec.replace(env={**spec.env, "SIM_RUN_SECONDS": f"{rng.uniform(*run):.1f}"}), None)
             for spec, _ in bench.job_specs(JOBS, f"t{seed}", 0, 0, fail_share, seed)]
    polls = collections.Counter()
    real_poll = watch_module.JobWatch.poll

    def counted(self):
        polls[self.handle["backend"]] += 1
        return real_poll(self)

    handles: list[dict] = []
    events: dict[str, list[dict]] = collections.defaultdict(list)
    before = world.counts()

    async def all_of_them():
        loop, arrived = asyncio.get_running_loop(), asyncio.Queue()
        # submitted through doors of their own (World.submit_settings): not counted as the triggers'
        submitting = loop.run_in_executor(None, bench.submit_each, world.submit_settings, specs,
                                          lambda h: loop.call_soon_threadsafe(arrived.put_nowait, world.watched(h)))
        watching = []
        for _ in range(JOBS):
            handle = await asyncio.wait_for(arrived.get(), 120)
            handles.append(handle)
            watching.append(asyncio.create_task(bench.watch_job(handle, POLL, events[handle["name"]].append)))
        await submitting
        submitted()
        await asyncio.wait_for(asyncio.gather(*watching), run[1] + 60)

    watch_module.JobWatch.poll = counted
    try:
        asyncio.run(all_of_them())
    finally:
        watch_module.JobWatch.poll = real_poll
    after = world.counts()
    return handles, events, polls, {op: after.get(op, 0) - before.get(op, 0) for op in after}


def check_every_end_noticed_once(world, handles, events) -> list[float]:
    """Every job ended; its trigger fired once, after the end, with the end's state. The delays."""
    ended, delays = world.ended(), []
    for handle in handles:
        job = ended[bench.job_key(handle)]
        fired = events[handle["name"]]
        assert job["ended_at"], f"{handle['name']} never ended"
        assert [e["state"] for e in fired] == [job["state"]], (handle["name"], fired, job)
        assert fired[0]["at"] >= job["ended_at"], f"{handle['name']} fired before its job ended"
        delays.append(fired[0]["at"] - job["ended_at"])
    return delays


def test_every_end_is_noticed_once_within_two_poll_intervals_with_shared_reads(world, monkeypatch):
    # A Batch submit's status looks for copies of a resent SubmitJob for 180 s (ListJobs and
    # DescribeJobs each poll: tests/test_backend_batch.py); 1 s here, so these polls show the rest.
    monkeypatch.setattr("llmops.jobs.backends.batch.batch_backend.SUBMIT_WINDOW_SECONDS", 1.0)
    handles, events, polls, calls = watch(world, run=(15, 25))
    delays = check_every_end_noticed_once(world, handles, events)
    # A third of an interval's staleness and the CloudWatch read after the end at most, on top
    # of the poll interval itself (slack for this shared 2-core machine).
    assert max(delays) <= 2 * POLL + LOG_LAG + 3, sorted(delays)
    # Shared: each Batch poll reads its job and its node jobs (two DescribeJobs when alone), each
    # SageMaker poll its description, each HyperPod poll its job and its pods (a get and a list):
    # here far fewer calls than that answer them all, and no HyperPod job is read on its own.
    assert calls.get("DescribeJobs", 0) <= polls["batch"], (calls, polls)
    assert calls.get("DescribeTrainingJob", 0) <= polls["sagemaker"] / 2, (calls, polls)
    assert calls.get("ListTrainingJobs", 0) >= 1
    assert calls.get("k8s:get_namespaced_custom_object", 0) == 0, calls
    assert calls.get("k8s:list_namespaced_custom_object", 0) <= polls["hyperpod"] / 2, (calls, polls)
    assert calls.get("k8s:list_namespaced_pod", 0) <= polls["hyperpod"] / 2, (calls, polls)


def test_a_throttling_storm_on_the_shared_reads_misses_no_job_and_stops_none(world):
    """Half of every status and log read throttled (Batch 429, SageMaker and Logs
    ThrottlingException, the Kubernetes API's 429) for the jobs' whole run: the clients' retries
    and the triggers' backoff ride it out; each job's end is still noticed once, none stopped."""
    storm = {"operations": ["DescribeJobs", "ListJobs", "DescribeTrainingJob", "ListTrainingJobs",
                            "GetLogEvents", "DescribeLogStreams"], "kind": "throttle", "rate": 0.5, "seed": 1}
    world.aws.faults.set([storm])
    world.eks.inject("429", ["list_namespaced_custom_object", "list_namespaced_pod",
                             "get_namespaced_custom_object", "read_namespaced_pod_log"], rate=0.5, seconds=45)
    # From the first submission to 45 s after the last, whenever that is: on a loaded machine the
    # 18 submissions alone take 10-50 s, and a storm of a fixed 45 s could end before the last
    # jobs' first SageMaker read (no SageMaker fault landed). The Kubernetes rule's window opens
    # at its first hit.
    handles, events, polls, calls = watch(world, run=(15, 25), seed=5,
                                          submitted=lambda: world.aws.faults.set([{**storm, "seconds": 45}]))
    check_every_end_noticed_once(world, handles, events)
    injected = collections.Counter(i["operation"] for i in world.aws.faults.injections)
    assert injected["DescribeJobs"] and injected["ListTrainingJobs"] + injected["DescribeTrainingJob"]
    assert [i for i in world.eks.injections if i["kind"] == "429"]
    assert not [j for j in world.aws.sim.report() if j["stop_requests"]]
    assert not [j for j in world.eks.report()["jobs"] if j["deleted_at"]]


def test_a_deferred_sagemaker_wait_keeps_the_connections_botocore_config(world, monkeypatch):
    """The amazon provider's deferred SageMaker triggers built their hook without the
    operator's botocore config. Here there is nothing to carry: a trigger, on whatever triggerer,
    builds its clients (the describe, the shared list, the log reads) from the connection the
    handle names, whose config_kwargs they keep (the connection's `retries` over our adaptive
    default, llmops.infra.aws.retry), so the deferred wait retries and times out as the
    operator's."""
    from llmops.infra.aws import clients
    from llmops.jobs.backends.sagemaker.sagemaker_hook import jobs_hook

    connection = json.loads(world.env[f"AIRFLOW_CONN_{bench.CONN.upper()}"])
    connection["extra"]["config_kwargs"] = {"read_timeout": 11, "retries": {"mode": "standard", "max_attempts": 4}}
    monkeypatch.setenv(f"AIRFLOW_CONN_{bench.CONN.upper()}", json.dumps(connection))
    clients.clear()
    [(spec, _)] = [s for s in bench.job_specs(3, "cfg", 0, 0, 0.0, 1) if s[0].backend == "sagemaker"]
    handles: list[dict] = []
    bench.submit_each(world.submit_settings, [(spec.replace(env={"SIM_RUN_SECONDS": "3"}), None)], handles.append)
    events: list[dict] = []
    asyncio.run(bench.watch_job(world.watched(handles[0]), POLL, events.append))
    assert [e["state"] for e in events] == ["succeeded"]
    built = dict(clients.builds)
    hook = jobs_hook(bench.CONN, "")
    assert clients.builds == built, "the hook looked at is the one the trigger polled with"
    for client in (hook.get_conn(), hook.logs_hook.get_conn()):
        assert client.meta.config.read_timeout == 11
        assert client.meta.config.retries == {"mode": "standard", "total_max_attempts": 5}
