"""The job simulator: `Simulator` keeps every simulated job, runs its lifecycle in a thread (queued,
containers running, ended as the service ends it), answers the control calls on it and dispatches
the API calls to each service's handlers (sagemaker.py, batch.py)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from tests.aws_fixtures import CONTAINER_ENV, REGION, sync_checkpoints
from tests.chaos.fake_aws.batch import BatchApi
from tests.chaos.fake_aws.faults import Answer, Call
from tests.chaos.fake_aws.jobs import (BATCH_CAPACITY, BATCH_GROUP, CREDENTIALS, SM_CAPACITY, SM_GROUP, Job,
                                       LogSink, kill_group, tag_pairs, timed_plan, timed_result)
from tests.chaos.fake_aws.sagemaker import SageMakerApi

log = logging.getLogger("fake_aws")
DEFAULT_CONFIG = {"pending_seconds": 2.0,      # Starting / RUNNABLE before a container runs
                  "stop_grace_seconds": 5.0,   # SIGTERM, then SIGKILL after this
                  "stopping_seconds": 1.0,     # Stopping lasts this long after the container ended
                  "fail_first_attempt": False,  # the first job of each name (without -rN) dies
                  "fail_after_seconds": 1.0,   # ... this long after it started running
                  "capacity_wait_seconds": 0.0,  # queued this long first, held for capacity
                  "consistency_seconds": 0.0,  # Describe*/List* do not see a new job this long
                  "log_delay_seconds": 0.0,  # a log line reaches CloudWatch this long after it was printed
                  # Jobs created from then on run no container (see _run_timed): for the triggerer
                  # benchmark's hundreds of jobs, which one process per node could not hold.
                  "timed_jobs": False,
                  "timed_run_seconds": 60.0,   # how long a timed job runs (its SIM_RUN_SECONDS wins)
                  "timed_line_seconds": 0.0,   # a timed job's log line this often (0: start and end only)
                  # S3's link as one connection sees it (the proxy, tests/chaos/fake_aws/proxy.py):
                  # object bytes move at most this fast each way, 0 = as fast as the proxy goes
                  "s3_mb_per_s_per_connection": 0.0,
                  "s3_first_byte_ms": 0.0}  # an S3 answer's first byte leaves this long after its request


class Simulator(SageMakerApi, BatchApi):
    """The simulated jobs of both services: their lifecycle (queued, running, ended), the control
    calls on them (end, lose_host, reclaim) and the API calls, each service's from its mixin."""

    def __init__(self, moto_url: str, workdir: Path):
        import boto3

        self.moto_url, self.workdir = moto_url, workdir
        kw = dict(endpoint_url=moto_url, region_name=REGION, aws_access_key_id="testing",
                  aws_secret_access_key="testing")
        self.s3, self.logs = boto3.client("s3", **kw), boto3.client("logs", **kw)
        self.config = dict(DEFAULT_CONFIG)
        self.lock = threading.RLock()
        self.jobs: dict[str, Job] = {}           # SageMaker name or Batch jobId -> Job
        self.first_attempts: set[str] = set()    # names whose first attempt was seen
        self.sinks: list[LogSink] = []
        self.jobs_url = ""   # the proxy port the containers use (FakeAws.jobs_url)
        # Jobs another simulator runs whose containers' S3 traffic comes through the jobs port
        # (tests/chaos/fake_eks.py's pods): (name, its `tag=value`s), so a rule narrowed to a
        # run's jobs reaches their checkpoint uploads too.
        self.foreign_jobs: Callable[[], list[tuple[str, set[str]]]] = list
        self.closing = threading.Event()
        threading.Thread(target=self._flush_logs, daemon=True, name="fake-aws-logs").start()

    # -- control ---------------------------------------------------------------------------------
    def configure(self, **changes: Any) -> dict[str, Any]:
        if unknown := set(changes) - set(DEFAULT_CONFIG):
            raise ValueError(f"unknown config keys {sorted(unknown)}; allowed: {sorted(DEFAULT_CONFIG)}")
        with self.lock:
            self.config.update({k: type(DEFAULT_CONFIG[k])(v) for k, v in changes.items()})
            return dict(self.config)

    def find(self, name: str) -> Job | None:
        with self.lock:
            found = [j for j in self.jobs.values() if name in (j.name, j.job_id)]
            return max(found, key=lambda j: j.created_at) if found else None

    def end(self, job: Job, why: str, reason: str = "", user_agent: str | None = None,
            operation: str = "") -> bool:
        """Ask a job to end (client stop, console stop, crash, deadline); False if it had ended."""
        with self.lock:
            if user_agent is not None:
                job.stop_requests.append({"at": time.time(), "user_agent": user_agent,
                                          "operation": operation, "reason": reason})
            if job.ended or job.end_request:
                return False
            job.end_request = (why, reason)
            if job.service == "sagemaker" and why in ("client", "service"):
                job.move("Stopping", "Stopping")
        job.wake.set()
        return True

    def lose_host(self, job: Job, node: int) -> bool:
        """Node `node`'s host dies now: its container is killed without a signal to catch, and
        the attempt ends as the service ends it (Batch: FAILED, host terminated; SageMaker:
        Failed, internal error). Its disk goes with it: a new attempt gets fresh ones."""
        with self.lock:
            procs = list(job.procs)
        if not 0 <= node < len(procs):
            raise ValueError(f"job {job.name} has {len(procs)} running nodes, not node {node}")
        # asked before the kill: a job loop that saw the node die first would end the job as a
        # container's exit (137), not as the service ends it for a lost host
        asked = self.end(job, "host", f"node {node}'s host terminated")
        kill_group(procs[node], 0)
        return asked

    def reclaim(self, job: Job) -> bool:
        """EC2 takes the job's spot capacity back now. SageMaker managed spot: the containers get
        SIGTERM (the two-minute notice, here stop_grace_seconds), what they checkpointed is synced,
        the job shows SecondaryStatus Interrupted and restarts inside the same job on fresh disks
        with its checkpoints downloaded, while MaxWaitTimeInSeconds (from its creation) allows;
        else it ends Stopped, MaxWaitTimeExceeded. Batch (on-demand only: multi-node parallel
        jobs cannot run on Spot): the main node's host is terminated (lose_host)."""
        if job.service == "batch":
            return self.lose_host(job, 0)
        if not job.request.get("EnableManagedSpotTraining"):
            raise ValueError(f"training job {job.name} is not a managed spot job: nothing to reclaim")
        with self.lock:
            if job.ended or job.end_request or not job.procs:
                return False
            job.end_request = ("reclaim", "")
            job.reclaims += 1
        job.wake.set()
        return True

    def report(self) -> list[dict[str, Any]]:
        with self.lock:
            return [j.report() for j in sorted(self.jobs.values(), key=lambda j: j.created_at)]

    def keys(self, call: Call, body: bytes, path: str = "") -> set[str]:
        """Names and `tag=value`s of the known jobs a call is about (for rules with `jobs`). An S3
        call is about the jobs whose staging prefix (`.../<job name>/...`, shared by a job's
        attempts, where its checkpoints live) its path is under."""
        if call.service == "s3":
            with self.lock:
                known = [(job.name, tag_pairs(job.request)) for job in self.jobs.values()]
            return {item for name, tags in known + self.foreign_jobs()
                    if f"/{re.sub(r'-r[0-9]+$', '', name)}/" in path for item in (name, *tags)}
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            return set()
        if not isinstance(request, dict):
            return set()
        refs: set[str] = set()
        streams: set[str] = set()
        if call.service == "sagemaker":
            refs.update(str(request[k]) for k in ("TrainingJobName",) if request.get(k))
            if request.get("NameContains"):
                with self.lock:
                    refs.update(j.name for j in self.jobs.values() if request["NameContains"] in j.name)
        elif call.service == "batch":
            refs.update(str(i).split("#")[0] for i in request.get("jobs") or [])
            refs.update(str(request[k]) for k in ("jobId", "jobName") if request.get(k))
            for flt in request.get("filters") or []:
                if flt.get("name") == "JOB_NAME":
                    refs.update(str(v).rstrip("*") for v in flt.get("values") or [])
        elif call.service == "logs":
            streams.update(str(v) for v in request.get("logStreamNames") or [])
            streams.update(str(request[k]) for k in ("logStreamName", "logStreamNamePrefix") if request.get(k))
        out: set[str] = set()
        with self.lock:
            for job in self.jobs.values():
                if job.name in refs or job.job_id in refs or any(
                        s == t or (len(s) > 8 and t.startswith(s)) for s in streams for t in job.streams):
                    out.add(job.name)
                    out.update(tag_pairs(job.request))
        if call.operation in ("CreateTrainingJob", "SubmitJob"):
            # A create is about the job it makes, which is not known yet: its own tags say whose
            # it is (so that a row can lose the answers to its own creates only).
            out.update(tag_pairs(request))
        return out | {r for r in refs if r}

    def shutdown(self) -> None:
        self.closing.set()
        with self.lock:
            jobs = list(self.jobs.values())
        for job in jobs:
            for proc in job.procs:
                kill_group(proc, 0)

    # -- the API ---------------------------------------------------------------------------------
    def handle(self, call: Call, body: bytes, forward: Callable[[bytes], Answer], user_agent: str) -> Answer:
        handler = getattr(self, f"_{call.service}_{call.operation}", None)
        return handler(call, body, forward, user_agent) if handler else forward(body)

    def unseen(self, job: Job | None) -> bool:
        """A job too new for Describe*/List* to show (`consistency_seconds`): the services' reads
        are eventually consistent after a create or submit."""
        return job is not None and time.time() < job.created_at + self.config["consistency_seconds"]

    # -- running a job -----------------------------------------------------------------------------
    def _jobdir(self, key: str) -> Path:
        path = self.workdir / "jobs" / re.sub(r"[^\w.-]", "_", key)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _start(self, job: Job) -> None:
        (job.workdir / "request.json").write_text(json.dumps(job.request, indent=2))
        with self.lock:
            self.jobs[job.name if job.service == "sagemaker" else job.job_id] = job
            job.timed = bool(self.config["timed_jobs"])
        log.info("%s job %s (%s) registered", job.service, job.name, job.job_id)
        threading.Thread(target=self._run_timed if job.timed else self._run, args=(job,), daemon=True,
                         name=f"job-{job.name}").start()

    def _set(self, job: Job, status: str, secondary: str = "") -> None:
        with self.lock:
            if job.end_request and job.service == "sagemaker" and job.end_request[0] in ("client", "service"):
                return  # a stop request keeps Stopping until the job has ended
            job.move(status, secondary)
        log.info("%s job %s: %s %s", job.service, job.name, status, secondary)

    def _queued(self, job: Job) -> bool:
        """A new job's wait in the queue (Batch: RUNNABLE), held `capacity_wait_seconds` for want
        of instances as the service says; True when it was asked to end meanwhile."""
        if job.service != "sagemaker":
            job.wake.wait(0.2)
            self._set(job, "RUNNABLE")
        held = self.config["capacity_wait_seconds"]
        if held <= 0:
            return False
        self._hold_for_capacity(job, True)   # no capacity for it yet: the service says so
        woke = job.wake.wait(held)
        self._hold_for_capacity(job, False)
        return woke

    def _run(self, job: Job) -> None:
        sagemaker = job.service == "sagemaker"
        try:
            woke = self._queued(job)
            while not woke and not job.wake.wait(self.config["pending_seconds"]):
                self._set(job, *(("InProgress", "Downloading") if sagemaker else ("STARTING",)))
                commands = self._prepare_sagemaker(job) if sagemaker else self._prepare_batch(job)
                if not job.end_request:
                    self._execute(job, commands)
                if not self._restart_after_reclaim(job):
                    break
        except Exception as exc:  # a broken request or S3 layout: the job fails, the server lives
            log.exception("%s job %s could not run", job.service, job.name)
            job.tail.append(f"{type(exc).__name__}: {exc}")
            job.exit_code = job.exit_code if job.exit_code is not None else 1
        if sagemaker:
            with self.lock:
                job.move(job.status, "Uploading")
            try:
                sync_checkpoints(self.s3, job.request, job.workdir, job.synced)
            except Exception:
                log.exception("checkpoint sync of %s failed", job.name)
        self._finish(job)

    def _run_timed(self, job: Job) -> None:
        """A job without a container: queued as any job (pending_seconds, capacity_wait_seconds),
        then RUNNING (SageMaker InProgress/Training) for its SIM_RUN_SECONDS, logging a start
        line, a line every `timed_line_seconds` and an end line into its CloudWatch stream (the
        main node's; a Batch job has a stream per node, as its node containers would), then it
        ends with its SIM_EXIT_CODE, writing first, on success, the result JSON its entry would
        have written at its `--result` URI. Stops, deadlines and service-side ends (fail, stop)
        end it as they end any job; a host loss or spot reclaim needs a container (refused)."""
        sagemaker = job.service == "sagemaker"
        try:
            woke = self._queued(job)
            if not woke and not job.wake.wait(self.config["pending_seconds"]):
                self._set(job, *(("InProgress", "Downloading") if sagemaker else ("STARTING",)))
                seconds, code, result_uri = timed_plan(job.service, job.request, self.config["timed_run_seconds"])
                if sagemaker:
                    sinks = [self._sink(job, SM_GROUP, f"{job.name}/algo-1-{int(time.time())}")]
                else:
                    definition = job.request["jobDefinition"].rsplit("/", 1)[-1].split(":")[0]
                    sinks = [self._sink(job, BATCH_GROUP, f"{definition}/default/{job.job_id}-node{i}")
                             for i in range(self._nodes(job))]

                def say(line: str) -> None:   # on the main node's stream, as rank 0 prints
                    sinks[0].add(line)
                    with self.lock:
                        job.log_lines += 1
                        job.tail.append(line)

                job.started_at = time.time()
                self._set(job, *(("InProgress", "Training") if sagemaker else ("RUNNING",)))
                say(f"[timed job {job.name}] started: runs {seconds:g} s")
                runtime = (job.request.get("StoppingCondition", {}).get("MaxRuntimeInSeconds") if sagemaker
                           else job.request.get("timeout", {}).get("attemptDurationSeconds"))
                deadline = job.started_at + runtime if runtime else float("inf")
                every = self.config["timed_line_seconds"]
                end, step = job.started_at + seconds, 0
                while not self.closing.is_set():
                    now = time.time()
                    wake_at = min(end, deadline, job.started_at + (step + 1) * every if every > 0 else end)
                    if job.wake.wait(max(0.0, wake_at - now)):
                        break   # asked to end (a stop, a service-side failure)
                    now = time.time()
                    if now >= deadline:
                        self.end(job, "deadline")
                        break
                    if now >= end:
                        break
                    step += 1
                    say(f"step {step} | {now - job.started_at:.0f} s of {seconds:g} s")
                if job.end_request:
                    code = 143 if job.end_request[0] in ("client", "service", "deadline") else 137
                else:
                    if code == 0 and result_uri:
                        bucket, _, key = result_uri[len("s3://"):].partition("/")
                        self.s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(timed_result(seconds)).encode())
                    say(f"[timed job {job.name}] exit code {code}")
                job.exit_code = code
                job.node_ended_at = {i: time.time() for i in range(len(sinks))}
        except Exception as exc:  # noqa: BLE001 - a broken request: the job fails, the server lives
            log.exception("timed %s job %s could not run", job.service, job.name)
            job.tail.append(f"{type(exc).__name__}: {exc}")
            job.exit_code = job.exit_code if job.exit_code is not None else 1
        if sagemaker:
            with self.lock:
                job.move(job.status, "Uploading")
        self._finish(job)

    def _restart_after_reclaim(self, job: Job) -> bool:
        """After a spot reclaim (SageMaker): Interrupted, then True when the job starts again
        (fresh disks, Starting), False when MaxWaitTimeInSeconds is spent (it ends Stopped)."""
        if not job.end_request or job.end_request[0] != "reclaim":
            return False
        sync_checkpoints(self.s3, job.request, job.workdir, job.synced)   # what it saved goes up
        wait = job.request.get("StoppingCondition", {}).get("MaxWaitTimeInSeconds") or 0
        with self.lock:
            job.move("InProgress", "Interrupted")
            if time.time() >= job.created_at + wait:
                return False
            job.end_request, job.procs, job.pumps, job.synced, job.node_ended_at = None, [], [], {}, {}
            job.workdir = job.workdir.parent / f"{job.name}-spot{job.reclaims}"   # a new instance's disk
            job.workdir.mkdir(parents=True, exist_ok=True)
            job.wake.clear()
            job.move("InProgress", "Starting")
        log.info("sagemaker job %s: spot capacity reclaimed, restarting (%d)", job.name, job.reclaims)
        return True

    def _hold_for_capacity(self, job: Job, held: bool) -> None:
        """The service's own words while a job waits for instances (Batch's statusReason on a
        RUNNABLE job, SageMaker's StatusMessage on the Starting transition), or none."""
        with self.lock:
            if job.service == "sagemaker":
                if job.transitions:
                    job.transitions[-1]["StatusMessage"] = SM_CAPACITY if held else "Starting"
                    job.modified_at = time.time()
            elif not job.end_request:
                job.reason = BATCH_CAPACITY if held else ""

    def _aws_env(self) -> dict[str, str]:
        # The containers' own calls (their checkpoints' S3 traffic) go through the jobs' proxy
        # port, where only rules with origin "jobs" touch them.
        url = self.jobs_url or self.moto_url
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": url, "AWS_ENDPOINT_URL_S3": url}

    def _sink(self, job: Job, group: str, stream: str) -> LogSink:
        sink = LogSink(self.logs, group, stream)
        with self.lock:
            job.streams.append(stream)
            self.sinks.append(sink)
        return sink

    def _execute(self, job: Job, commands: list[tuple[list[str], dict[str, str], LogSink]]) -> None:
        sagemaker = job.service == "sagemaker"
        with self.lock:
            for cmd, env, sink in commands:
                # Own session: a stop reaches the entry, the stage and anything they spawned; the
                # marker lets the container's end take what left the session too.
                marker = uuid.uuid4().hex
                proc = subprocess.Popen(cmd, env={**env, CONTAINER_ENV: marker}, cwd=str(job.workdir),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, errors="replace",
                                        bufsize=1, start_new_session=True)
                proc.container = marker
                job.procs.append(proc)
                job.pumps.append(threading.Thread(target=self._pump, args=(job, proc, sink), daemon=True))
                job.pumps[-1].start()
            job.started_at = time.time()
        self._set(job, *(("InProgress", "Training") if sagemaker else ("RUNNING",)))
        if sagemaker and job.request.get("CheckpointConfig"):
            threading.Thread(target=self._sync_checkpoints, args=(job,), daemon=True,
                             name=f"sync-{job.name}").start()
        runtime = (job.request.get("StoppingCondition", {}).get("MaxRuntimeInSeconds") if sagemaker
                   else job.request.get("timeout", {}).get("attemptDurationSeconds"))
        deadline = job.started_at + runtime if runtime else None
        first = re.sub(r"-r\d+$", "", job.name)
        with self.lock:
            doomed = self.config["fail_first_attempt"] and first == job.name and first not in self.first_attempts
            self.first_attempts.add(first)
        host_death = job.started_at + self.config["fail_after_seconds"] if doomed else None
        main = job.procs[0]

        def running() -> bool:
            # Batch ends a multi-node job with its main node; SageMaker when every host is done.
            return any(p.poll() is None for p in job.procs) if sagemaker else main.poll() is None

        while running() and not self.closing.is_set():
            now = time.time()
            if deadline and now > deadline:
                self.end(job, "deadline")
            if host_death and now > host_death:
                self.end(job, "host")
            if job.end_request:
                break
            job.wake.wait(0.2)
        if job.end_request:
            crash = job.end_request[0] in ("crash", "host")   # no grace: the container just dies
            for proc in job.procs:
                kill_group(proc, 0 if crash else self.config["stop_grace_seconds"])
        else:
            # The main process ended by itself. Batch ends the job with its main node: the others
            # get the grace to finish. Whatever the entry left behind dies with its container.
            for proc in job.procs:
                try:
                    proc.wait(self.config["stop_grace_seconds"] if proc is not main else 0)
                except subprocess.TimeoutExpired:
                    pass
                kill_group(proc, 0 if proc is main else self.config["stop_grace_seconds"])
        codes = [p.wait() for p in (job.procs if sagemaker else [main])]
        code = next((c for c in codes if c != 0), 0)
        job.exit_code = 128 - code if code < 0 else code   # killed by signal N: 128 + N, as Docker
        if job.end_request and job.end_request[0] in ("client", "service"):
            time.sleep(self.config["stopping_seconds"])

    def _sync_checkpoints(self, job: Job) -> None:
        """SageMaker uploads what appears in each instance's /opt/ml/checkpoints while the job
        runs (here every second), not only at the end: a host that dies loses nothing synced."""
        while not job.wake.wait(1.0) and not self.closing.is_set():
            if not any(p.poll() is None for p in job.procs):
                return
            try:
                sync_checkpoints(self.s3, job.request, job.workdir, job.synced)
            except Exception as exc:  # a file renamed or removed mid-sync: next round
                log.debug("checkpoint sync of %s: %s", job.name, exc)

    def _pump(self, job: Job, proc: subprocess.Popen, sink: LogSink) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.add(line)
            with self.lock:
                job.log_lines += 1
                job.tail.append(line.rstrip("\n"))
        with self.lock:   # its output closed: the node's container has exited
            job.node_ended_at[job.procs.index(proc)] = time.time()

    def _flush_logs(self) -> None:
        while not self.closing.wait(0.25):
            with self.lock:
                sinks = list(self.sinks)
            for sink in sinks:
                try:
                    sink.flush(self.config["log_delay_seconds"])
                except Exception:
                    log.exception("writing log lines to %s failed", sink.stream)
            with self.lock:   # an ended job's lines are all in: its sink is done
                self.sinks = [s for s in self.sinks if not (s.closed and not s.buffer)]

    def _finish(self, job: Job) -> None:
        for pump in job.pumps:   # they end when the container's output closes: its last lines
            pump.join(10)
        with self.lock:
            sinks = [s for s in self.sinks if s.stream in job.streams]
            for sink in sinks:
                sink.closed = True
            if not self.config["log_delay_seconds"]:
                self.sinks = [s for s in self.sinks if s not in sinks]
        if not self.config["log_delay_seconds"]:
            for sink in sinks:
                sink.flush()
        # else: the job's last lines reach CloudWatch after its status says it ended (_flush_logs)
        why, given = job.end_request or ("exit", "")
        tail = "\n".join(job.tail)
        sagemaker = job.service == "sagemaker"
        with self.lock:
            job.ended_at = time.time()
            job.stopped_by = {"client": "client", "service": "service", "deadline": "deadline"}.get(why)
            if sagemaker:
                status, secondary, job.reason = {
                    "client": ("Stopped", "Stopped", ""),
                    "service": ("Stopped", "Stopped", given),
                    "deadline": ("Stopped", "MaxRuntimeExceeded",
                                 "MaxRuntimeExceeded: Training job exceeded MaxRuntimeInSeconds provided"),
                    "crash": ("Failed", "Failed", "AlgorithmError: " + (given or "the training container crashed")),
                    "host": ("Failed", "Failed", "InternalServerError: We encountered an internal error. "
                                                 "Please try again."),
                    "reclaim": ("Stopped", "MaxWaitTimeExceeded",
                                "MaxWaitTimeExceeded: Training job exceeded MaxWaitTimeInSeconds provided"),
                }.get(why) or (("Completed", "Completed", "") if job.exit_code == 0 else
                               ("Failed", "Failed", f"AlgorithmError: exit code {job.exit_code}: {tail}"[:1024]))
                job.move(status, secondary)
                job.transitions[-1]["EndTime"] = job.ended_at
            else:
                job.status, job.reason = {
                    "client": ("FAILED", given),
                    "service": ("FAILED", given or "Terminated from the AWS Batch console"),
                    "deadline": ("FAILED", "Job attempt duration exceeded timeout"),
                    "crash": ("FAILED", given or "Essential container in task exited"),
                    "host": ("FAILED", "Host EC2 (instance i-0fa4e00000000000) terminated."),
                }.get(why) or ("SUCCEEDED" if job.exit_code == 0 else "FAILED",
                               "Essential container in task exited")
        log.info("%s job %s ended: %s %s", job.service, job.name, job.status, job.reason)
