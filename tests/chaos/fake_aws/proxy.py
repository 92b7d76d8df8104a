"""The proxy every AWS client is pointed at (`ProxyHandler`: faults first, then the simulator or moto),
`FakeAws` (moto, the two proxy ports and the simulator in this process) and `ChaosClient` (the
control API under /_chaos/)."""

from __future__ import annotations

import collections
import http.client
import json
import logging
import re
import socket
import struct
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from tests.aws_fixtures import REGION, free_port
from tests.chaos.fake_aws.faults import Answer, Call, Faults, fault_answer, identify, json_answer
from tests.chaos.fake_aws.simulator import Simulator

log = logging.getLogger("fake_aws")


# -- the proxy -----------------------------------------------------------------------------------

PACE_CHUNK = 64 << 10   # bytes written between the bandwidth cap's waits
HOP_HEADERS = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
               "upgrade", "expect", "content-length"}


class S3Request(NamedTuple):
    """One S3 request the proxy answered (FakeAws.s3_log): when its answer was sent, from which
    port, the operation, the path (/bucket/key?query), its Range header and its body's bytes."""
    at: float
    origin: str
    operation: str
    path: str
    range: str
    bytes: int


class ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive, as botocore's connection pool expects
    timeout = 300                   # an idle keep-alive connection gives its thread back
    fake: FakeAws
    origin = "clients"   # "jobs" on the port the containers use

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug(fmt, *args)

    def do_any(self) -> None:
        self.rate = 0.0   # bytes/s of this answer's body; 0 = unpaced (see _s3_link)
        body = self._read_body()
        if body is None:
            # The client went away mid-request (a task runner SIGKILLed while it sent): the
            # service never saw a whole request, acts on nothing and has no one to answer.
            self.close_connection = True
            return
        url = urlsplit(self.path)
        if url.path.startswith("/_chaos/"):
            return self._send(self._control(url.path, body))
        call = identify(self.command, url.path, url.query, self.headers, body)
        self.fake.count(call, self.origin)
        if call.service == "s3":
            self._s3_link(len(body))
        rule = self.fake.faults.pick(call, lambda: self.fake.sim.keys(call, body, url.path), self.origin)
        if rule is None:
            answer = self.fake.sim.handle(call, body, self._forward, self.headers.get("User-Agent", ""))
            self._send(answer)
            if call.service == "s3":
                self.fake.s3_log.append(S3Request(time.time(), self.origin, call.operation,
                                                  self.path, self.headers.get("Range", ""),
                                                  len(answer[2]) if self.command != "HEAD" else 0))
            return
        if rule.kind == "lost":
            # AWS accepted the request (moto and the simulator act on it); its answer never
            # reaches the client, which sees a reset and resends it.
            self.fake.sim.handle(call, body, self._forward, self.headers.get("User-Agent", ""))
        if rule.kind in ("reset", "lost"):
            # SO_LINGER 0: close() sends RST at once, as a dropped load balancer connection does.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        elif rule.kind == "timeout":
            self.fake.releasing.wait(rule.hold_seconds)   # no answer, then a plain close
        else:
            return self._send(fault_answer(call, rule.kind))
        self.close_connection = True

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = do_any

    def _read_body(self) -> bytes | None:
        """The request's body; None when the connection closed before all of it came."""
        if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            return body if len(body) == length else None
        # botocore streams S3 uploads with checksums chunked; moto gets them with a length.
        chunks = []
        while True:
            line = self.rfile.readline()
            if not line:   # closed before the last chunk
                return None
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if not size:
                break
            chunk = self.rfile.read(size)
            if len(chunk) < size:
                return None
            chunks.append(chunk)
            self.rfile.readline()
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
            pass
        return b"".join(chunks)

    def _s3_link(self, sent: int) -> None:
        """S3 as a node sees it over one connection: a request body of `sent` bytes took
        len/rate to arrive (it came at the proxy's speed: the difference is waited here), and the
        answer starts `s3_first_byte_ms` later; _send paces the answer's body at the same rate.
        So a download of the whole corpus and a stream of a few blocks pay the same per byte."""
        config = self.fake.sim.config
        self.rate = float(config["s3_mb_per_s_per_connection"]) * 1e6
        wait = (sent / self.rate if self.rate else 0.0) - (time.monotonic() - self.started)
        time.sleep(max(0.0, wait) + float(config["s3_first_byte_ms"]) / 1000)

    def parse_request(self) -> bool:
        self.started = time.monotonic()   # the request line arrived: its body follows
        return super().parse_request()

    def _forward(self, body: bytes) -> Answer:
        conn = http.client.HTTPConnection("127.0.0.1", self.fake.moto_port, timeout=300)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for key, value in self.headers.items():   # Host and the signature as the client sent them
                if key.lower() not in HOP_HEADERS:
                    conn.putheader(key, value)
            if body or self.command in ("POST", "PUT", "PATCH"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            response = conn.getresponse()
            data = response.read()
            keep = HOP_HEADERS - ({"content-length"} if self.command == "HEAD" else set())
            return response.status, [(k, v) for k, v in response.getheaders() if k.lower() not in keep], data
        finally:
            conn.close()

    def _send(self, answer: Answer) -> None:
        status, headers, data = answer
        self.send_response(status)
        length_sent = False
        for key, value in headers:
            if key.lower() not in ("date", "server"):
                self.send_header(key, value)
                length_sent |= key.lower() == "content-length"
        if not length_sent:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        rate = getattr(self, "rate", 0.0)
        if not rate:
            self.wfile.write(data)
            return
        t0 = time.monotonic()
        for start in range(0, len(data), PACE_CHUNK):
            self.wfile.write(data[start:start + PACE_CHUNK])
            ahead = (start + PACE_CHUNK) / rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)

    def _control(self, path: str, body: bytes) -> Answer:
        call = Call("chaos", path, "rest-json")
        fake, method = self.fake, self.command
        try:
            payload = json.loads(body) if body.strip() else {}
            if path == "/_chaos/health":
                return json_answer(call, {"ok": True, "url": fake.url, "moto": fake.moto_url,
                                          "jobs": len(fake.sim.jobs)})
            if path == "/_chaos/report":
                return json_answer(call, fake.report())
            if path == "/_chaos/faults" and method in ("POST", "DELETE"):
                fake.faults.set(payload.get("rules", []) if method == "POST" else [])
                return json_answer(call, {"rules": len(fake.faults.rules)})
            if path == "/_chaos/config":
                return json_answer(call, fake.sim.configure(**payload) if method == "POST" else fake.sim.config)
            match = re.fullmatch(r"/_chaos/jobs/(.+)/host", path)
            if match and method == "POST":
                job = fake.sim.find(match.group(1))
                if job is None:
                    return json_answer(call, {"error": f"no simulated job {match.group(1)!r}"}, 404)
                ended = fake.sim.lose_host(job, int(payload.get("node", 0)))
                return json_answer(call, {"ended": ended, "job": job.report()})
            match = re.fullmatch(r"/_chaos/jobs/(.+)/reclaim", path)
            if match and method == "POST":
                job = fake.sim.find(match.group(1))
                if job is None:
                    return json_answer(call, {"error": f"no simulated job {match.group(1)!r}"}, 404)
                return json_answer(call, {"reclaimed": fake.sim.reclaim(job), "job": job.report()})
            match = re.fullmatch(r"/_chaos/jobs/(.+)/(fail|stop)", path)
            if match and method == "POST":
                job = fake.sim.find(match.group(1))
                if job is None:
                    return json_answer(call, {"error": f"no simulated job {match.group(1)!r}"}, 404)
                why = "crash" if match.group(2) == "fail" else "service"
                ended = fake.sim.end(job, why, str(payload.get("reason", "")))
                return json_answer(call, {"ended": ended, "job": job.report()})
            return json_answer(call, {"error": f"no control call {method} {path}"}, 404)
        except (ValueError, TypeError, KeyError) as exc:
            return json_answer(call, {"error": str(exc)}, 400)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False   # a held "timeout" connection must not block stop()
    request_queue_size = 128  # every Airflow process and its connection pool, at once

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A connection reset (injected here, or a client killed mid-request) is part of the
        # game: no traceback on stderr for it, a debug line.
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)) or (
                isinstance(exc, (OSError, ValueError)) and ("closed" in str(exc) or "Bad file" in str(exc))):
            log.debug("connection from %s ended: %r", client_address, exc)
            return
        super().handle_error(request, client_address)


class FakeAws:
    """moto plus the proxy and the simulator, in this process: `FakeAws(port, workdir).start()`."""

    def __init__(self, port: int, workdir: str | Path, moto_port: int | None = None, **config: Any):
        self.port, self.workdir = port, Path(workdir)
        self.moto_port = moto_port or free_port()
        self.config = config
        self.faults = Faults()
        self.operations: collections.Counter[str] = collections.Counter()
        self.job_operations: collections.Counter[str] = collections.Counter()   # the containers' calls
        self.s3_log: collections.deque[S3Request] = collections.deque(maxlen=200_000)   # what moved
        self.jobs_port = free_port()
        self.lock = threading.Lock()
        self.releasing = threading.Event()   # set at stop: held connections let go

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def moto_url(self) -> str:
        return f"http://127.0.0.1:{self.moto_port}"

    @property
    def jobs_url(self) -> str:
        """The proxy port the simulated containers use (their AWS_ENDPOINT_URL): only rules with
        `origin` "jobs" (or "*") touch their calls, so the clients' rules never hit a job."""
        return f"http://127.0.0.1:{self.jobs_port}"

    def connection(self) -> dict[str, Any]:
        """The Airflow AWS connection that points a process at the proxy."""
        return {"conn_type": "aws", "login": "testing", "password": "testing",
                "extra": {"region_name": REGION, "endpoint_url": self.url}}

    def count(self, call: Call, origin: str = "clients") -> None:
        with self.lock:
            (self.job_operations if origin == "jobs" else self.operations)[call.operation] += 1

    def report(self) -> dict[str, Any]:
        with self.faults.lock, self.lock:
            injections, operations = list(self.faults.injections), dict(self.operations)
            job_operations = dict(self.job_operations)
        return {"jobs": self.sim.report(), "injections": injections, "operations": operations,
                "job_operations": job_operations}

    def start(self) -> FakeAws:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)   # moto's request log
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=self.moto_port, verbose=False)
        self.moto.start()
        # In-process moto keeps its state in module globals: a FakeAws started earlier in the same
        # process (another test) would leave its roles, queues and jobs behind. Start empty.
        urllib.request.urlopen(urllib.request.Request(
            f"{self.moto_url}/moto-api/reset", data=b"", method="POST"), timeout=10).read()
        # Batch jobs would need Docker in moto; the simulator runs them instead.
        urllib.request.urlopen(urllib.request.Request(
            f"{self.moto_url}/moto-api/config", data=json.dumps({"batch": {"use_docker": False}}).encode(),
            method="POST"), timeout=10).read()
        self.sim = Simulator(self.moto_url, self.workdir)
        self.sim.configure(**self.config)
        self.server = _Server(("127.0.0.1", self.port), type("Handler", (ProxyHandler,), {"fake": self}))
        threading.Thread(target=self.server.serve_forever, daemon=True, name="fake-aws-proxy").start()
        self.jobs_server = _Server(("127.0.0.1", self.jobs_port),
                                   type("JobsHandler", (ProxyHandler,), {"fake": self, "origin": "jobs"}))
        threading.Thread(target=self.jobs_server.serve_forever, daemon=True, name="fake-aws-jobs-proxy").start()
        self.sim.jobs_url = self.jobs_url
        log.info("fake AWS on %s (moto on %s), workdir %s", self.url, self.moto_url, self.workdir)
        return self

    def stop(self) -> None:
        self.releasing.set()
        self.sim.shutdown()          # the jobs' process groups end with the server
        for server in (self.server, self.jobs_server):
            server.shutdown()
            server.server_close()
        self.moto.stop()


# -- the control API's client --------------------------------------------------------------------

class ChaosClient:
    """The control API of a running fake AWS, for test harnesses: ChaosClient("http://127.0.0.1:P")."""

    def __init__(self, url: str, timeout: float = 10.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def _call(self, method: str, path: str, payload: Any = None) -> Any:
        data = json.dumps(payload).encode() if payload is not None else None
        request = urllib.request.Request(f"{self.url}/_chaos/{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"fake AWS refused {method} /_chaos/{path}: {exc.read().decode()}") from None

    def faults(self, rules: list[dict[str, Any]]) -> Any:
        """Replace the fault rules (see Rule.parse for the keys). Examples, one per fault:
        a lost answer after the request took effect, `{"operations": ["SubmitJob"], "kind":
        "lost", "count": 1}` (also CreateTrainingJob, StopTrainingJob, TerminateJob); a
        sustained outage of the reads, `{"operations": ["Describe*", "List*"], "services":
        ["sagemaker", "batch"], "kind": "503", "seconds": 600}` plus `{"operations": ["*"],
        "services": ["logs"], "kind": "timeout", "seconds": 600}`; SlowDown on the jobs' own
        checkpoint uploads, `{"operations": ["PutObject", "UploadPart", "CreateMultipartUpload",
        "CompleteMultipartUpload"], "kind": "throttle", "origin": "jobs", "seconds": 60}`."""
        return self._call("POST", "faults", {"rules": rules})

    def clear(self) -> Any:
        return self._call("DELETE", "faults")

    def fail(self, name: str, reason: str = "") -> Any:
        """The job's container crashes now (SageMaker Failed, Batch FAILED)."""
        return self._call("POST", f"jobs/{name}/fail", {"reason": reason})

    def stop(self, name: str, reason: str = "") -> Any:
        """Someone stops the job from the console (SageMaker Stopped, Batch FAILED with reason)."""
        return self._call("POST", f"jobs/{name}/stop", {"reason": reason})

    def lose_host(self, name: str, node: int = 0) -> Any:
        """Node `node`'s host dies (its disk with it); the attempt fails as the service fails it."""
        return self._call("POST", f"jobs/{name}/host", {"node": node})

    def reclaim(self, name: str) -> Any:
        """EC2 reclaims the job's spot capacity now (see Simulator.reclaim): a SageMaker managed
        spot job is Interrupted and restarts inside the same job while MaxWaitTimeInSeconds
        allows; a Batch job's host is terminated."""
        return self._call("POST", f"jobs/{name}/reclaim")

    def config(self, **changes: Any) -> Any:
        """Change the simulator's settings (DEFAULT_CONFIG), e.g. `consistency_seconds=10`
        (Describe*/List* do not show a job that long after its create), `log_delay_seconds=5`
        (log lines reach CloudWatch that late: after the job's end), `capacity_wait_seconds`,
        `pending_seconds`, `fail_first_attempt`. They apply to jobs from then on."""
        return self._call("POST", "config", changes)

    def report(self) -> dict[str, Any]:
        return self._call("GET", "report")

    def health(self) -> dict[str, Any]:
        return self._call("GET", "health")

    def job(self, name: str) -> dict[str, Any] | None:
        """The newest simulated job of this name (or id), as in the report."""
        jobs = [j for j in self.report()["jobs"] if name in (j["name"], j["job_id"])]
        return jobs[-1] if jobs else None

    def wait(self, name: str, statuses: set[str] | tuple[str, ...], timeout: float = 60.0) -> dict[str, Any]:
        """Wait until the job reaches one of `statuses`; its report entry."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(name)
            if job and job["status"] in statuses:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {name} is {job and job['status']}, not in {sorted(statuses)}, "
                                   f"after {timeout} s")
            time.sleep(0.2)
