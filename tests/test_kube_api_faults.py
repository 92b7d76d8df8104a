"""What the Kubernetes API does to a HyperPod job on a bad day, over HTTP through the real
kubernetes client (tests/chaos/fake_eks_http.py; the faults are FakeEks's, simulated): its
priority and fairness turns calls away (429 Too Many Requests, `Retry-After`), the API server or
its load balancer answers 500 / 503, a connection drops before the server read the call
(nothing happens) or after it acted (the answer is lost). Each fault must reach the client as
what a real one raises, and a job must be submitted once and watched to its end through them."""

from __future__ import annotations

import json
import time

import pytest
import urllib3.exceptions

from llmops.jobs.backends import JobState
from llmops.jobs.errors import is_transient
from tests.test_fake_eks_http import (CREATE, FINAL, GROUP, NAMESPACE, PLURAL, VERSION, backend,  # noqa: F401
                                      eks, job_body, kube_api, sample, server)

GET = "get_namespaced_custom_object"
READS = [GET, "list_namespaced_custom_object", "list_namespaced_pod", "read_namespaced_pod_log"]


def test_a_reset_call_takes_no_effect_and_urllib3_resends_only_a_get(server, eks):
    api = kube_api()
    eks.inject("reset", [CREATE], count=1)
    with pytest.raises(urllib3.exceptions.ProtocolError):
        api.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, job_body("reset"))
    assert eks.report()["jobs"] == [], "a call reset before the server read it made nothing"
    api.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, job_body("reset"))
    eks.inject("reset", [GET], count=1)
    assert api.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "reset")["metadata"]["name"] == "reset"
    assert [(i["kind"], i["operation"]) for i in eks.report()["injections"]] == [("reset", CREATE), ("reset", GET)]


@pytest.mark.parametrize("status,reason", [(429, "TooManyRequests"), (500, "InternalError"),
                                           (503, "ServiceUnavailable")])
def test_a_turned_away_call_is_the_clients_api_exception_and_worth_retrying(server, eks, status, reason):
    from kubernetes.client.exceptions import ApiException

    api = kube_api()
    eks.inject(str(status), [CREATE], count=1)
    with pytest.raises(ApiException) as refused:
        api.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, job_body("refused"))
    assert refused.value.status == status
    assert json.loads(refused.value.body)["reason"] == reason
    if status == 429:
        assert refused.value.headers["Retry-After"] == "1"
    assert is_transient(refused.value)
    assert eks.report()["jobs"] == [], "a refused create made nothing"
    api.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, job_body("refused"))


def test_a_rate_hits_about_its_share_of_calls_and_a_window_closes(eks):
    """In-process: half the reads answered 503 for 1 s from the first hit, then none."""
    eks.inject("503", [GET], rate=0.5, seconds=1.0, run_id="")
    outcomes = []
    for _ in range(60):
        try:
            eks.call("custom", GET, group=GROUP, version=VERSION, plural=PLURAL, name="none",
                     namespace=NAMESPACE)
        except Exception as exc:  # noqa: BLE001 - 404 (no such job) or the injected 503
            outcomes.append(getattr(exc, "status", None))
    assert 15 <= outcomes.count(503) <= 45, outcomes
    time.sleep(1.1)
    later = []
    for _ in range(20):
        with pytest.raises(Exception) as answer:
            eks.call("custom", GET, group=GROUP, version=VERSION, plural=PLURAL, name="none",
                     namespace=NAMESPACE)
        later.append(answer.value.status)
    assert later == [404] * 20, "the window closed"


def test_a_job_is_made_once_and_watched_to_success_through_a_bad_api_server(server, eks):
    """Its submit meets a 500 on its first read, a 500 and a reset on its create and a lost
    answer to the resend; a third of its status reads are throttled (429, which urllib3 waits
    out by `Retry-After` for a GET) or fail (503, which it does not). One job is made and its
    success read, each status read here called once: the backend's client retries a read that
    failed on the server's side, as botocore retries an AWS call (the kubernetes client retries
    no 5xx)."""
    eks.inject("500", [GET], count=1)
    eks.inject("500", [CREATE], count=1)
    eks.inject("reset", [CREATE], count=1)
    eks.inject("lost", [CREATE], count=1)
    eks.inject("429", READS, rate=0.15, seconds=600)
    eks.inject("503", READS, rate=0.2, seconds=600)
    hp = backend(kind="HyperPodPyTorchJob")
    handle = hp.submit(sample("bad-day", seconds=20))
    deadline = time.monotonic() + 120
    while (status := hp.status(handle)).state not in FINAL:
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    assert status.state is JobState.SUCCEEDED, status.message
    report = eks.report()
    assert [j["name"] for j in report["jobs"]] == [handle["k8s_name"]]
    hits = {(i["kind"], i["operation"]) for i in report["injections"]}
    assert {("500", GET), ("500", CREATE), ("reset", CREATE), ("lost", CREATE)} <= hits
    assert {"429", "503"} <= {kind for kind, operation in hits if operation != CREATE}


def test_a_job_deleted_by_someone_else_fails_the_try_and_the_retry_makes_the_next_attempt(server, eks):
    """`kubectl delete` (the console's stop): the backend is not told, and finds the job gone.
    The try fails saying so; the retry's submit counts the deleted job as an attempt, as
    SageMaker's retry makes `-r2`, so its job has a name, log and result of its own."""
    hp = backend(kind="HyperPodPyTorchJob")
    spec = sample("deleted", seconds=30)
    first = hp.submit(spec)
    deadline = time.monotonic() + 60
    while hp.status(first).state is not JobState.RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    eks.delete(first["k8s_name"])
    gone = hp.status(first)
    assert gone.state is JobState.FAILED
    assert "no longer exists: it was deleted, not by this task" in gone.message
    retry = hp.submit(spec)
    assert (retry["attempt"], retry["reattached"]) == (2, False)
    assert retry["k8s_name"] != first["k8s_name"] and retry["result_uri"] != first["result_uri"]
    assert [j["name"] for j in eks.report()["jobs"]] == [first["k8s_name"], retry["k8s_name"]]
