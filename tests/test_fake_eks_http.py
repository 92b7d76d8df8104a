"""The simulated EKS cluster over HTTP (tests/chaos/fake_eks_http.py): reached as another process
would reach it, through an Airflow Kubernetes connection, KubernetesHook and the real kubernetes
client; nothing patches the backend's `connect`. Errors are the client's ApiException, a lost
answer is a dropped connection."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any, Iterator

import pytest
import urllib3.exceptions

from llmops.jobs.backends import JobState, shared
from llmops.jobs.backends.hyperpod import hyperpod_backend as hyperpod
from llmops.jobs.backends.hyperpod import hyperpod_hook
from llmops.jobs.spec import JobSpec, job_name
from tests.aws_fixtures import CONN_ID, DUMMY_CREDENTIALS, IMAGE
from tests.chaos.fake_eks import FakeEks
from tests.chaos.fake_eks_http import KubeApiServer

KUBE_CONN = "llmops_fake_eks"
BUCKET = "llmops-test"
GROUP, VERSION, PLURAL, NAMESPACE = "kubeflow.org", "v1", "pytorchjobs", "kubeflow"
CREATE = "create_namespaced_custom_object"
FINAL = {JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED}


@pytest.fixture()
def eks(tmp_path, moto_server) -> Iterator[FakeEks]:
    """FakeEks whose pods reach the session's moto for S3."""
    moto_server.bucket(BUCKET)
    fake = FakeEks(tmp_path / "eks", {**DUMMY_CREDENTIALS, "AWS_ENDPOINT_URL": moto_server.endpoint,
                                      "AWS_ENDPOINT_URL_S3": moto_server.endpoint})
    yield fake
    fake.shutdown()


@pytest.fixture()
def server(eks, monkeypatch) -> Iterator[KubeApiServer]:
    """The server, named by the Airflow connection KUBE_CONN; no cached API client."""
    api = KubeApiServer(eks).start()
    monkeypatch.setenv(f"AIRFLOW_CONN_{KUBE_CONN.upper()}", json.dumps(api.connection()))
    hyperpod_hook._CLIENTS.clear()
    yield api
    hyperpod_hook._CLIENTS.clear()   # its client points at a server that is gone
    api.stop()


def kube_api(kind: str = "CustomObjectsApi") -> Any:
    """The kubernetes client's `kind` API over the hook's client for KUBE_CONN."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    from kubernetes import client

    return getattr(client, kind)(KubernetesHook(conn_id=KUBE_CONN).api_client)


def job_body(name: str) -> dict[str, Any]:
    """A PyTorchJob whose one pod exits at once."""
    container = {"name": "pytorch", "image": IMAGE, "command": ["python", "-c", "print('hi')"]}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PyTorchJob",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": {
                "spec": {"containers": [container]}}}}}}


def backend(**settings: Any) -> hyperpod.HyperPodBackend:
    return hyperpod.HyperPodBackend(settings={"hyperpod": {
        "kubernetes_conn_id": KUBE_CONN, "aws_conn_id": CONN_ID, "image": IMAGE,
        "staging_uri": f"s3://{BUCKET}/fake-eks-http", "kind": "PyTorchJob", **settings}})


def sample(prefix: str, **config: Any) -> JobSpec:
    return JobSpec(stage="sample", entrypoint="tests.sample_job", name=job_name(prefix, prefix=prefix),
                   config=config, instance_type="ml.m5.xlarge", max_run_seconds=600)


def wait_for(backend_: hyperpod.HyperPodBackend, handle: dict, states: set[JobState],
             timeout: float = 30.0, logs: list[str] | None = None) -> Any:
    """The first status in `states`; meanwhile the job's log lines read into `logs`."""
    deadline, cursor = time.monotonic() + timeout, None
    while True:
        if logs is not None:
            lines, cursor = backend_.read_logs(handle, cursor)
            logs += lines
            cursor["_next_read"] = 0   # every poll, not every LOG_INTERVAL
        status = backend_.status(handle)
        if status.state in states:
            return status
        assert time.monotonic() < deadline, f"still {status.state} ({status.message}) after {timeout} s"
        time.sleep(0.2)


def test_the_hook_reaches_the_server_and_errors_are_the_clients(server):
    from kubernetes.client.exceptions import ApiException

    api = kube_api()
    assert api.api_client.configuration.host == server.url
    with pytest.raises(ApiException) as missing:
        api.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "nope")
    assert missing.value.status == 404
    assert json.loads(missing.value.body)["reason"] == "NotFound"
    made = api.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, job_body("twice"))
    assert made["metadata"]["uid"] and made["status"]["conditions"][0]["type"] == "Created"
    with pytest.raises(ApiException) as again:
        api.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, job_body("twice"))
    assert again.value.status == 409
    assert json.loads(again.value.body)["reason"] == "AlreadyExists"
    got = api.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "twice")
    assert got["metadata"]["uid"] == made["metadata"]["uid"]


def test_a_lost_answer_is_a_dropped_connection(server, eks):
    """The call takes effect, then the socket closes: urllib3 raises for a POST, and resends a
    GET by itself (the caller never sees that loss), as against a real API server."""
    api = kube_api()
    eks.lose_responses(CREATE, 1)
    with pytest.raises(urllib3.exceptions.ProtocolError):
        api.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, job_body("lost"))
    assert [j["name"] for j in eks.report()["jobs"]] == ["lost"]
    eks.lose_responses("get_namespaced_custom_object", 1)
    assert api.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "lost")["metadata"]["name"] == "lost"
    gets = [m for m, _ in eks.calls if m == "get_namespaced_custom_object"]
    assert len(gets) == 2, "the GET was sent again by urllib3"


def test_a_job_runs_to_success_and_its_pods_log_is_served_as_text(server, eks):
    """Through the server: the job's pod listed by its label and its log read while it runs
    (raw: see the next test for what the client makes of it), then SUCCEEDED from its result."""
    from kubernetes.client.exceptions import ApiException

    hp, core = backend(), kube_api("CoreV1Api")
    handle = hp.submit(sample("http-run", seconds=2))
    served, deadline = "", time.monotonic() + 30
    while (status := hp.status(handle)).state not in FINAL:
        pods = core.list_namespaced_pod(NAMESPACE, label_selector=f"llmops/job={handle['k8s_name']}").items
        try:
            served = core.read_namespaced_pod_log(pods[0].metadata.name, NAMESPACE, timestamps=True,
                                                  _preload_content=False).data.decode() or served
        except (ApiException, IndexError):   # not listed yet, or gone as the job ends
            pass
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    assert status.state is JobState.SUCCEEDED, status.message
    lines = served.splitlines()
    assert "working 0" in [line.partition(" ")[2] for line in lines], served
    assert all(re.match(r"\d{4}-\d\d-\d\dT[\d:.]+Z ", line) for line in lines), served


def test_read_logs_gets_the_jobs_lines_over_http(server, eks):
    """Whole lines, each once: kubernetes client 36 hands a pod log back as the repr of its
    bytes (kubernetes-client/python#2596), so the backend reads it undecoded."""
    hp = backend()
    handle = hp.submit(sample("http-logs", seconds=2))
    logs: list[str] = []
    assert wait_for(hp, handle, FINAL, logs=logs).state is JobState.SUCCEEDED
    assert "working 0" in logs and "working 1" in logs, logs


def test_stopping_a_running_job_deletes_it(server, eks):
    hp = backend()
    handle = hp.submit(sample("http-stop", seconds=60))
    wait_for(hp, handle, {JobState.RUNNING})
    hp.stop(handle)
    deletes = [kw for m, kw in eks.calls if m == "delete_namespaced_custom_object"]
    assert [(kw["name"], kw["propagation_policy"]) for kw in deletes] == [(handle["k8s_name"], "Foreground")]
    assert eks.jobs == {}
    assert hp.status(handle).state is JobState.STOPPED


def test_a_lost_create_answer_leaves_one_job_and_a_handle(server, eks):
    eks.lose_responses(CREATE, 1)
    hp = backend(kind="HyperPodPyTorchJob")
    handle = hp.submit(sample("http-lost", seconds=0))
    report = eks.report()
    assert [j["name"] for j in report["jobs"]] == [handle["k8s_name"]]
    assert [(i["kind"], i["operation"]) for i in report["injections"]] == [("lost", CREATE)]
    assert handle["reattached"] is False and handle["attempt"] == 1


def test_a_lost_host_uses_one_retry_however_long_its_pod_takes_to_die(server, eks, monkeypatch):
    """One host lost is one restart of the job. The simulator's own honesty: a pod slow to die
    (a loaded machine: CI saw it) once let the watcher restart for the pod's -9, then again for
    the loss flagged after it, so a test saw two retries used where the operator spends one."""
    from tests.chaos import fake_eks

    kill = fake_eks.Pod.kill

    def slow_kill(pod: fake_eks.Pod) -> None:
        kill(pod)
        if threading.current_thread() is threading.main_thread():   # lose_host's kill, not the watcher's
            time.sleep(1.0)   # five of the watcher's polls see the pod dead before lose_host goes on

    monkeypatch.setattr(fake_eks.Pod, "kill", slow_kill)
    hp = backend(kind="HyperPodPyTorchJob")
    handle = hp.submit(sample("http-host", seconds=60))
    wait_for(hp, handle, {JobState.RUNNING})
    eks.lose_host(handle["k8s_name"], 0)
    time.sleep(2.0)   # the watcher's ten polls after the loss
    job = eks.job(handle["k8s_name"])
    assert (job.restarts, len(job.pods)) == (1, 1), "one loss: one restart, its pod running"
    hp.stop(handle)


def test_pods_waiting_for_nodes_say_why_through_the_pod_list(server, eks):
    """The unscheduled pods' status (phase, PodScheduled condition) as the API server's JSON,
    read back by the client into V1Pod models."""
    eks.hold_nodes(600)
    hp = backend()
    status = hp.status(hp.submit(sample("http-nodes")))
    assert status.state is JobState.PENDING
    assert status.message.startswith("1 of 1 pods unschedulable: 0/3 nodes are available"), status.message


def test_a_trigger_reads_its_runs_jobs_and_pods_with_one_list_each(server, eks):
    """Shared reads (llmops.jobs.backends.shared): three jobs of one DAG run, polled as a
    triggerer's triggers poll them, read through one list of the run's jobs (by the labels the
    backend puts on them) and one of their pods, through the REST front into the client's models;
    a job someone deleted, gone from the list, is read on its own and told as deleted."""
    eks.time_pods(run_seconds=60)
    hp = backend()
    hp.shared_max_age = shared.max_age_for(3.0)   # as a trigger polling every 3 s sets it
    run = {"dag_id": "sweep", "run_id": "manual__2026-12-01T00:00:00+00:00"}
    handles = [hp.submit(sample(f"http-shared-{i}").replace(tags=run)) for i in range(3)]
    assert handles[0]["run_selector"] == ("app.kubernetes.io/managed-by=llmops,llmops/dag-id=sweep,"
                                          "llmops/run-id=manual__2026-12-01T00_00_00_00_00,llmops/stage=sample")
    before = dict(server.counts)
    statuses = [hp.status(h) for h in handles]
    pods = [hp._first_pod(hyperpod_hook.kube_client(h), h) for h in handles]
    calls = {k: v - before.get(k, 0) for k, v in server.counts.items() if v - before.get(k, 0)}
    assert [s.state for s in statuses] == [JobState.RUNNING] * 3
    assert pods == [f"{h['k8s_name']}-master-0" for h in handles]
    assert calls == {"list_namespaced_custom_object": 1, "list_namespaced_pod": 1}, calls
    eks.delete(handles[1]["k8s_name"])
    time.sleep(1.5)   # past the listed value's freshness for a 3 s poll (a third of it)
    deleted = hp.status(handles[1])
    assert deleted.state is JobState.FAILED and "no longer exists" in deleted.message
