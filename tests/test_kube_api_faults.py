"""What the Kubernetes API does to a HyperPod job on a bad day, over HTTP through the real
kubernetes client (tests/chaos/fake_eks_http.py; the faults are FakeEks's, simulated): its
priority and fairness turns calls away (429 Too Many Requests, `Retry-After`), the API server or
its load balancer answers 500 / 503, a connection drops before the server read the call
(nothing happens) or after it acted (the answer is lost). Each fault must reach the client as
what a real one raises."""

from __future__ import annotations

import json
import time

import pytest
import urllib3.exceptions

from llmops.jobs.errors import is_transient
from tests.test_fake_eks_http import (CREATE, GROUP, NAMESPACE, PLURAL, VERSION, eks, job_body,  # noqa: F401
                                      kube_api, server)

GET = "get_namespaced_custom_object"


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
