"""A Kubernetes API that runs the HyperPod backend's jobs: HyperPodPyTorchJob and Kubeflow
PyTorchJob, one process per pod, each pod on its own disk.

Plug it in where the backend makes its client
(`llmops.jobs.backends.hyperpod.hyperpod_hook.connect`); it answers the calls the backend makes
(`call(api, method, **kwargs)`), in the kubernetes client's shapes. Everything below is simulated,
standing in for EKS, the HyperPod and Kubeflow training operators and HyperPod's elastic agent:

- Objects: get / create (409 if it exists) / delete of the job resources, 404 for a missing one;
  pods listed by label; a pod's log read with `timestamps`, `tail_lines` or `since_seconds`
  (with `_preload_content=False`, as the client does, an answer whose `data` is its bytes).
- Pods: one per replica (a node), `<job>-master-0` / `<job>-worker-<i>` for a PyTorchJob,
  `<job>-pod-<i>` for a HyperPodPyTorchJob, running the container's command and args with its
  env, and what the operator adds: for a PyTorchJob the Kubeflow variables (PET_NNODES,
  PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, MASTER_ADDR, MASTER_PORT);
  for a HyperPodPyTorchJob `hyperpodrun` on PATH, which here is torchrun with its rendezvous in
  PET_NODE_RANK / PET_MASTER_ADDR / PET_MASTER_PORT (how HyperPod's operator tells its agent is
  not public; these names are the simulator's). The first pod's host is the rendezvous
  (127.0.0.1 here).
- Disks: every pod gets an empty work dir of its own (LLMOPS_WORKDIR, the backend's POD_WORKDIR,
  and TMPDIR point into it), a restarted pod a new one: pods share nothing but S3 and MLflow.
- Objects carry what the API server adds: metadata.uid and creationTimestamp.
- Lifecycle: conditions Created -> Running (startTime) -> Succeeded (every pod exited 0) or
  Failed (completionTime), each a new True condition. A pod that fails, or a node's host lost
  (`lose_host`), kills every pod of the job; while the job has retries left (HyperPodPyTorchJob
  runPolicy.jobMaxRetryCount, a PyTorchJob's auto-resume annotations) all pods start again on
  replaced nodes (Restarting, then Running), as HyperPod's auto-resume does; else Failed.
  cleanPodPolicy All: a finished job's pods are gone from the pod list (their logs are kept
  here for the tests, `logs()`). Deleting a job kills its pods. The tests' own hand: `crash`
  (a pod's container dies) and `delete` (a user's `kubectl delete`, which the backend is not
  told of).
- runPolicy.activeDeadlineSeconds (the Kubeflow training operator's common job controller;
  the compressed MaxRuntime of tests/test_multiweek.py): once a job has been active that long
  since its status.startTime (pod restarts on replaced nodes do not reset it), every pod is
  killed and the job is Failed (completionTime) with reason DeadlineExceeded and the operator's
  message "Job <name> has failed because it was active longer than specified deadline". The
  HyperPod training operator's words for its own kind are not published; it gets the same.
- Kueue (task governance): a job labelled `kueue.x-k8s.io/queue-name` gets a Workload
  (kueue.x-k8s.io/v1beta1, `<kind>-<job>-<hash>`, labelled `kueue.x-k8s.io/job-uid` with the
  job's uid, listed by `list_namespaced_custom_object` and that label) and is suspended by
  Kueue's webhook at create (runPolicy.suspend true). While capacity is held
  (`hold_for_capacity(seconds)`: jobs created from then on wait that long; 0: none) the
  Workload's QuotaReserved condition is False with reason Pending and Kueue's message
  ("couldn't assign flavors to pod set master: insufficient unused quota for ... in flavor
  ..., N more needed") and the job has the training operator's Suspended condition
  ("PyTorchJob <name> is suspended."); no pod exists and startTime is unset. On admission
  (QuotaReserved and Admitted True) Kueue clears suspend; the operator marks the job resumed,
  sets startTime then, and starts its pods. Preemption (`preempt(name, hold_seconds)`): Kueue
  evicts a running job's Workload for a higher-priority one (Evicted True, reason Preempted,
  Kueue's message; QuotaReserved and Admitted False) and sets suspend again; the operator
  deletes its pods (killed, their disks gone) and marks it Suspended. After `hold_seconds` the
  Workload is admitted again and the job's pods start afresh on new disks, as after a node loss:
  only what reached S3 survives. startTime is kept (the Kubeflow operator's, for a deadline).
- Nodes (`hold_nodes(seconds)`: jobs without a queue name created from then on wait that long;
  0: none): the job's pods are listed Pending, each with the scheduler's condition PodScheduled
  False, reason Unschedulable, message "0/<n> nodes are available: <n> Insufficient <resource>.
  preemption: ..."; no process runs, their logs answer 400 (waiting to start), the job keeps
  only its Created condition and no startTime. Then the pods start as at create.
- Faults (`inject(kind, methods, count=, rate=, seconds=, run_id=)`): calls of `methods` (with
  `run_id`, only those about that DAG run's jobs, by their `llmops/run-id` annotation) are hit,
  each with chance `rate`, at most `count` times, for `seconds` from the first call a rule hits:
  - "lost": the call takes effect, then the connection drops before the answer (a read timeout,
    a NAT gateway's reset): what the kubernetes client raises then, urllib3's ProtocolError
    "Connection aborted." (ConnectionResetError). urllib3 does not resend a POST that was sent,
    so the caller decides; over HTTP it resends a GET or DELETE by itself.
  - "reset": the connection drops before the API server reads the call: no effect.
  - "429": the API server's priority and fairness turns the call away (Too Many Requests,
    `Retry-After: 1`), "500" / "503": a failing API server or its load balancer. No effect.
  `lose_responses(method, count, run_id)` and `outage(methods, seconds, run_id)` are the two
  most used ("lost" answers to the next `count` calls; 503 for `seconds`, an API server having a
  bad quarter of an hour). Each hit is in `report()["injections"]`.
- The simulator's record (`report()`): every job it was asked to create, deleted ones too, with
  when it was created, started (startTime), ended (completionTime), its state and message, and
  when each pod of its newest generation exited; `generations(name)`: the log lines of each
  generation of its pods (a restart on replaced nodes begins the next).
"""

from __future__ import annotations

import copy
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.aws_fixtures import CONTAINER_ENV, ENTRY, ROOT, free_port, image_root, kill_container
from tests.chaos.fake_aws.jobs import run_seconds

log = logging.getLogger("fake_eks")
AUTO_RESUME = "sagemaker.amazonaws.com/enable-job-auto-resume"
MAX_RETRY = "sagemaker.amazonaws.com/job-max-retry-count"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
RUN_ID = "llmops/run-id"   # the backend's annotation: the DAG run a job belongs to
KUEUE = ("kueue.x-k8s.io", "v1beta1", "workloads")
KINDS = ("lost", "reset", "429", "500", "503")   # the faults `inject` arms


class ApiError(Exception):
    """What the kubernetes client raises: `status` is the HTTP status."""

    def __init__(self, status: int):
        super().__init__(f"HTTP {status}")
        self.status = status


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _stamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def selects(selector: str, labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector of equality terms (`k=v`, `k==v`, `k!=v`) and
    existence terms (`k`, `!k`), comma-separated, selects these labels ("" selects all)."""
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class Pod:
    def __init__(self, name: str, proc: subprocess.Popen, workdir: Path, marker: str,
                 generation: int = 1, labels: dict[str, str] | None = None):
        self.name, self.proc, self.workdir, self.marker = name, proc, workdir, marker
        self.generation = generation
        self.labels = dict(labels or {})   # its template's, as the API server lists them
        self.lines: list[tuple[str, str]] = []   # (RFC 3339 timestamp, line)
        self.ended_at: float | None = None
        self.pump = threading.Thread(target=self._read, daemon=True, name=f"pod-{name}")
        self.pump.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((_now(), line.rstrip("\n")))
        self.ended_at = time.time()   # its output closed: the container has exited

    def kill(self) -> None:
        """The pod's end: every process of its container, whatever its session."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        kill_container(self.marker)
        self.proc.wait()
        self.pump.join(5)


class TimedPod:
    """A pod whose container is only a timer (FakeEks.time_pods): it runs `seconds`, then exits
    with `exit_code`; its log is a start line, a line every `line_seconds` (0: none) and an end
    line, made from the clock when read (no process, no thread: hundreds fit on this machine).
    Killed (a deletion, a deadline, a lost host), it exits -9 then and logs no more."""

    def __init__(self, name: str, seconds: float, exit_code: int, line_seconds: float,
                 generation: int, labels: dict[str, str]):
        self.name, self.generation, self.labels = name, generation, dict(labels)
        self.seconds, self.code, self.line_seconds = seconds, exit_code, line_seconds
        self.started_at = time.time()
        self.killed_at: float | None = None
        self.proc = self   # what the simulator asks a container: poll()

    def poll(self) -> int | None:
        if self.killed_at is not None:
            return -9
        return self.code if time.time() >= self.started_at + self.seconds else None

    @property
    def ended_at(self) -> float | None:
        if self.killed_at is not None:
            return self.killed_at
        end = self.started_at + self.seconds
        return end if time.time() >= end else None

    @property
    def lines(self) -> list[tuple[str, str]]:
        until = self.ended_at or time.time()
        out = [(_stamp(self.started_at), f"[timed pod {self.name}] started: runs {self.seconds:g} s")]
        if self.line_seconds > 0:
            step = 1
            while self.started_at + step * self.line_seconds < until:
                at = self.started_at + step * self.line_seconds
                out.append((_stamp(at), f"step {step} | {step * self.line_seconds:g} s of {self.seconds:g} s"))
                step += 1
        if self.killed_at is None and self.ended_at is not None:
            out.append((_stamp(self.ended_at), f"[timed pod {self.name}] exit code {self.code}"))
        return out

    def kill(self) -> None:
        if self.ended_at is None:
            self.killed_at = time.time()


class Job:
    def __init__(self, body: dict[str, Any]):
        self.body = body
        self.pods: list[Pod] = []
        self.finished_pods: list[Pod] = []       # earlier generations and cleaned-up pods
        self.restarts = 0
        self.generation = 0
        self.heal_env: tuple[str, ...] = ()      # variables a replaced node's pods run without
        self.deleted = threading.Event()
        self.deleted_at: float | None = None
        self.pods_gone_at: float | None = None   # a deleted job's pods all killed
        self.lost = threading.Event()
        self.created_at = time.time()
        self.admit_at = self.created_at      # Kueue admits it then (a capacity hold: later)
        self.schedule_at: float | None = None   # its pods wait for nodes until then (hold_nodes)
        self.workload: dict[str, Any] | None = None
        self.preemptions = 0
        self.timed: dict[str, float] | None = None   # FakeEks.time_pods when it was created
        meta = self.body["metadata"]
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now())

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    @property
    def kind(self) -> str:
        return self.body["kind"]

    @property
    def run_id(self) -> str:
        """The DAG run it belongs to (the backend's annotation), "" when none."""
        return self.body["metadata"].get("annotations", {}).get(RUN_ID, "")

    def condition(self, kind: str, message: str = "", reason: str = "", **status: Any) -> None:
        body_status = self.body.setdefault("status", {})
        conditions = body_status.setdefault("conditions", [])
        for old in conditions:
            old["status"] = "False"
        conditions.append({"type": kind, "status": "True", "lastTransitionTime": _now(),
                           "reason": reason or kind, "message": message})
        body_status.update(status)

    @property
    def run_policy(self) -> dict[str, Any]:
        return self.body["spec"].setdefault("runPolicy", {})

    @property
    def started_at(self) -> float | None:
        stamp = self.body.get("status", {}).get("startTime")
        return _epoch(stamp) if stamp else None

    @property
    def ended_at(self) -> float | None:
        stamp = self.body.get("status", {}).get("completionTime")
        return _epoch(stamp) if stamp else None

    def past_deadline(self) -> bool:
        """runPolicy.activeDeadlineSeconds has passed since status.startTime."""
        limit, began = self.run_policy.get("activeDeadlineSeconds"), self.started_at
        return limit is not None and began is not None and time.time() - began >= int(limit)

    def max_retries(self) -> int:
        if self.kind == "HyperPodPyTorchJob":
            return int(self.body["spec"].get("runPolicy", {}).get("jobMaxRetryCount", 0))
        notes = self.body["metadata"].get("annotations", {})
        return int(notes.get(MAX_RETRY, 0)) if notes.get(AUTO_RESUME) == "true" else 0


class FakeEks:
    def __init__(self, workdir: Path, aws_env: dict[str, str]):
        self.workdir, self.aws_env = Path(workdir), dict(aws_env)
        self.jobs: dict[tuple[str, str], Job] = {}
        self.lock = threading.RLock()
        self.calls: list[tuple[str, dict]] = []
        self.rules: list[dict[str, Any]] = []          # armed faults (inject)
        self.injections: list[dict[str, Any]] = []   # every call a rule hit
        self.random = random.Random(0)               # which calls a rate hits: the same each run
        self.history: list[Job] = []             # every job created, deleted ones too
        self.capacity_wait_seconds = 0.0         # Kueue holds jobs created from now on this long
        self.node_wait_seconds = 0.0             # ... and the scheduler those without a queue
        self.timed: dict[str, float] | None = None   # time_pods: pods of new jobs run no process
        self._s3: Any = None   # the timed jobs' result writer
        self.bin = self.workdir / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        agent = self.bin / "hyperpodrun"   # HyperPod's elastic agent, simulated by torchrun
        agent.write_text(f"#!/bin/sh\nexec {sys.executable} -m torch.distributed.run \"$@\"\n")
        agent.chmod(0o755)

    # -- the API the backend calls -----------------------------------------------------------
    def call(self, api: str, method: str, **kw: Any) -> Any:
        about = self._about(method, kw)
        before = self._hit(method, about, before=True)
        if before == "reset":
            raise _connection_dropped(method)
        if before:
            raise ApiError(int(before))
        answer = self._answer(api, method, **kw)   # the call takes effect either way
        if self._hit(method, about, before=False):
            raise _connection_dropped(method)
        return answer

    def _hit(self, method: str, about: tuple[str, set[str]], before: bool) -> str:
        """The kind of the first armed rule that hits this call ("" when none): those that
        answer instead of the call (`before`), or "lost", which drops the answer after it."""
        now = time.time()
        with self.lock:
            for rule in self.rules:
                if ((rule["kind"] != "lost") != before or method not in rule["methods"]
                        or (rule["run_id"] and rule["run_id"] not in about[1])
                        or (rule["count"] is not None and rule["hits"] >= rule["count"])
                        or (rule["until"] is not None and now >= rule["until"])
                        or self.random.random() >= rule["rate"]):
                    continue
                if rule["seconds"] is not None and rule["until"] is None:
                    rule["until"] = now + rule["seconds"]
                rule["hits"] += 1
                self.injections.append({"kind": rule["kind"], "operation": method, "at": now,
                                        "about": about[0],
                                        "run_id": rule["run_id"] or next(iter(sorted(about[1])), "")})
                return rule["kind"]
        return ""

    def _about(self, method: str, kw: dict[str, Any]) -> tuple[str, set[str]]:
        """(the job names, comma-separated, and their DAG run ids) the call is about: the job it
        names, or every job (or pod's job) a list's label selector selects; ("", set()) when none."""
        with self.lock:
            if method == "create_namespaced_custom_object":
                meta = (kw.get("body") or {}).get("metadata") or {}
                return meta.get("name", ""), {(meta.get("annotations") or {}).get(RUN_ID, "")}
            if method in ("list_namespaced_pod", "list_namespaced_custom_object"):
                selector = kw.get("label_selector") or ""
                jobs = [j for (ns, _), j in self.jobs.items() if ns == kw.get("namespace") and (
                    selects(selector, j.workload["metadata"]["labels"]) if (
                        kw.get("group"), kw.get("version"), kw.get("plural")) == KUEUE and j.workload
                    else selects(selector, (self._replicas(j)[0][1].get("metadata") or {}).get("labels") or {})
                    if method == "list_namespaced_pod"
                    else selects(selector, j.body["metadata"].get("labels") or {}))]
                return ",".join(j.name for j in jobs), {j.run_id for j in jobs}
            if method == "read_namespaced_pod_log":
                name = next((j.name for j in self.history for p in j.finished_pods + j.pods
                             if p.name == kw.get("name")), "")
            else:
                name = kw.get("name") or ""
            job = self._newest(name)
        return name, {job.run_id} if job else set()

    def _answer(self, api: str, method: str, **kw: Any) -> Any:
        self.calls.append((method, kw))
        name = kw.get("name") or (kw.get("body") or {}).get("metadata", {}).get("name")
        key = (kw.get("namespace"), name)
        with self.lock:
            job = self.jobs.get(key)
            if method == "get_namespaced_custom_object":
                if job is None:
                    raise ApiError(404)
                return copy.deepcopy(job.body)
            if method == "create_namespaced_custom_object":
                if job is not None:
                    raise ApiError(409)
                job = Job(copy.deepcopy(kw["body"]))
                job.timed = self.timed
                job.condition("Created", f"{job.kind} {job.name} is created.")
                self.jobs[key] = job
                self.history.append(job)
                if QUEUE_LABEL in job.body["metadata"].get("labels", {}):
                    self._enqueue(job)
                elif self.node_wait_seconds > 0:
                    job.schedule_at = job.created_at + self.node_wait_seconds
                else:
                    self._start_pods(job)
                threading.Thread(target=self._watch, args=(job,), daemon=True,
                                 name=f"job-{job.name}").start()
                return copy.deepcopy(job.body)
            if method == "delete_namespaced_custom_object":
                if job is None:
                    raise ApiError(404)
                self._delete(key)
                return {}
            if method == "list_namespaced_custom_object":
                selector = kw.get("label_selector") or ""
                if (kw["group"], kw["version"], kw["plural"]) == KUEUE:
                    return {"items": [copy.deepcopy(j.workload) for (ns, _), j in self.jobs.items()
                                      if ns == kw["namespace"] and j.workload is not None
                                      and selects(selector, j.workload["metadata"]["labels"])]}
                # the job resources of one kind in the namespace, as the API server lists them
                api_version, plural = f"{kw['group']}/{kw['version']}", kw["plural"]
                return {"apiVersion": api_version, "kind": f"{plural}List", "items": [
                    copy.deepcopy(j.body) for (ns, _), j in self.jobs.items()
                    if ns == kw["namespace"] and j.body.get("apiVersion") == api_version
                    and f"{j.kind.lower()}s" == plural and selects(selector, j.body["metadata"].get("labels") or {})]}
            if method == "list_namespaced_pod":
                selector = kw.get("label_selector") or ""
                jobs = [j for (ns, _), j in self.jobs.items() if ns == kw["namespace"]]
                return SimpleNamespace(items=[SimpleNamespace(metadata=SimpleNamespace(name=p.name, labels=dict(p.labels)))
                                              for j in jobs for p in j.pods if selects(selector, p.labels)]
                                       + [p for j in jobs for p in self._unscheduled(j)
                                          if selects(selector, p.metadata.labels)])
            if method == "read_namespaced_pod_log":
                if any(kw["name"] == p.metadata.name for j in self.jobs.values()
                       for p in self._unscheduled(j)):
                    raise ApiError(400)   # container "..." in pod "..." is waiting to start
                pod = next((p for j in self.jobs.values() for p in j.pods if p.name == kw["name"]), None)
                if pod is None:
                    raise ApiError(404)
                records = list(pod.lines)
        if "since_seconds" in kw:
            cut = time.time() - kw["since_seconds"]
            records = [r for r in records if _epoch(r[0]) >= cut]
        if "tail_lines" in kw:
            records = records[-kw["tail_lines"]:]
        text = "\n".join(f"{t} {line}" if kw.get("timestamps") else line for t, line in records)
        text = text + "\n" if text else ""
        # _preload_content=False: the client hands back the HTTP response, its body undecoded
        return SimpleNamespace(data=text.encode()) if kw.get("_preload_content") is False else text

    # -- control ------------------------------------------------------------------------------
    def hold_for_capacity(self, seconds: float) -> None:
        """Kueue admits the queued jobs created from now on only after `seconds` (0: at once)."""
        with self.lock:
            self.capacity_wait_seconds = float(seconds)

    def time_pods(self, run_seconds: float | None = 60.0, line_seconds: float = 0.0) -> None:
        """Pods of jobs created from now on run no process (TimedPod): each runs its container's
        SIM_RUN_SECONDS, or until its SIM_END_AT (else `run_seconds`), and exits with its
        SIM_EXIT_CODE (else 0); a job all
        of whose pods exit 0 first gets the result JSON its entry would write at its `--result`
        URI (through `aws_env`'s S3 endpoint). None: real processes again."""
        with self.lock:
            self.timed = None if run_seconds is None else {"run_seconds": float(run_seconds),
                                                           "line_seconds": float(line_seconds)}

    def hold_nodes(self, seconds: float) -> None:
        """Jobs without a queue name created from now on have their pods Pending, unschedulable,
        for `seconds` (0: scheduled at once)."""
        with self.lock:
            self.node_wait_seconds = float(seconds)

    def report(self) -> dict[str, Any]:
        """The simulator's record: every job (created_at, started_at, ended_at, deleted_at,
        pods_gone_at, status, reason, condition_reason, node_ended_at, run_id) and every
        answer it lost or refused (injections)."""
        with self.lock:
            jobs = list(self.history)
            injections = list(self.injections)
        records = []
        for job in jobs:
            state, reason, condition_reason = next(
                ((c["type"], c["message"], c.get("reason", "")) for c in reversed(
                    job.body.get("status", {}).get("conditions", [])) if c["status"] == "True"), ("", "", ""))
            records.append({"name": job.name, "job_id": job.body["metadata"]["uid"],
                            "service": "hyperpod", "kind": job.kind,
                            "spec_name": job.body["metadata"].get("annotations", {}).get("llmops/job-name", ""),
                            "run_id": job.run_id,
                            "created_at": job.created_at, "started_at": job.started_at,
                            "ended_at": job.ended_at, "deleted_at": job.deleted_at,
                            "pods_gone_at": job.pods_gone_at,
                            "status": state, "reason": reason, "condition_reason": condition_reason,
                            "restarts": job.restarts, "generations": job.generation,
                            "node_ended_at": self._pod_ends(job)})
        return {"jobs": records, "injections": injections}

    def job_tags(self) -> list[tuple[str, set[str]]]:
        """(name, {"run_id=<its DAG run>"}) of every job ever created: whose a pod's S3 call is
        (tests/chaos/fake_aws/simulator.py's Simulator.foreign_jobs)."""
        with self.lock:
            return [(j.name, {f"run_id={j.run_id}"}) for j in self.history]

    def generations(self, name: str) -> list[list[tuple[float, str]]]:
        """(epoch seconds, line) of every pod of each generation of the job, in time order."""
        job = self._job(name)
        with self.lock:
            pods = job.finished_pods + job.pods
        return [sorted((_epoch(t), line) for p in pods if p.generation == g for t, line in list(p.lines))
                for g in range(1, job.generation + 1)]

    def inject(self, kind: str, methods: list[str], count: int | None = None, rate: float = 1.0,
               seconds: float | None = None, run_id: str = "") -> None:
        """Arm a fault (see the module docstring): `kind` "lost", "reset", "429", "500" or "503"."""
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r}: choose one of {KINDS}")
        with self.lock:
            self.rules.append({"kind": kind, "methods": set(methods), "count": count, "rate": rate,
                               "seconds": seconds, "run_id": run_id, "hits": 0, "until": None})

    def lose_responses(self, method: str, count: int = 1, run_id: str = "") -> None:
        """The next `count` calls of `method` (about `run_id`'s jobs, where given) take effect
        and lose their answer."""
        self.inject("lost", [method], count=count, run_id=run_id)

    def outage(self, methods: list[str], seconds: float, run_id: str = "") -> None:
        """Calls of `methods` (about `run_id`'s jobs, where given) answer 503 for `seconds`
        from the first call the outage hits."""
        self.inject("503", methods, seconds=seconds, run_id=run_id)

    def job(self, name: str) -> Job:
        return self._job(name)

    def _job(self, name: str) -> Job:
        """The newest job called `name`, deleted or not, or the job whose uid `name` is (a name
        may be used again once its job is gone)."""
        job = self._newest(name)
        if job is None:
            raise KeyError(f"no job called {name!r} was ever created")
        return job

    def _newest(self, name: str) -> Job | None:
        with self.lock:
            return next((j for j in reversed(self.history)
                         if name in (j.name, j.body["metadata"]["uid"])), None)

    def lose_host(self, name: str, node: int, heal_env: tuple[str, ...] = ()) -> None:
        """Node `node`'s host dies: its pod is killed at once, and the job restarts (or fails) as
        the operator decides. `heal_env`: variables the replacement pods run without (a fault that
        was the lost node's, such as an injected hang)."""
        job = self.job(name)
        with self.lock:
            job.heal_env = heal_env
            pod = job.pods[node]
        log.info("%s: node %d's host lost (pod %s)", name, node, pod.name)
        # flagged before the kill: a watcher that sees the pod's -9 first would restart for it,
        # then restart again for a flag set after its restart (one loss, two retries used)
        job.lost.set()
        pod.kill()

    def crash(self, name: str, node: int) -> None:
        """Node `node`'s container dies (killed, exit -9): the job restarts its pods or fails, as
        the operator decides for a failed pod."""
        job = self.job(name)
        with self.lock:
            pod = job.pods[node]
        log.info("%s: pod %s crashed", name, pod.name)
        pod.kill()

    def delete(self, name: str) -> None:
        """Someone deletes the job (`kubectl delete`, not the backend): its pods are killed and
        it is gone from the API, with no word to the backend."""
        with self.lock:
            key = next(k for k, j in self.jobs.items() if j.name == name)
            self._delete(key)
        log.info("%s: deleted by a user", name)

    def _delete(self, key: tuple[str, str]) -> None:
        job = self.jobs.pop(key)
        job.deleted_at = time.time()
        job.deleted.set()   # its watcher kills its pods

    def preempt(self, name: str, hold_seconds: float) -> None:
        """Kueue preempts the running job for a higher-priority workload (see the module
        docstring) and admits it again after `hold_seconds`."""
        job = self.job(name)
        with self.lock:
            pods, job.pods = list(job.pods), []
            job.finished_pods += pods
            job.run_policy["suspend"] = True
            job.admit_at = time.time() + hold_seconds
            message = ("Preempted to accommodate a workload (UID: " + str(uuid.uuid4()) + ") due to "
                       "prioritization in the ClusterQueue")
            self._workload_condition(job, "Evicted", "True", "Preempted", message)
            self._workload_condition(job, "QuotaReserved", "False", "Pending", message)
            self._workload_condition(job, "Admitted", "False", "NoReservation",
                                     "The workload has no reservation")
            job.condition("Suspended", f"{job.kind} {job.name} is suspended.", reason=f"{job.kind}Suspended")
            job.preemptions += 1
        log.info("%s: preempted by Kueue; admitted again in %.0f s", name, hold_seconds)
        for pod in pods:
            pod.kill()

    def logs(self, name: str) -> list[tuple[float, str, str]]:
        """(epoch seconds, pod, line) of every pod the job ever ran, in time order."""
        job = self.job(name)
        with self.lock:
            pods = job.finished_pods + job.pods
        return sorted((_epoch(t), p.name, line) for p in pods for t, line in list(p.lines))

    def pod_ends(self, name: str) -> list[float | None]:
        """When each pod of the job's newest generation exited (None: still running)."""
        return self._pod_ends(self.job(name))

    def _pod_ends(self, job: Job) -> list[float | None]:
        with self.lock:
            pods = job.pods or job.finished_pods[-len(self._replicas(job)):]
        return [p.ended_at for p in pods]

    def shutdown(self) -> None:
        with self.lock:
            jobs = list(self.jobs.values())
            self.jobs.clear()
        for job in jobs:
            job.deleted.set()
            for pod in job.pods:
                pod.kill()

    # -- running pods ----------------------------------------------------------------------------
    def _replicas(self, job: Job) -> list[tuple[str, dict[str, Any]]]:
        """(pod name, pod template) for every node, node 0 first."""
        spec = job.body["spec"]
        if job.kind == "HyperPodPyTorchJob":
            (replica,) = spec["replicaSpecs"]
            return [(f"{job.name}-pod-{i}", replica["template"]) for i in range(replica["replicas"])]
        replicas = spec["pytorchReplicaSpecs"]
        out = [(f"{job.name}-master-0", replicas["Master"]["template"])]
        if "Worker" in replicas:
            out += [(f"{job.name}-worker-{i}", replicas["Worker"]["template"])
                    for i in range(replicas["Worker"]["replicas"])]
        return out

    def _start_pods(self, job: Job) -> None:
        job.generation += 1
        replicas = self._replicas(job)
        if job.timed is not None:
            pods = []
            for pod_name, template in replicas:
                (container,) = template["spec"]["containers"]
                env = {e["name"]: e["value"] for e in container.get("env", [])}
                pods.append(TimedPod(pod_name, run_seconds(env, job.timed["run_seconds"]),
                                     int(env.get("SIM_EXIT_CODE", 0)), job.timed["line_seconds"],
                                     job.generation, (template.get("metadata") or {}).get("labels") or {}))
            with self.lock:
                job.pods = pods
            job.condition("Running", startTime=job.body.get("status", {}).get("startTime") or _now())
            return
        port, nproc = free_port(), job.body["spec"].get("nprocPerNode", "1")
        pods = []
        for node, (pod_name, template) in enumerate(replicas):
            (container,) = template["spec"]["containers"]
            disk = self.workdir / "pods" / f"{pod_name}-g{job.generation}"
            (disk / "tmp").mkdir(parents=True, exist_ok=True)
            env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW_CONN_")}
            env.update({e["name"]: e["value"] for e in container.get("env", [])})
            for name in job.heal_env:
                env.pop(name, None)
            env.update(self.aws_env)
            env.update({"LLMOPS_WORKDIR": str(disk / "work"), "TMPDIR": str(disk / "tmp"),
                        "PYTHONPATH": str(image_root()), "HOSTNAME": pod_name,
                        "PATH": f"{self.bin}{os.pathsep}{env.get('PATH', '')}"})
            rendezvous = {"PET_NODE_RANK": str(node), "PET_MASTER_ADDR": "127.0.0.1",
                          "PET_MASTER_PORT": str(port)}
            if job.kind == "PyTorchJob":
                rendezvous.update({"PET_NNODES": str(len(replicas)), "PET_NPROC_PER_NODE": nproc,
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            env.update(rendezvous)
            command = [*container.get("command", []), *container.get("args", [])]
            if command and command[0].startswith("python"):
                command[0] = sys.executable
            if len(command) > 1 and command[1].endswith("job_entry.py"):
                command[1] = str(image_root() / ENTRY.relative_to(ROOT))   # the image's copy
            marker = uuid.uuid4().hex   # every process of the pod's container carries it
            proc = subprocess.Popen(command, env={**env, CONTAINER_ENV: marker}, cwd=str(disk),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace",
                                    bufsize=1, start_new_session=True)
            pods.append(Pod(pod_name, proc, disk, marker, job.generation,
                            (template.get("metadata") or {}).get("labels") or {}))
        with self.lock:
            job.pods = pods
        job.condition("Running", startTime=job.body.get("status", {}).get("startTime") or _now())

    def _unscheduled(self, job: Job) -> list[SimpleNamespace]:
        """The pods of a job waiting for nodes, as the API lists them: Pending, with the
        scheduler's PodScheduled condition."""
        if job.schedule_at is None:
            return []
        replicas = self._replicas(job)
        limits = replicas[0][1]["spec"]["containers"][0].get("resources", {}).get("limits") or {"cpu": 1}
        resource, nodes = next(iter(limits)), len(replicas) + 2
        message = (f"0/{nodes} nodes are available: {nodes} Insufficient {resource}. preemption: "
                   f"0/{nodes} nodes are available: {nodes} No preemption victims found for "
                   "incoming pod.")
        return [SimpleNamespace(metadata=SimpleNamespace(
            name=name, labels=dict((template.get("metadata") or {}).get("labels") or {})),
            status=SimpleNamespace(phase="Pending", conditions=[SimpleNamespace(
                type="PodScheduled", status="False", reason="Unschedulable", message=message)]))
                for name, template in replicas]

    # -- Kueue ----------------------------------------------------------------------------------
    def _enqueue(self, job: Job) -> None:
        """Kueue's webhook suspends the job; its Workload waits for quota while capacity is held."""
        meta = job.body["metadata"]
        job.run_policy["suspend"] = True
        job.admit_at = job.created_at + self.capacity_wait_seconds
        replicas = self._replicas(job)
        pod_set = "master" if job.kind == "PyTorchJob" else job.body["spec"]["replicaSpecs"][0]["name"]
        limits = replicas[0][1]["spec"]["containers"][0].get("resources", {}).get("limits") or {"cpu": 1}
        resource, per_node = next(iter(limits.items()))
        job.workload = {
            "apiVersion": f"{KUEUE[0]}/{KUEUE[1]}", "kind": "Workload",
            "metadata": {"name": f"{job.kind.lower()}-{job.name}-{meta['uid'][:5]}",
                         "namespace": meta.get("namespace", ""),
                         "labels": {JOB_UID_LABEL: meta["uid"]},
                         "ownerReferences": [{"apiVersion": job.body["apiVersion"], "kind": job.kind,
                                              "name": job.name, "uid": meta["uid"]}]},
            "spec": {"queueName": meta["labels"][QUEUE_LABEL]},
            "status": {"conditions": []}}
        if job.admit_at > time.time():
            needed = int(per_node) * len(replicas) if str(per_node).isdigit() else len(replicas)
            self._workload_condition(job, "QuotaReserved", "False", "Pending", (
                f"couldn't assign flavors to pod set {pod_set}: insufficient unused quota for "
                f"{resource} in flavor default-flavor, {needed} more needed"))
            job.condition("Suspended", f"{job.kind} {job.name} is suspended.",
                          reason=f"{job.kind}Suspended")
        else:
            self._admit(job)

    def _admit(self, job: Job) -> None:
        """Kueue admits the Workload and clears suspend; the training operator resumes the job
        (startTime now) and starts its pods."""
        self._workload_condition(job, "QuotaReserved", "True", "QuotaReserved",
                                 "Quota reserved in ClusterQueue cluster-queue")
        self._workload_condition(job, "Admitted", "True", "Admitted",
                                 "The workload is admitted")
        if any(c["type"] == "Evicted" for c in job.workload["status"]["conditions"]):
            self._workload_condition(job, "Evicted", "False", "Admitted", "")
        job.run_policy["suspend"] = False
        if job.body.get("status", {}).get("conditions", [{}])[-1].get("type") == "Suspended":
            job.condition("Resumed", f"{job.kind} {job.name} is resumed.", reason=f"{job.kind}Resumed")
        self._start_pods(job)

    @staticmethod
    def _workload_condition(job: Job, kind: str, status: str, reason: str, message: str) -> None:
        assert job.workload is not None
        conditions = [c for c in job.workload["status"]["conditions"] if c["type"] != kind]
        job.workload["status"]["conditions"] = conditions + [
            {"type": kind, "status": status, "reason": reason, "message": message,
             "lastTransitionTime": _now()}]

    def _watch(self, job: Job) -> None:
        while not job.deleted.is_set():
            with self.lock:
                if job.run_policy.get("suspend"):
                    if time.time() >= job.admit_at:
                        self._admit(job)
                    else:
                        job.deleted.wait(0.2)
                        continue
                unscheduled = job.schedule_at is not None and time.time() < job.schedule_at
                if job.schedule_at is not None and not unscheduled:   # nodes came: pods start
                    job.schedule_at = None
                    self._start_pods(job)
                pods = list(job.pods)
            if unscheduled:
                job.deleted.wait(0.2)
                continue
            if job.past_deadline():
                self._end(job, "Failed", f"Job {job.name} has failed because it was active longer "
                          "than specified deadline", reason="DeadlineExceeded")
                return
            codes = [p.proc.poll() for p in pods]
            with self.lock:   # preempted meanwhile: those pods were Kueue's to kill, not a failure
                if job.pods != pods:
                    continue
            failed = job.lost.is_set() or any(c not in (None, 0) for c in codes)
            if not failed and all(c == 0 for c in codes):
                if job.timed is not None:
                    self._write_result(job)
                self._end(job, "Succeeded", "every pod exited 0")
                return
            if failed:
                for pod in pods:
                    pod.kill()
                with self.lock:
                    job.finished_pods += pods
                    job.pods = []
                job.lost.clear()
                why = next((f"pod {p.name} exited {c}" for p, c in zip(pods, codes) if c not in (None, 0)),
                           "a node's host was lost")
                if job.restarts >= job.max_retries():
                    self._end(job, "Failed", f"{why}; no retries left ({job.restarts} used)")
                    return
                job.restarts += 1
                log.info("%s: %s; restarting every pod on replaced nodes (retry %d of %d)", job.name,
                         why, job.restarts, job.max_retries())
                job.condition("Restarting", why)
                self._start_pods(job)
            job.deleted.wait(0.2 if job.timed is None else 1.0)
        with self.lock:   # deleted: its pods go first (foreground)
            pods, job.pods = list(job.pods), []
            job.finished_pods += pods
        for pod in pods:
            pod.kill()
        job.pods_gone_at = time.time()

    def _write_result(self, job: Job) -> None:
        """What a timed job's entry would have written on success: its result JSON at the
        `--result` URI of its first pod's command."""
        (_, template), *_ = self._replicas(job)
        (container,) = template["spec"]["containers"]
        args = [*container.get("command", []), *container.get("args", [])]
        if "--result" not in args[:-1]:
            return
        import json

        import boto3

        from tests.chaos.fake_aws.jobs import timed_result

        uri = args[args.index("--result") + 1]
        bucket, _, key = uri[len("s3://"):].partition("/")
        with self.lock:
            if self._s3 is None:   # one client for every timed job (a client costs ~50 ms to make)
                env = self.aws_env
                self._s3 = boto3.client("s3", endpoint_url=env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"),
                                        region_name=env.get("AWS_DEFAULT_REGION", "us-east-1"),
                                        aws_access_key_id=env.get("AWS_ACCESS_KEY_ID", "testing"),
                                        aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY", "testing"))
            seconds = max((getattr(p, "seconds", 0.0) for p in job.pods), default=0.0)
        self._s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(timed_result(seconds)).encode())

    def _end(self, job: Job, state: str, message: str, reason: str = "") -> None:
        with self.lock:
            pods, job.pods = list(job.pods), []   # cleanPodPolicy All
            job.finished_pods += pods
            # the completion time is set before the pods are cleaned up, as the operator does
            job.condition(state, message, reason=reason, completionTime=_now())
        for pod in pods:
            pod.kill()
        log.info("%s %s: %s (%s)", job.kind, job.name, state, message)


def _connection_dropped(method: str) -> Exception:
    """What the kubernetes client raises when the connection drops before an answer."""
    import urllib3.exceptions

    log.info("dropping the connection of %s", method)
    return urllib3.exceptions.ProtocolError(
        "Connection aborted.", ConnectionResetError(104, "Connection reset by peer"))


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()

