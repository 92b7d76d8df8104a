"""The Kubernetes client side of the hyperpod backend: KubeClient (its EKS token renewed),
the process's one client per cluster (`kube_client`), `connect` (an EKS cluster through the AWS
connection, or a Kubernetes connection), `eks_token`, and `pod_log`. The kubernetes package and
the providers' hooks are imported only when a client is made."""

from __future__ import annotations

import atexit
import base64
import logging
import os
import tempfile
import threading
import time
from typing import Any, Callable

from llmops.jobs.errors import Backoff
from llmops.jobs.watch import call_with_retries

log = logging.getLogger(__name__)
# EKS tokens are valid 15 minutes (a presigned STS URL); renew at 10 so none expires mid-poll.
TOKEN_REFRESH_SECONDS = 600
KUBE_ATTEMPTS = 5   # a call other than a create, while the API server answers 5xx or drops it


class KubeClient:
    """The CustomObjects and CoreV1 APIs over one connection, with its bearer token renewed
    every TOKEN_REFRESH_SECONDS and on a 401 (EKS tokens expire after 15 minutes)."""

    def __init__(self, custom: Any, core: Any, configuration: Any = None,
                 token: Callable[[], str] | None = None):
        self.custom, self.core = custom, core
        self._configuration, self._token = configuration, token
        self._renewed = 0.0
        self._lock = threading.Lock()
        if token:
            self.renew()

    @classmethod
    def from_api_client(cls, api_client: Any, token: Callable[[], str] | None = None) -> "KubeClient":
        from kubernetes import client

        return cls(client.CustomObjectsApi(api_client), client.CoreV1Api(api_client),
                   api_client.configuration, token)

    def renew(self) -> None:
        with self._lock:
            # Read by every client version ('authorization' alias of 'BearerToken' since v36).
            self._configuration.api_key = {"authorization": f"Bearer {self._token()}"}
            self._renewed = time.monotonic()

    def call(self, api: str, method: str, **kwargs: Any) -> Any:
        """`method` of the `api` ("custom" or "core"). A call that is safe to repeat (all but a
        create) is tried again on a transient error, KUBE_ATTEMPTS times in all: the kubernetes
        client retries no 5xx (urllib3 waits out only a 429 or 503 that says `Retry-After`, and
        only for a GET), where botocore retries an AWS call, and a submit or a stop must not fail
        its task on one bad answer. A create is the caller's to resend: it knows its token."""
        if method.startswith("create_"):
            return self._call(api, method, kwargs)
        return call_with_retries(lambda: self._call(api, method, kwargs), method, attempts=KUBE_ATTEMPTS,
                                 backoff=Backoff(base=0.5, cap=8.0), logger=log)

    def _call(self, api: str, method: str, kwargs: dict[str, Any]) -> Any:
        if self._token and time.monotonic() - self._renewed > TOKEN_REFRESH_SECONDS:
            self.renew()
        fn = getattr(getattr(self, api), method)
        try:
            return fn(**kwargs)
        except Exception as exc:
            if getattr(exc, "status", None) != 401 or not self._token:
                raise
        self.renew()
        return fn(**kwargs)


_CLIENTS: dict[tuple[str, ...], Any] = {}   # kube_client's entries (llmops.infra.aws.clients)


def _field(source: Any) -> Callable[[str], str]:
    if isinstance(source, dict):
        return lambda key: str(source.get(key) or "")
    return lambda key: str(getattr(source, key, "") or "")


def client_key(source: Any) -> tuple[str, str, str, str]:
    """Which cluster and connection `source` (settings or a handle) reaches its jobs through."""
    get = _field(source)
    return (get("eks_cluster_name"), get("kubernetes_conn_id"), get("aws_conn_id"), get("region_name"))


def kube_client(source: Any) -> KubeClient:
    """The process's client for the cluster of `source` (settings or a handle), made once and
    made again when its connection's definition changes (llmops.infra.aws.clients); its token renews
    itself (KubeClient)."""
    from llmops.infra.aws import clients

    get = _field(source)
    key = client_key(source)
    return clients.cached(("kube", *key), lambda: connect(*key),
                          (get("kubernetes_conn_id") or get("aws_conn_id"),), store=_CLIENTS)


def connect(eks_cluster_name: str, kubernetes_conn_id: str, aws_conn_id: str,
            region_name: str) -> KubeClient:
    """A client for a Kubernetes connection, or for an EKS cluster (one DescribeCluster; the
    token signed in this process with the AWS connection's session)."""
    if kubernetes_conn_id:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

        return KubeClient.from_api_client(KubernetesHook(conn_id=kubernetes_conn_id).api_client)
    from airflow.providers.amazon.aws.hooks.eks import EksHook
    from kubernetes import client

    eks = EksHook(aws_conn_id=aws_conn_id or None, region_name=region_name or None)
    cluster = eks.conn.describe_cluster(name=eks_cluster_name)["cluster"]
    with tempfile.NamedTemporaryFile("wb", prefix="llmops-eks-ca-", suffix=".crt", delete=False) as ca:
        ca.write(base64.b64decode(cluster["certificateAuthority"]["data"]))
    # The Kubernetes client wants a file; it lives as long as this process's cached client.
    atexit.register(_remove_quietly, ca.name)
    configuration = client.Configuration()
    configuration.host, configuration.ssl_ca_cert = cluster["endpoint"], ca.name
    session, region = eks.get_session(), eks.conn.meta.region_name
    return KubeClient.from_api_client(client.ApiClient(configuration),
                                      token=lambda: eks_token(session, eks_cluster_name, region))


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def eks_token(session: Any, cluster: str, region: str) -> str:
    """What `aws eks get-token` prints: a presigned STS GetCallerIdentity URL naming the
    cluster, base64url-encoded (the provider's eks_get_token, without its subprocess)."""
    from botocore.signers import RequestSigner

    sts = session.client("sts", region_name=region)
    signer = RequestSigner(sts.meta.service_model.service_id, region, "sts", "v4",
                           session.get_credentials(), session.events)
    url = signer.generate_presigned_url(
        {"method": "GET", "url": f"{sts.meta.endpoint_url}/?Action=GetCallerIdentity&Version=2011-06-15",
         "body": {}, "headers": {"x-k8s-aws-id": cluster}, "context": {}},
        region_name=region, expires_in=60, operation_name="")
    return "k8s-aws-v1." + base64.urlsafe_b64encode(url.encode()).decode().rstrip("=")


def pod_log(kube: KubeClient, pod: str, namespace: str, **query: Any) -> str:
    """A pod's log as text. Read undecoded (`_preload_content=False`) and decoded here: the
    kubernetes client 36 turns a text/plain body into `str(bytes)`, "b'...\\n...'" on one line
    (kubernetes-client/python#2596), which would garble every line and the log cursor's timestamps."""
    answer = kube.call("core", "read_namespaced_pod_log", name=pod, namespace=namespace,
                       _preload_content=False, **query)
    return answer.data.decode("utf-8", "replace")
