"""HyperPod without Kueue (no queue_name): a job whose pods wait for nodes is PENDING in the
scheduler's own words (the pods' PodScheduled=False / Unschedulable message), and the task log
says so with the time waited, and again while the wait lasts (issue 21), as the Kueue path says
Kueue's reason. Against the simulated cluster (tests/chaos/fake_eks.py's hold_nodes).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import llmops.airflow.operators.job_operator as job_op
from llmops.jobs import watch as watch_mod
from llmops.jobs.backends import JobState, JobStatus
from llmops.jobs.backends.hyperpod.hyperpod_backend import HyperPodBackend, unschedulable_reason
from llmops.jobs.spec import job_name
from llmops.jobs.watch import JobWatch
from tests.test_backend_hyperpod import eks, hp_settings, spec  # noqa: F401 - fixture
from tests.test_wait_faults import (SUCCEEDED, Clock, ScriptedBackend, context,  # noqa: F401
                                    operator, use_backend)

SCHEDULER = ("0/{n} nodes are available: {n} Insufficient nvidia.com/gpu. preemption: 0/{n} nodes "
             "are available: {n} No preemption victims found for incoming pod.")


@pytest.mark.parametrize("kind, pods", [("PyTorchJob", 4), ("HyperPodPyTorchJob", 4)])
def test_pods_waiting_for_nodes_are_pending_in_the_schedulers_words(eks, kind, pods):
    eks.hold_nodes(600)   # no node comes in this test: no pod starts
    backend = HyperPodBackend(settings=hp_settings(kind=kind, gpus_per_node=8, queue_name=""))
    handle = backend.submit(spec(name=job_name("nodes", kind, prefix="hp-nodes")))
    assert eks.job(handle["k8s_name"]).workload is None   # no Kueue here
    status = backend.status(handle)
    assert status.state is JobState.PENDING, status
    assert status.message == f"{pods} of {pods} pods unschedulable: " + SCHEDULER.format(n=pods + 2)
    assert "started_at" not in status.details
    assert backend.read_logs(handle)[0] == []   # the pods' logs wait for their containers


def test_the_wait_is_said_with_the_time_waited_and_again_while_it_lasts(eks):
    eks.hold_nodes(600)
    backend = HyperPodBackend(settings=hp_settings(kind="PyTorchJob", gpus_per_node=8, queue_name=""))
    handle = backend.submit(spec(name=job_name("said", prefix="hp-said"), instance_count=2))
    now = [eks.job(handle["k8s_name"]).created_at]   # the watch's clock from the job's creation,
    # which status() reports as its submission (queue time counts from the API server's record)
    watch = JobWatch(backend, handle, poll_interval=60, max_run_seconds=3600,
                     clock=lambda: now[0], submitted_at=now[0])
    said = []
    for _ in range(8):   # 8 polls, 5 minutes apart (the simulated clock of the watch)
        step = watch.poll()
        assert not step.done
        said += [step.waiting] if step.waiting else []
        now[0] += 300
    reason = "2 of 2 pods unschedulable: " + SCHEDULER.format(n=4)
    assert said == [f"waiting: {reason} (queued 0 s)",
                    f"still waiting: {reason} (queued 15 min)",
                    f"still waiting: {reason} (queued 30 min)"]


def test_a_kueue_job_still_says_kueues_words(eks):
    eks.hold_for_capacity(600)
    backend = HyperPodBackend(settings=hp_settings(kind="PyTorchJob", gpus_per_node=8))
    handle = backend.submit(spec(name=job_name("kq", prefix="hp-kq")))
    assert backend.status(handle).message.startswith("suspended by Kueue: couldn't assign flavors")


def test_the_reason_reads_client_models_and_dicts_and_survives_a_refused_list():
    def pod(name, **condition):
        return SimpleNamespace(metadata=SimpleNamespace(name=name),
                               status=SimpleNamespace(phase="Pending", conditions=[SimpleNamespace(**condition)]))

    class Kube:
        def __init__(self, items=None, error=None):
            self.items, self.error = items, error

        def call(self, api, method, **kw):
            assert (api, method, kw["label_selector"]) == ("core", "list_namespaced_pod", "llmops/job=j")
            if self.error:
                raise self.error
            return SimpleNamespace(items=self.items)

    handle = {"namespace": "ns", "k8s_name": "j"}
    waiting = dict(type="PodScheduled", status="False", reason="Unschedulable", message="0/1 nodes")
    assert unschedulable_reason(Kube([pod("j-worker-0", **waiting),
                                      pod("j-master-0", type="PodScheduled", status="True",
                                          reason="", message="")]), handle) == \
        "1 of 2 pods unschedulable: 0/1 nodes"
    as_dict = {"metadata": {"name": "j-master-0"}, "status": {"conditions": [waiting]}}
    assert unschedulable_reason(Kube([as_dict]), handle) == "1 of 1 pods unschedulable: 0/1 nodes"
    # scheduled but still pulling its image: not a capacity wait
    assert unschedulable_reason(Kube([pod("j-master-0", type="PodScheduled", status="False",
                                          reason="SchedulingGated", message="gated")]), handle) == ""
    assert unschedulable_reason(Kube(error=PermissionError("403 pods is forbidden")), handle) == ""


def test_the_operator_log_repeats_an_unchanged_wait_every_15_minutes(use_backend, monkeypatch):
    clock = Clock()
    monkeypatch.setattr("time.time", clock.time)
    monkeypatch.setattr("time.sleep", clock.sleep)
    pending = JobStatus(JobState.PENDING, "2 of 2 pods unschedulable: 0/4 nodes are available")
    use_backend(ScriptedBackend([pending] * 40 + [SUCCEEDED]))   # 40 polls, 60 s apart
    op = operator(poll_interval=60)
    op.execute(context())
    said = [m for level, m in op.log.records if level == "info" and "waiting" in m]
    assert said == [f"[job] waiting: {pending.message} (queued 0 s)",
                    f"[job] still waiting: {pending.message} (queued 15 min)",
                    f"[job] still waiting: {pending.message} (queued 30 min)"]
    assert watch_mod.WAITING_REPEAT_SECONDS == 900
