"""FakeEks (tests/chaos/fake_eks.py) over HTTP: the Kubernetes REST API the kubernetes client
speaks, on 127.0.0.1, so that processes other than the test's (Airflow's workers, its triggerer)
reach the simulated cluster through a real Kubernetes connection (`connection()`), as they would
reach EKS.

Only the transport is real: everything behind it (objects, pods, logs, Kueue, faults) is FakeEks.
Served: the custom objects' get / create / delete / list, the pods listed by label and a pod's
log, which is all the HyperPod backend calls; an `ApiError` is that HTTP status with a
Kubernetes `Status` body (a 429 with `Retry-After`), an unknown path a 404. A lost response or a
reset (`FakeEks.inject`) is a real dropped connection: the socket is closed before any byte of
the answer (after the call took effect, or before), so the client's urllib3 raises
ProtocolError ("Connection aborted.") for a POST and, as against a real API server, retries a
GET or DELETE by itself.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, urlsplit

import urllib3.exceptions

from tests.chaos.fake_eks import ApiError, FakeEks

CUSTOM = re.compile(r"/apis/(?P<group>[^/]+)/(?P<version>[^/]+)/namespaces/(?P<namespace>[^/]+)"
                    r"/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?")
PODS = re.compile(r"/api/v1/namespaces/(?P<namespace>[^/]+)/pods(?:/(?P<name>[^/]+)/log)?")
REASONS = {400: "BadRequest", 404: "NotFound", 409: "AlreadyExists", 429: "TooManyRequests",
           500: "InternalError", 503: "ServiceUnavailable"}
TRUE = ("1", "t", "T", "true", "TRUE", "True")   # Go's strconv.ParseBool: the client sends "True"
# query parameter -> FakeEks keyword, and how to read it (only those the request carries)
LOG_QUERY = {"timestamps": ("timestamps", lambda v: v in TRUE),
             "tailLines": ("tail_lines", int), "sinceSeconds": ("since_seconds", int)}


class _Dropped(Exception):
    """The answer is lost: close the connection without writing a byte."""


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def to_json(value: Any) -> Any:
    """A kubernetes client model as FakeEks gives it (SimpleNamespace, snake_case attributes) in
    the API server's JSON (camelCase keys)."""
    if isinstance(value, SimpleNamespace):
        value = vars(value)
    if isinstance(value, dict):
        return {_camel(k): to_json(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    return value


def status_body(code: int, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": REASONS.get(code, "InternalError"), "code": code}


class KubeApiServer:
    """FakeEks behind the Kubernetes REST API on 127.0.0.1:`port`."""

    def __init__(self, eks: FakeEks):
        self.eks = eks
        # Calls served through this front, by method: several fronts to one cluster tell apart
        # whose calls they were (a benchmark's submitter from the triggers it measures).
        self.counts: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        # port 0: the kernel picks a free one as it binds, so no other server can take it first
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(eks, self))
        self.port: int = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._httpd.daemon_threads = True   # a keep-alive connection must not hold up stop()
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name=f"kube-api-{self.port}")

    def start(self) -> "KubeApiServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():   # shutdown() waits for a serve_forever that never ran
            self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def connection(self) -> dict[str, Any]:
        """An Airflow Kubernetes connection to this server (`AIRFLOW_CONN_<ID>` as JSON): an inline
        kubeconfig, so KubernetesHook neither tries the in-cluster config nor reads ~/.kube; an
        http:// server, so no TLS; a token, as EKS's users have (nothing checks it)."""
        kubeconfig = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake-eks",
            "clusters": [{"name": "fake-eks", "cluster": {"server": self.url}}],
            "users": [{"name": "fake-eks", "user": {"token": "fake-eks-token"}}],
            "contexts": [{"name": "fake-eks", "context": {"cluster": "fake-eks", "user": "fake-eks"}}]}
        return {"conn_type": "kubernetes", "extra": {"kube_config": kubeconfig}}


def _handler(eks: FakeEks, front: "KubeApiServer") -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"   # keep-alive, as the API server: urllib3 reuses connections

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def _serve(self, verb: str) -> None:
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""   # read whole: keep-alive goes on
            try:
                answer = self._route(verb, url.path, query, json.loads(body) if body else None)
                code = 201 if verb == "POST" else 200   # the client reads a create's object on 201 only
            except _Dropped:
                self.close_connection = True   # nothing written: the client sees the socket close
                return
            except ApiError as exc:
                code, answer = exc.status, status_body(exc.status, f"{verb} {url.path}: {exc}")
            except ValueError as exc:   # a body that is not JSON
                code, answer = 400, status_body(400, str(exc))
            except Exception as exc:  # noqa: BLE001 - a simulator bug, said to the client
                code, answer = 500, status_body(500, f"{type(exc).__name__}: {exc}")
            text = isinstance(answer, str)
            data = answer.encode() if text else json.dumps(answer).encode()
            self.send_response(code)
            if code == 429:   # the API server's priority and fairness says when to come back
                self.send_header("Retry-After", "1")
            self.send_header("Content-Type", "text/plain" if text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, verb: str, path: str, query: dict[str, str], body: Any) -> Any:
            if (match := CUSTOM.fullmatch(path)) is not None:
                kw = {k: v for k, v in match.groupdict().items() if v is not None}
                if verb == "GET" and "name" in kw:
                    return self._call("custom", "get_namespaced_custom_object", **kw)
                if verb == "GET":
                    if "labelSelector" in query:
                        kw["label_selector"] = query["labelSelector"]
                    return self._call("custom", "list_namespaced_custom_object", **kw)
                if verb == "POST" and "name" not in kw:
                    return self._call("custom", "create_namespaced_custom_object", body=body, **kw)
                if verb == "DELETE" and "name" in kw:
                    policy = query.get("propagationPolicy") or (body or {}).get("propagationPolicy")
                    if policy:
                        kw["propagation_policy"] = policy
                    return self._call("custom", "delete_namespaced_custom_object", **kw)
            if (match := PODS.fullmatch(path)) is not None and verb == "GET":
                namespace, name = match.group("namespace"), match.group("name")
                if name is None:
                    pods = self._call("core", "list_namespaced_pod", namespace=namespace,
                                      label_selector=query.get("labelSelector", ""))
                    return {"apiVersion": "v1", "kind": "PodList", "metadata": {},
                            "items": to_json(pods.items)}
                options = {kw: read(query[param]) for param, (kw, read) in LOG_QUERY.items()
                           if param in query}
                return self._call("core", "read_namespaced_pod_log", name=name, namespace=namespace,
                                  **options)
            raise ApiError(404)

        @staticmethod
        def _call(api: str, method: str, **kw: Any) -> Any:
            with front.lock:
                front.counts[method] += 1
            try:
                return eks.call(api, method, **kw)
            except urllib3.exceptions.ProtocolError as exc:   # FakeEks lost this answer
                raise _Dropped() from exc

        def log_message(self, format: str, *args: Any) -> None:
            pass   # one line per request on stderr would bury the test's own output

    return Handler
