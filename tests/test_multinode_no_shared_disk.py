"""A 2-node pretraining job whose nodes share no disk, on HyperPod (both job kinds), driven through
the project's own backend against tests/chaos/fake_eks.py (harness: tests/chaos/multinode.py).
Batch and SageMaker prove the same (node 1's host lost, fresh disks, the newest complete
checkpoint restored from S3, the job ending seconds after its last step) inside a whole chain of
attempts: tests/test_multiweek.py.

What is real: the backends' requests (validated by botocore, stored by moto), S3 (moto), the
image's entry (docker/job_entry.py) on every node, torchrun's rendezvous across the two nodes,
the supervisor and the training loop with DDP on gloo, MLflow. What is simulated: the services
running the containers, one per node, each on its own empty work dir and TMPDIR (a new attempt
gets new ones), the SageMaker toolkit's torchrun across instances, the Kubernetes API, the
HyperPod / Kubeflow operators and HyperPod's agent (torchrun), a node's host dying.

Each backend, one test:
1. the first attempt trains until rank 1 (node 1) hangs at HANG_STEP, and node 1's host dies:
   the attempt fails as the service fails it (HyperPod restarts the job's pods on new nodes);
2. the next attempt starts on fresh disks, restores the newest complete checkpoint from the run's
   storage in S3 before its first step, and finishes: it lost at most one checkpoint interval;
3. the job ends within END_BUDGET_S of its last step in the log (before: ~300 s, node 1 waiting
   for a result file on node 0's disk until torchrun's exit barrier gave up);
4. the result's checkpoint URI names a complete checkpoint (its manifest, written last) in S3.
"""

from __future__ import annotations

import re
import time

import pytest

from llmops.jobs.backends import JobState, remote
from llmops.jobs.spec import JobSpec
from tests.chaos import multinode as mn
from tests.chaos.fake_aws import FakeAws

pytestmark = pytest.mark.timeout(900)

MAX_STEPS, INTERVAL, HANG_STEP = 60, 10, 35
END_BUDGET_S = 30.0


@pytest.fixture(scope="module")
def fake(tmp_path_factory, tiny_data_dir):
    with mn.running_fake(tmp_path_factory.mktemp("fake-aws"), tiny_data_dir) as server:
        yield server


def wait_for_line(platform: mn.Platform, handle: dict, pattern: re.Pattern, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(pattern.search(line) for _, line in platform.events(handle)):
            return
        status = platform.backend.status(handle)
        assert status.state in (JobState.PENDING, JobState.RUNNING), \
            f"job {handle['job_name']} ended ({status.state}: {status.message}) before {pattern.pattern!r}"
        time.sleep(1)
    raise TimeoutError(f"no line {pattern.pattern!r} from {handle['job_name']} after {timeout} s")


def run_two_nodes_lose_one(platform: mn.Platform, spec: JobSpec, server: FakeAws) -> dict:
    backend = platform.backend
    first = backend.submit(spec)
    # rank 1 (node 1) stops in step HANG_STEP; rank 0 waits for it in that step's all-reduce
    wait_for_line(platform, first, re.compile(rf"\bstep {HANG_STEP - 1}/{MAX_STEPS} \|"), timeout=300)
    reached = HANG_STEP - 1
    uri = remote.plan(spec, first["job_name"], platform.staging).checkpoint_uri   # every attempt's
    deadline = time.monotonic() + 60   # the last checkpoint's upload may still be under way
    while mn.newest_complete_step(server, uri) < reached - reached % INTERVAL and time.monotonic() < deadline:
        time.sleep(0.5)
    lost_at = time.time()
    platform.lose_node_1(first)

    # Fresh nodes, empty disks: a new attempt (Batch, SageMaker) or the same job restarted by
    # HyperPod's auto-resume.
    handle = platform.continue_after_loss(spec, first)
    done = mn.wait_state(backend, handle, {JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED}, 420)
    events = [(t, line) for t, line in platform.events(handle) if t >= lost_at]
    text = "\n".join(line for _, line in events)
    assert done.state is JobState.SUCCEEDED, f"{done.message}\n{text[-4000:]}"

    # 2. restored from the run's storage before the first step; lost at most one interval
    resumed = [m for _, line in events if (m := mn.RESUME_LINE.search(line))]
    assert resumed, f"the next attempt did not restore a checkpoint:\n{text[-4000:]}"
    restored_step = int(resumed[0].group(2))
    first_step = min(int(m.group(1)) for _, line in events if (m := mn.STEP_LINE.search(line)))
    assert first_step == restored_step + 1, (first_step, restored_step)
    assert reached - restored_step <= INTERVAL, \
        f"lost {reached - restored_step} steps (reached {reached}, restored {restored_step})"

    # 3. the job ends within seconds of its last step
    last_step_at = max(t for t, line in events if mn.STEP_LINE.search(line))
    idle = platform.ended_at(handle) - last_step_at
    others = max(platform.node_ends(handle)[1:]) - last_step_at   # nothing left to do there
    print(f"{type(backend).__name__}: end of job {idle:.1f} s after the last step, node 1 exited "
          f"{others:.1f} s after it; lost {reached - restored_step} steps (reached {reached}, "
          f"restored {restored_step})")
    assert idle <= END_BUDGET_S, f"the job ended {idle:.0f} s after its last step"
    assert others <= END_BUDGET_S, f"node 1 exited {others:.0f} s after the last step"

    # 4. the result names a complete checkpoint in S3: the newest one, the final step's
    checkpoint = done.result["outputs"]["checkpoint"]
    assert checkpoint.startswith(uri.rstrip("/") + "/"), (checkpoint, uri)
    bucket, _, key = checkpoint[len("s3://"):].partition("/")
    mn.moto(server, "s3").head_object(Bucket=bucket, Key=f"{key}/manifest.json")
    assert checkpoint.endswith(f"step_{MAX_STEPS:06d}") and mn.newest_complete_step(server, uri) == MAX_STEPS
    assert done.result["metrics"]["step"] == MAX_STEPS
    return handle


@pytest.mark.parametrize("backend", ("HyperPodPyTorchJob", "PyTorchJob"))
def test_two_nodes_no_shared_disk(fake, backend, tmp_path, monkeypatch):
    from llmops.jobs.backends.hyperpod import hook as hyperpod

    monkeypatch.setattr(hyperpod, "connect", hyperpod.connect)   # restored after a HyperPod case
    platform = mn.platform(fake, backend, tmp_path)
    try:
        spec = mn.pretrain_spec(f"mn-{backend.lower()[:9]}", max_steps=MAX_STEPS, interval=INTERVAL,
                                faults=f"hang@{HANG_STEP}:1", instance_type=platform.instance_type)
        handle = run_two_nodes_lose_one(platform, spec, fake)
        if platform.eks is not None:
            job = platform.eks.job(handle["k8s_name"])
            assert job.restarts == 1 and job.generation == 2, "one restart, on replaced nodes"
    finally:
        platform.close()
