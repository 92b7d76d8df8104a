"""A 2-node pretraining job whose nodes share no disk, on HyperPod (both job kinds), driven through
the project's own backend against tests/chaos/fake_eks.py (harness: tests/chaos/multinode.py,
lose_a_node_mid_run). Its config does not name checkpoint_uri: the stage's checkpoints leave the
node all the same. Batch and SageMaker prove the same (node 1's host lost, fresh disks, the newest
complete checkpoint restored from S3, the job ending seconds after its last step) in
tests/test_node_loss_every_stage.py (with fine-tuning and distillation on all three) and inside
a whole chain of attempts: tests/test_multiweek.py (both in `make test-slow`).

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

import pytest

from tests.chaos import multinode as mn

pytestmark = pytest.mark.timeout(900)

MAX_STEPS, INTERVAL, HANG_STEP = 60, 10, 35
END_BUDGET_S = 30.0


@pytest.fixture(scope="module")
def fake(tmp_path_factory, tiny_data_dir):
    with mn.running_fake(tmp_path_factory.mktemp("fake-aws"), tiny_data_dir) as server:
        yield server


@pytest.mark.parametrize("backend", ("HyperPodPyTorchJob", "PyTorchJob"))
def test_two_nodes_no_shared_disk(fake, backend, tmp_path, monkeypatch):
    from llmops.jobs.backends.hyperpod import hyperpod_hook as hyperpod

    monkeypatch.setattr(hyperpod, "connect", hyperpod.connect)   # restored after a HyperPod case
    platform = mn.platform(fake, backend, tmp_path)
    try:
        spec = mn.pretrain_spec(f"mn-{backend.lower()[:9]}", max_steps=MAX_STEPS, interval=INTERVAL,
                                faults=f"hang@{HANG_STEP}:1", instance_type=platform.instance_type)
        handle, _ = mn.lose_a_node_mid_run(platform, spec, fake, node=1, hang_step=HANG_STEP,
                                           end_budget_s=END_BUDGET_S)
        if platform.eks is not None:
            job = platform.eks.job(handle["k8s_name"])
            assert job.restarts == 1 and job.generation == 2, "one restart, on replaced nodes"
    finally:
        platform.close()
