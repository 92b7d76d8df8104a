"""The fault matrix: remote jobs through a real Airflow deployment while AWS misbehaves.

    python -m tests.chaos.matrix [--out FILE] [--only fault,...] [--seconds 30] [--no-lifecycle]
                                 [--workdir DIR] [--database postgresql|sqlite]

SETUP     one fake AWS (tests/chaos/fake_aws/: moto behind a fault-injecting proxy and a job
          simulator that runs each job's container entry, docker/job_entry.py, on this machine)
          and one Airflow deployment (tests/chaos/airflow_deployment.py: api-server, scheduler,
          dag-processor, triggerer as separate processes, LocalExecutor, parallelism 8) on a
          PostgreSQL metadata DB as MWAA's (tests/chaos/postgres.py: a cluster of its own in a
          temp dir; `--database sqlite` for standalone's), whose `llmops_aws` connection points
          at the proxy. Bucket, Batch compute environment and queue are created through the
          proxy with no faults set. HyperPod: a simulated EKS cluster (tests/chaos/fake_eks.py:
          the HyperPod training operator, Kueue, the scheduler, one process per pod on a disk of
          its own) behind a real Kubernetes REST front (tests/chaos/fake_eks_http.py), which the
          deployment reaches through a Kubernetes connection (`llmops_chaos_kube`); its pods
          reach S3 through the proxy's jobs port.
BODY      one row per fault. The 10-minute read outage ("beside": its runs wait out nearly all
          of it) starts first, and OUTAGE_LEAD_S later the "global" rows run beside it, alone
          otherwise, one after another: 5xx and connection
          resets (they hit every client's calls, S3 and creates included, which no job tag
          narrows) and the component kills/restarts (they hit every run). Then the "scoped" rows
          all side by side: faults aimed at one run's jobs or tasks (a worker killed, a task
          cleared, a job failed on the service side...), the user's mark-failed control, and the
          two throttle storms, whose rules are narrowed to their own runs' jobs (fault rule
          `jobs`: the `run_id=<run id>` tag every job carries). The simulator holds one rule
          list: each row's rules are added to and removed from the union (Matrix.add_faults), and
          every injection is attributed to the row whose rule fired.
          The small rows run tests/dags/chaos_dags.py: `pretrain` on SageMaker and `finetune` on
          Batch, each a `tests.chaos.numbered_job` of `--seconds` seconds, in `chaos_remote`
          (deferred: the triggerer waits) and/or `chaos_remote_worker` (the worker waits).
          The rows a HyperPod job meets too also run `chaos_hyperpod` (`train`, deferred, a
          HyperPodPyTorchJob), its faults in the Kubernetes API's words: the throttle storm
          (429 to its reads), 5xx and connection resets on every call (its create and delete
          too), the component restarts, the worker killed right after submit, the clears and
          the same conf twice, the lost create answer (the connection dropped after the API
          server made the job), a pod that crashes and a node's host lost (HyperPod's
          auto-resume restarts the pods on replaced nodes with empty disks), a user's
          `kubectl delete` (the console stop), MaxRuntime three times
          (runPolicy.activeDeadlineSeconds), the capacity wait (pods Unschedulable), the
          10-minute outage (the Kubernetes API's reads answer 503), SlowDown on its pods'
          checkpoint uploads and the mark-failed control. `chaos_hyperpod_worker` waits in the
          worker: the worker SIGKILLed and SIGTERMed mid-job, and the outage. Not HyperPod's:
          spot capacity (HyperPod has no managed spot) and the lifecycle row.
          The lifecycle row runs dags/llm_lifecycle.py (recipe tiny, one sweep trial) with
          pretraining on SageMaker and fine-tuning on Batch under the throttle storm.
LANDING   a row claims the halves its fault must hit (each task; for a component row each run's
          task) and records, for each, that it landed (what, when, how long the row waited for
          its moment: `fault_landed`) or why not (`fault_missed`). A missed half is an error:
          the row measured nothing there. What counts as landed: a worker signalled while its
          process was alive (right after submit: once its log names the submitted job, both
          tasks watched at once from the moment their task runner exists); a job failed/stopped
          on the service side while it ran; a component hit while the task's job ran (the
          triggerer: and the task deferred); a task cleared while its job ran, or after it
          succeeded; both same-conf runs submitting; a task marked failed while deferred with
          its trigger polling; for fault rules, at least one injection of the row's own rules
          into that task's service (SageMaker: pretrain, Batch: finetune; HyperPod: train, the
          cluster's own injections about its run's jobs). Waits for a moment are bounded (600 s)
          and their length is recorded.
MEASURE   after every row has ended and a settle time, from the simulators' reports (every job
          they ran, with creation/start/end times, status, stop requests; a HyperPod job's delete
          is its stop request, `hyperpod_job`) and Airflow's REST API
          (task instance states and end times, XComs) and task log files (every try, the worker's
          and every triggerer's part). Per row:
  runs                  DAG runs the row triggered.
  live_jobs_max         (run, task) pairs that had more than one job alive at one moment (each
                        job from its creation to its end or first stop request), whatever the
                        cause: the issue's "exactly one live job". The notes say how many.
  duplicate_jobs        per (run, task) the jobs of its name base (`<task>-<hash>`, `-r2`,
                        `-r3`... for later attempts), in creation order: a job counts when, at
                        its creation, another job of the same base was still running (created and
                        not yet ended) or had already succeeded. Two DAG runs never share a base
                        (the run id is in the hash): their jobs are never duplicates of each
                        other. A job the service refused (a duplicate name) is not created.
  orphaned_jobs         jobs still running, with no stop request, more than ORPHAN_AFTER (60) s
                        after their task instance reached a terminal state (success, failed,
                        upstream_failed, skipped). A job that got a stop request within that time
                        (then Stopping/Stopped on the service) is not orphaned; the row's notes
                        give each such stop's latency after the task's end. 60 s: a task marked
                        failed while deferred is stopped by the trigger's clean-up, which runs
                        when the triggerer notices on its own loop that the trigger is no longer
                        wanted, then asks the task's state (it never stops a job on an unknown
                        state).
  wrongly_stopped_jobs  jobs that got a stop request (StopTrainingJob, TerminateJob, CancelJob)
                        while running, that none of these explain: the job's deadline
                        (max_run_seconds) had passed; the row marked the task failed (the user's
                        "Mark as failed") before it; the row stopped the job on the service side.
                        Stops caused by a killed or restarted worker, a triggerer restart or a
                        cleared task count: the job was fine and the next try could have used it.
  lost_results          (run, task) pairs with at least one succeeded job whose task instance
                        did not end in success with a succeeded job's result in its XCom (the
                        `job_name` of a succeeded job, and for the small DAG the job's own
                        metrics: answer == 42).
  duplicated_log_lines  per (run, task), job output lines shown more than once in the task's
                        log across all its tries and triggerer parts: the numbered job prints
                        `chaos-line <n> run=<token>` (token drawn per container start), each such
                        line beyond its first showing counts once; on the lifecycle the training
                        loop's `step <n>/<N>` lines are counted the same way. Error records (the
                        operator's failure message quotes the log's tail) and an ended attempt's
                        last lines quoted before the next (`attempt <n> | ...`) are not counted.
  lost_progress_steps   not a count that must be zero but the worst progress one failure cost
                        in the row: the numbered job checkpoints its line every 5 lines where a
                        new attempt on a fresh node finds it (S3), and a new run of the task's
                        job resumes after the newest; the lines it prints again are the loss.
                        At most LOST_PROGRESS_BOUND (one checkpoint interval).

The table is printed (`landed`: halves landed / claimed); the full run (every row, 30 s jobs,
PostgreSQL) is written to benchmarks/results/fault_matrix.json, a subset only where `--out` says:
the rows (exactly these keys plus `seconds`, `fault_landed`, `fault_missed` and `notes`) with
machine information and load. What is simulated (and not): see tests/chaos/fake_aws/__init__.py.

KNOWN LIMITS  the control row marks a task failed once it is deferred and its trigger runs (its
          trigger log part shows a poll: a job line it forwarded), which is what a user does to a
          multi-day job. A running trigger whose task was ended without Airflow calling its
          on_kill stops the job itself (llmops.airflow.triggers.job_trigger: it asks the task's
          state every 30 s). A mark-failed that lands while a task hands over from the worker to the
          triggerer, before the triggerer has picked the trigger up, is seen by nobody (Airflow
          deletes the unused trigger unrun; the worker has exited) and the job runs on until its
          max_run_seconds: not exercised here.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from tests.chaos.airflow_deployment import ROOT, TERMINAL_TI, AirflowDeployment, alive

if str(ROOT / "plugins") not in sys.path:   # run as `python -m tests.chaos.matrix`
    sys.path.insert(0, str(ROOT / "plugins"))

from tests.aws_fixtures import CONN_ID, DUMMY_CREDENTIALS, IMAGE, REGION, free_port, sagemaker_settings  # noqa: E402
from llmops.jobs.errors import Backoff  # noqa: E402

BUCKET = "llmops-chaos"
QUEUE = "llmops-chaos"
SMALL_DAG, WORKER_DAG, LIFECYCLE_DAG = "chaos_remote", "chaos_remote_worker", "llm_lifecycle"
HYPERPOD_DAG, HYPERPOD_WORKER_DAG = "chaos_hyperpod", "chaos_hyperpod_worker"
REMOTE_TASKS = ("pretrain", "finetune")
HYPERPOD_TASKS = ("train",)
KUBE_CONN_ID = "llmops_chaos_kube"   # the deployment's Kubernetes connection (to fake_eks_http)
# The Kubernetes API calls a status poll and a log read make (an outage's targets).
KUBE_READS = ["get_namespaced_custom_object", "list_namespaced_custom_object", "list_namespaced_pod",
              "read_namespaced_pod_log"]
KUBE_CALLS = KUBE_READS + ["create_namespaced_custom_object", "delete_namespaced_custom_object"]
ENTRYPOINT = "tests.chaos.numbered_job"
MAX_RUN_SECONDS = 900            # the chaos DAG's jobs (tests/dags/chaos_dags.py)
SETTLE = 15.0                    # s after the last row before measuring
ORPHAN_AFTER = 60.0              # s after a task's end by which its job must have ended or got a stop
COLUMNS = ("duplicate_jobs", "live_jobs_max", "orphaned_jobs", "wrongly_stopped_jobs", "lost_results",
           "duplicated_log_lines")
DESCRIBE_AND_LOGS = ["DescribeTrainingJob", "DescribeJobs", "ListJobs", "ListTrainingJobs",
                     "GetLogEvents", "DescribeLogStreams", "FilterLogEvents"]
RUNNING = {"InProgress", "Stopping", "SUBMITTED", "PENDING", "RUNNABLE", "STARTING", "RUNNING"}
SUCCEEDED = {"Completed", "SUCCEEDED", "Succeeded"}
LINE = re.compile(r"chaos-line (\d+) run=([0-9a-f]{8})")
QUOTED_TAIL = re.compile(r"attempt \d+ \| ")   # an ended attempt's last lines, quoted (JobOperator._quote_tail)
# The chaos jobs checkpoint their line every 5 lines (tests/chaos/numbered_job.py's
# checkpoint_every): a failure may cost the lines since the newest checkpoint, never more.
LOST_PROGRESS_BOUND = 5
STEP = re.compile(r"step \d+/\d+\b.*")
BASE = re.compile(r"-r\d+$")
LABEL = re.compile(r"chaos-label (\S+) run=([0-9a-f]{8})")   # a container's first line: whose, which start


def base_of(job_name: str) -> str:
    return BASE.sub("", job_name)


def epoch(value: Any) -> float | None:
    if value in (None, ""):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


@dataclass
class Run:
    dag_id: str
    run_id: str
    bases: dict[str, set[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for task_id in self.tasks:
            self.bases.setdefault(task_id, set())

    @property
    def tasks(self) -> tuple[str, ...]:
        """The run's remote tasks: the HyperPod DAG's one, or the others' two."""
        return HYPERPOD_TASKS if self.dag_id in (HYPERPOD_DAG, HYPERPOD_WORKER_DAG) else REMOTE_TASKS

    def label(self, task_id: str) -> str:
        """What the numbered job prints as its first line (tests/dags/chaos_dags.py)."""
        return f"{self.dag_id}/{self.run_id}/{task_id}"


@dataclass
class Row:
    fault: str
    runs: list[Run] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Where the fault must land ("pretrain", "finetune", "<dag>/<task>"...), what landed where
    # ({"half", "what", "at", "waited_s"}) and why a half was missed: a half claimed and not
    # landed fails the test (the row measured nothing there).
    claims: list[str] = field(default_factory=list)
    landed: list[dict[str, Any]] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    rule_halves: dict[str, str] = field(default_factory=dict)   # half -> service its rules must hit
    marked_failed: dict[str, float] = field(default_factory=dict)   # base -> when
    service_stopped: set[str] = field(default_factory=set)          # job names stopped by us
    # The row's max_queue_seconds: a job that never started, stopped once it had waited that long,
    # was stopped by the bound the user set (not wrongly)
    queue_limit_s: float | None = None
    seconds: float = 0.0
    error: str = ""
    started_at: float = 0.0
    ended_at: float = 0.0

    def claim(self, *halves: str) -> None:
        self.claims += [h for h in halves if h not in self.claims]

    def land(self, half: str, what: str, waited: float | None = None, at: float | None = None) -> None:
        entry: dict[str, Any] = {"half": half, "what": what, "at": round(at or time.time(), 2)}
        if waited is not None:
            entry["waited_s"] = round(waited, 1)
        self.landed.append(entry)

    def miss(self, half: str, why: str) -> None:
        self.missed.append(f"{half}: {why}")


class Matrix:
    def __init__(self, workdir: Path, seconds: float = 30.0, pending_seconds: float = 2.0,
                 database: str = "postgresql"):
        self.workdir = workdir
        self.database = database
        # Fault rules of the rows running now (the simulator holds one list: every change pushes
        # the union, each rule with the seconds it has left) and, per push, which row owns each
        # rule index: an injection is the row's whose rule fired.
        self._rules: dict[int, tuple[Row, list[tuple[dict[str, Any], float]]]] = {}
        self._pushes: list[tuple[float, list[Row]]] = []
        self.seconds = seconds
        self.pending_seconds = pending_seconds
        self.aws: Any = None
        self.eks: Any = None    # tests.chaos.fake_eks.FakeEks: the HyperPod half's cluster
        self.kube: Any = None   # its HTTP front
        self.chaos: Any = None
        self.dep: AirflowDeployment | None = None
        self.lock = threading.Lock()
        self.labels: dict[str, tuple[str, str] | None] = {}   # job id -> (label, token) it printed
        self.events: list[tuple[float, str]] = []  # what happened to the deployment on its own
        self._watching = threading.Event()
        self._own_connections = iter(range(1, OWN_CONNECTIONS + 1))

    # -- setup -------------------------------------------------------------------------------
    def start(self) -> None:
        from tests.chaos.fake_aws import ChaosClient, FakeAws

        port = free_port()
        self.aws = FakeAws(port, self.workdir / "aws")
        self.aws.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        # HyperPod: the simulated EKS cluster behind a real Kubernetes REST front; its pods reach
        # S3 through the jobs' port of the proxy, as the SageMaker and Batch containers do.
        from tests.chaos.fake_aws import CREDENTIALS
        from tests.chaos.fake_eks import FakeEks
        from tests.chaos.fake_eks_http import KubeApiServer

        self.eks = FakeEks(self.workdir / "eks", {**CREDENTIALS, "AWS_ENDPOINT_URL": self.aws.jobs_url,
                                                  "AWS_ENDPOINT_URL_S3": self.aws.jobs_url})
        self.kube = KubeApiServer(self.eks).start()
        self.aws.sim.foreign_jobs = self.eks.job_tags   # rules narrowed to a run reach its pods' S3 calls
        self.chaos = ChaosClient(self.endpoint)
        self.chaos.clear()
        self.chaos.config(pending_seconds=self.pending_seconds)
        import boto3

        self.logs = boto3.client("logs", endpoint_url=self.aws.moto_url, region_name=REGION,
                                 aws_access_key_id="testing", aws_secret_access_key="testing")
        self._aws_resources()
        dags = self.workdir / "dags"
        dags.mkdir(parents=True, exist_ok=True)
        for source in (ROOT / "dags" / "llm_lifecycle.py", ROOT / "tests" / "dags" / "chaos_dags.py"):
            link = dags / source.name
            if not link.exists():
                link.symlink_to(source)
        connection = {"conn_type": "aws", "login": "testing", "password": "testing",
                      "extra": {"region_name": REGION, "endpoint_url": self.endpoint}}
        backends = {
            "sagemaker": sagemaker_settings(BUCKET, staging_uri=f"s3://{BUCKET}/staging"),
            "batch": {"aws_conn_id": CONN_ID, "job_queue": QUEUE, "staging_uri": f"s3://{BUCKET}/staging",
                      "image": IMAGE, "instance_type": "p4d.24xlarge", "vcpus": 8, "memory_mib": 30000},
            "hyperpod": {"kubernetes_conn_id": KUBE_CONN_ID, "aws_conn_id": CONN_ID, "image": IMAGE,
                         "staging_uri": f"s3://{BUCKET}/staging", "kind": "HyperPodPyTorchJob",
                         "max_retry_count": 2},
        }
        env = {f"AIRFLOW_CONN_{CONN_ID.upper()}": json.dumps(connection),
               **{f"AIRFLOW_CONN_{CONN_ID.upper()}_ROW{i}": json.dumps(connection)
                  for i in range(1, OWN_CONNECTIONS + 1)},
               f"AIRFLOW_CONN_{KUBE_CONN_ID.upper()}": json.dumps(self.kube.connection()),
               "AIRFLOW_VAR_LLMOPS_BACKENDS": json.dumps(backends),
               "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "true",
               "LLMOPS_HOME": str(self.workdir / "llmops"),
               "MLFLOW_TRACKING_URI": f"sqlite:///{self.workdir / 'mlflow.db'}",
               **DUMMY_CREDENTIALS}
        env.pop("LLMOPS_STORAGE_ROOT", None)
        # 8 worker slots: the scoped rows (19) run side by side, and an in-worker wait holds its
        # slot for the whole job (the 10-minute outage row's for 11 minutes); with 4, later rows'
        # runs stayed queued past their rows' timeouts and their faults expired unlanded.
        # A 60 s task heartbeat timeout, not 30: in a CI run at load 3-5 the API server's
        # database pool ran dry for 30 s (its requests waited for a connection), the workers'
        # heartbeats waited with them, and the scheduler failed every running task's try at once.
        # Their retries reattached to their jobs, but the rows' waits ran out.
        self.dep = AirflowDeployment(self.workdir / "deployment", dags_folder=dags, env=env,
                                     database=self.database, parallelism=PARALLELISM, heartbeat_timeout=60)
        self.dep.migrate()
        # The accelerator pool the lifecycle's sweep trials run in.
        subprocess.run([sys.executable, "-m", "llmops.airflow.sweep_pool"], env=self.dep.env, check=True,
                       capture_output=True, timeout=120)
        self.dep.start()
        for dag_id in (SMALL_DAG, WORKER_DAG, HYPERPOD_DAG, HYPERPOD_WORKER_DAG, LIFECYCLE_DAG):
            self.dep.wait_dag(dag_id, timeout=180)
        threading.Thread(target=self._watch, daemon=True, name="matrix-watchdog").start()

    def _watch(self) -> None:
        """A component that exits on its own (not one a row kills) is started again, and every
        row running at the time gets a note: the row then measured that crash too."""
        while not self._watching.wait(2):
            assert self.dep is not None
            for text in self.dep.revive():
                print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)
                with self.lock:
                    self.events.append((time.time(), text))

    def _aws_resources(self) -> None:
        import boto3

        kw = dict(endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id="testing",
                  aws_secret_access_key="testing")
        boto3.client("s3", **kw).create_bucket(Bucket=BUCKET)
        batch, iam = boto3.client("batch", **kw), boto3.client("iam", **kw)
        role = iam.create_role(RoleName="batch-chaos", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
        compute = batch.create_compute_environment(computeEnvironmentName="chaos", type="UNMANAGED",
                                                   state="ENABLED", serviceRole=role)
        batch.create_job_queue(jobQueueName=QUEUE, state="ENABLED", priority=1, computeEnvironmentOrder=[
            {"order": 1, "computeEnvironment": compute["computeEnvironmentArn"]}])

    def stop(self) -> None:
        self._watching.set()
        if self.dep is not None:
            self.dep.stop()
        if self.aws is not None:
            self.aws.stop()
        if self.kube is not None:
            self.kube.stop()
        if self.eks is not None:
            self.eks.shutdown()

    # -- fault rules -------------------------------------------------------------------------
    def add_faults(self, row: Row, rules: list[dict[str, Any]]) -> None:
        now = time.time()
        with self.lock:
            self._rules[id(row)] = (row, [(r, now + float(r.get("seconds", 3600))) for r in rules])
            self._push()

    def remove_faults(self, row: Row) -> None:
        with self.lock:
            if self._rules.pop(id(row), None) is not None:
                self._push()

    def _push(self) -> None:
        """(under self.lock) The union of the rows' rules to the simulator."""
        now = time.time()
        owners: list[Row] = []
        rules: list[dict[str, Any]] = []
        for row, entries in self._rules.values():
            for rule, until in entries:
                if until > now:
                    rules.append({**rule, "seconds": round(until - now, 1)})
                    owners.append(row)
        self.chaos.faults(rules)
        self._pushes.append((time.time(), owners))

    def injections_of(self, row: Row, report: dict[str, Any]) -> list[dict[str, Any]]:
        """The simulator's injections whose rule was this row's."""
        out = []
        for injection in report.get("injections") or []:
            push = next((owners for at, owners in reversed(self._pushes) if at <= injection["at"]), None)
            index = injection.get("rule", -1)
            if push is not None and 0 <= index < len(push) and push[index] is row:
                out.append(injection)
        return out

    # -- helpers for rows --------------------------------------------------------------------
    def new_run_id(self) -> str:
        return f"manual__{time.strftime('%Y-%m-%dT%H:%M:%S')}-{secrets.token_hex(4)}"

    def conf(self, seconds: float | None = None, exit_code: int = 0) -> dict[str, Any]:
        return {"seconds": int(seconds if seconds is not None else self.seconds), "exit_code": exit_code}

    def own_connection(self) -> dict[str, Any]:
        """settings_overrides that send a run's jobs through an AWS connection of the row's own
        (the same endpoint). A triggerer reads the status of every job of one connection in
        shared calls (a DescribeJobs of up to 100 ids, one ListTrainingJobs), and AWS fails or
        throttles a call, not a job: a fault rule narrowed to one row's jobs also hit every other
        row's jobs in those calls. In a full run the 10-minute outage row's 503s held the Batch
        jobs of five other rows unread for ten minutes (the lifecycle's fine-tuning noticed 13
        minutes after its end) and their rows' waits ran out. A row of its own connection is
        what two teams' accounts are on one MWAA environment."""
        with self.lock:
            conn_id = f"{CONN_ID}_row{next(self._own_connections)}"
        return {"settings_overrides": {cls: {"aws_conn_id": conn_id}
                                       for cls in ("SageMakerSettings", "BatchSettings", "HyperPodSettings")}}

    def trigger(self, row: Row, dag_id: str, conf: dict[str, Any], run_id: str | None = None) -> Run:
        assert self.dep is not None
        run = Run(dag_id, self.dep.trigger(dag_id, conf, run_id))
        row.runs.append(run)
        return run

    def report(self) -> dict[str, Any]:
        """Both simulators' record: the fake AWS's jobs and injections, and the HyperPod jobs in
        the same shape (hyperpod_job)."""
        aws, eks = self.chaos.report(), self.eks.report()
        return {**aws, "jobs": aws["jobs"] + [hyperpod_job(j) for j in eks["jobs"]],
                "injections": (aws.get("injections") or [])
                + [{**i, "service": "hyperpod"} for i in eks["injections"]]}

    def hyperpod_lines(self, job: dict[str, Any]) -> list[list[str]]:
        """A HyperPod job's log lines per generation of its pods (a restart on replaced nodes
        begins the next), from the simulator (every line, whatever the task log kept)."""
        return [[line for _, line in generation] for generation in self.eks.generations(job["job_id"])]

    def _label(self, job: dict[str, Any]) -> str | None:
        found = self._identity(job)
        return found[0] if found else None

    def _identity(self, job: dict[str, Any]) -> tuple[str, str] | None:
        """(label, token) from the `chaos-label <label> run=<token>` line a job printed first,
        read from its CloudWatch stream in moto (directly: no faults on the harness's reads)."""
        key = job["job_id"]
        with self.lock:
            if key in self.labels:
                return self.labels[key]
        if job["service"] == "hyperpod":
            found = next((m for lines in self.hyperpod_lines(job)[:1] for line in lines
                          if (m := LABEL.search(line))), None)
            label = (found.group(1), found.group(2)) if found else None
            if label or job.get("ended_at"):
                with self.lock:
                    self.labels[key] = label
            return label
        group = _log_group(job)
        label, unread = None, False
        for stream in job.get("streams") or []:
            events = self._head(group, stream)
            unread = unread or events is None
            for event in events or []:
                if found := LABEL.search(event["message"]):
                    label = (found.group(1), found.group(2))
                    break
            if label:
                break
        # An ended job's label is final, unless a read failed: a harness miss is not the job's.
        if label or (job.get("ended_at") and not unread):
            with self.lock:
                self.labels[key] = label
        return label

    def tokens(self, job: dict[str, Any]) -> set[str]:
        """The tokens a job's containers drew (`chaos-label <label> run=<token>`, one per start:
        a SageMaker spot restart inside the job draws another), from its CloudWatch streams
        (HyperPod: its pods' logs)."""
        if job["service"] == "hyperpod":
            return {m.group(2) for lines in self.hyperpod_lines(job) for line in lines
                    if (m := LABEL.search(line))}
        group, found = _log_group(job), set()
        for stream in job.get("streams") or []:
            found |= {m.group(2) for e in self._head(group, stream) or [] if (m := LABEL.search(e["message"]))}
        return found

    def _head(self, group: str, stream: str) -> list[dict[str, Any]] | None:
        """A stream's first 20 events from moto, or None when it could not be read (moto at
        load 5+ can time a read out: it is read again first)."""
        for wait in (1, 3, None):
            try:
                return self.logs.get_log_events(logGroupName=group, logStreamName=stream,
                                                startFromHead=True, limit=20)["events"]
            except Exception:  # noqa: BLE001
                if wait is None:
                    return None
                time.sleep(wait)
        return None

    def job_runs(self, job: dict[str, Any]) -> list[list[int]]:
        """The numbers of the `chaos-line`s a job printed, per container start (the chaos jobs
        run one node: a stream each, in order; a SageMaker spot restart inside the job opens a new
        one), from its CloudWatch streams in moto (every line, whatever the task log kept: Airflow
        opens a try's trigger log part anew for each deferral, so a chain's earlier attempts are
        not all in it). A HyperPod job: per generation of its pods, from their logs."""
        if job["service"] == "hyperpod":
            return [[int(n) for line in lines for n, _ in LINE.findall(line)]
                    for lines in self.hyperpod_lines(job)]
        group = _log_group(job)
        runs: list[list[int]] = []
        for stream in job.get("streams") or []:
            numbers: list[int] = []
            runs.append(numbers)
            token = None
            while True:
                kwargs = {"nextToken": token} if token else {}
                try:
                    page = self.logs.get_log_events(logGroupName=group, logStreamName=stream,
                                                    startFromHead=True, **kwargs)
                except Exception:
                    break
                numbers += [int(n) for e in page["events"] for n, _ in LINE.findall(e["message"])]
                if not page["events"] or page.get("nextForwardToken") == token:
                    break
                token = page.get("nextForwardToken")
        return runs

    def jobs_of(self, run: Run, task_id: str, report: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The task instance's jobs: those that printed its label, those whose name base is one
        of theirs (an attempt stopped before it printed anything) or one its log mentions."""
        jobs = (report or self.report())["jobs"]
        label = run.label(task_id)
        bases = run.bases.setdefault(task_id, set())
        for job in jobs:
            if job["name"].startswith(task_id + "-") and self._label(job) == label:
                bases.add(base_of(job["name"]))
        return [j for j in jobs if base_of(j["name"]) in bases]

    def wait_job(self, run: Run, task_id: str, predicate: Callable[[dict], bool],
                 timeout: float = 120, interval: float = 0.5) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for job in self.jobs_of(run, task_id):
                if predicate(job):
                    return job
            time.sleep(interval)
        return None

    def wait_running(self, run: Run, task_id: str, after: float = 3.0, timeout: float = 600) -> dict | None:
        """A job of the task that has run its container for `after` s and not ended."""
        return self.wait_job(run, task_id, lambda j: j.get("started_at") and not j.get("ended_at")
                             and time.time() - j["started_at"] >= after, timeout)

    def named_in_log(self, run: Run, task_id: str) -> set[str]:
        """Job names the task's log mentions so far (the operator logs the name it submitted)."""
        assert self.dep is not None
        names = set()
        for event in self.dep.task_log_events(run.dag_id, run.run_id, task_id):
            names.update(re.findall(rf"\b{task_id}-[0-9a-f]{{12}}(?:-r\d+)?\b", event["event"]))
        return names

    def wait_runs(self, row: Row, timeout: float = 300) -> None:
        assert self.dep is not None
        deadline = time.monotonic() + timeout
        for run in row.runs:
            state = self.dep.wait_run(run.dag_id, run.run_id, max(1.0, deadline - time.monotonic()))
            if state not in ("success", "failed"):
                row.notes.append(f"{run.dag_id} {run.run_id} still {state} after {timeout:.0f}s")

    def ti(self, run: Run, task_id: str) -> dict[str, Any]:
        assert self.dep is not None
        return self.dep.task_instance(run.dag_id, run.run_id, task_id)

    def wait_ti(self, run: Run, task_id: str, states: set[str], timeout: float = 120) -> dict[str, Any]:
        assert self.dep is not None
        return self.dep.wait_task(run.dag_id, run.run_id, task_id, states, timeout)

    # -- measuring ---------------------------------------------------------------------------
    def measure(self, row: Row, report: dict[str, Any]) -> dict[str, Any]:
        assert self.dep is not None
        counts = {c: 0 for c in COLUMNS}
        lost_progress = 0
        details: list[str] = []
        for run in row.runs:
            details.append(f"{run.dag_id} run {run.run_id}: {self.dep.run(run.dag_id, run.run_id)['state']}")
            events_by_task = {t: self.dep.task_log_events(run.dag_id, run.run_id, t) for t in run.tasks}
            for task_id in run.tasks:
                bases = set(run.bases.get(task_id, set()))
                # Whatever name the operator used: the names its log mentions (a changed naming
                # scheme would otherwise hide the jobs).
                for event in events_by_task[task_id]:
                    for found in re.findall(rf"\b{task_id}-[0-9a-f]{{12}}(?:-r\d+)?\b", event["event"]):
                        bases.add(base_of(found))
                run.bases[task_id] = bases
                jobs = sorted(self.jobs_of(run, task_id, report), key=lambda j: j["created_at"])
                ti = self.dep.task_instance(run.dag_id, run.run_id, task_id)
                label = f"{run.dag_id}/{task_id}"
                # A Batch SubmitJob carries no idempotency token: a resend after a lost answer
                # makes a second job, and the backend finds it by its token and cancels it. One
                # cancelled before it started never ran (no instance, no progress): it is no
                # second live job, and its cancel is no wrong stop; the notes say when it went.
                # (Only a copy: the same name as a job of the task that did run.)
                ran = [j for j in jobs if not _cancelled_before_start(j)]
                extras = [j for j in jobs if _cancelled_before_start(j)
                          and any(o["name"] == j["name"] for o in ran)]
                for job in extras:
                    stop = min(s["at"] for s in job["stop_requests"])
                    details.append(f"{label}: {job['name']} ({job['job_id'][:8]}) cancelled "
                                   f"{stop - job['created_at']:.1f}s after its creation, before it started")
                jobs = [j for j in jobs if j not in extras]
                # live jobs at once (a stop request counts as the job's end: that is the
                # duplicate's removal the operator asked for)
                most = _most_at_once(jobs)
                if most > 1:
                    counts["live_jobs_max"] += 1
                    details.append(f"{label}: {most} jobs of one task alive at once")
                # duplicate jobs
                for index, job in enumerate(jobs):
                    at = job["created_at"]
                    for other in jobs[:index]:
                        ended = other.get("ended_at")
                        if ended is None or ended > at or (other["status"] in SUCCEEDED and ended <= at):
                            counts["duplicate_jobs"] += 1
                            details.append(f"{label}: {job['name']} created while {other['name']} was "
                                           f"{'running' if ended is None or ended > at else 'succeeded'}")
                            break
                # orphaned jobs
                ti_end = epoch(ti.get("end_date")) if ti.get("state") in TERMINAL_TI else None
                for job in jobs:
                    ended = job.get("ended_at")
                    if ti_end is None or (ended is not None and ended <= ti_end):
                        continue
                    stops = [s["at"] for s in job.get("stop_requests") or []
                             if ended is None or s["at"] < ended]
                    stop = min(stops) if stops else None
                    if stop is not None and stop >= ti_end - 1:
                        details.append(f"{label}: {job['name']} stop requested {stop - ti_end:.1f}s after "
                                       f"the task ended {ti.get('state')}"
                                       + (f", ended {ended - ti_end:.1f}s after" if ended else ", not ended"))
                    if (ended is None or ended > ti_end + ORPHAN_AFTER) and (
                            stop is None or stop > ti_end + ORPHAN_AFTER):
                        counts["orphaned_jobs"] += 1
                        details.append(f"{label}: {job['name']} {'still running' if ended is None else f'ran {ended - ti_end:.0f}s'}"
                                       f" after the task ended {ti.get('state')}, "
                                       + ("no stop request" if stop is None else f"stop requested after {stop - ti_end:.0f}s"))
                # wrongly stopped jobs
                for job in jobs:
                    if self._wrong_stop(row, job):
                        counts["wrongly_stopped_jobs"] += 1
                        agents = sorted({_agent(s.get("user_agent", "")) for s in job["stop_requests"]})
                        details.append(f"{label}: {job['name']} stopped by a client ({', '.join(agents)})")
                # lost results (not where the user marked the task failed: that discards it)
                succeeded = {j["name"] for j in jobs if j["status"] in SUCCEEDED}
                marked = any(b in row.marked_failed for b in bases)
                if succeeded and not marked:
                    xcom = self.dep.xcom(run.dag_id, run.run_id, task_id) if ti.get("state") == "success" else None
                    if run.dag_id == LIFECYCLE_DAG:
                        # The XCom names the job (its base name or the attempt's) and has metrics.
                        ok = (isinstance(xcom, dict) and bool(xcom.get("metrics"))
                              and base_of(str(xcom.get("job_name"))) in {base_of(n) for n in succeeded})
                    else:
                        # The job's own result: the token it drew, and its metrics.
                        tokens = {t for j in jobs if j["status"] in SUCCEEDED for t in self.tokens(j)}
                        ok = (isinstance(xcom, dict) and (xcom.get("metrics") or {}).get("answer") == 42.0
                              and (xcom.get("outputs") or {}).get("token") in tokens)
                    ok = ok and ti.get("state") == "success"
                    if not ok:
                        counts["lost_results"] += 1
                        details.append(f"{label}: job(s) {sorted(succeeded)} succeeded, task {ti.get('state')}, "
                                       f"XCom {str(xcom)[:400]}" + ("" if run.dag_id == LIFECYCLE_DAG else
                                                           f", the succeeded jobs' tokens {sorted(tokens)}"))
                # duplicated log lines
                seen: dict[str, int] = {}
                for event in events_by_task[task_id]:
                    text = event["event"]
                    if " | " in text and ("Task failed" in text or "Traceback" in text
                                          or QUOTED_TAIL.match(text)):
                        continue
                    matches = LINE.findall(text)
                    if len(matches) == 1:
                        key = "%s %s" % matches[0]
                    elif not matches and run.dag_id == LIFECYCLE_DAG and (step := STEP.search(text)):
                        key = step.group(0)
                    else:
                        continue
                    seen[key] = seen.get(key, 0) + 1
                extra = sum(n - 1 for n in seen.values() if n > 1)
                if extra:
                    counts["duplicated_log_lines"] += extra
                    details.append(f"{label}: {extra} job log line(s) shown more than once")
                # progress lost: lines a later run of the job printed again
                lost, restarts = _lost_progress([run for j in jobs for run in self.job_runs(j)])
                if restarts:
                    details.append(f"{label}: its job's container started {restarts + 1} times; the most lines one "
                                   f"failure cost: {lost}")
                lost_progress = max(lost_progress, lost)
                row_jobs = ", ".join(f"{j['name'].split('-', 1)[0]}{'-' + j['name'].rsplit('-', 1)[1] if BASE.search(j['name']) else ''}"
                                     f":{j['status']}" for j in jobs)
                details.append(f"{label}: task {ti.get('state')} after {ti.get('try_number')} tries; jobs [{row_jobs}]")
                details += self._earlier_tries(run, task_id, label, events_by_task[task_id])
        crashes = [f"DEPLOYMENT: {text}" for at, text in self.events if row.started_at <= at <= row.ended_at]
        if row.rule_halves:
            injections = self.injections_of(row, report)
            for half, service in row.rule_halves.items():
                # S3 is both halves' service: an upload is its half's by the job it is about
                hits = [i for i in injections if i["service"] == service and (
                    service != "s3" or any(a.startswith(half + "-") for a in i.get("about") or []))]
                if hits:
                    kinds = "/".join(sorted({i["kind"] for i in hits}))
                    row.land(half, f"{len(hits)} {kinds} injections into its {service} calls "
                                   f"{_count(i['operation'] for i in hits)}", at=hits[0]["at"])
        landed = {entry["half"] for entry in row.landed}
        missed = row.missed + [f"{h}: the fault never landed" for h in row.claims
                               if h not in landed and not any(m.startswith(f"{h}: ") for m in row.missed)]
        return {"fault": row.fault, "runs": len(row.runs), **counts,
                "lost_progress_steps": lost_progress, "seconds": round(row.seconds, 1),
                "fault_landed": row.landed, "fault_missed": missed,
                "notes": row.notes + crashes + details + ([f"ERROR: {row.error}"] if row.error else [])}

    def _earlier_tries(self, run: Run, task_id: str, label: str, events: list[dict[str, Any]]) -> list[str]:
        """How each try before the last ended: its state and its log's last line. A try can end
        with no fault of the row's (in a CI run at load 3-5, first tries died on their own and
        the runs outlived their row's wait); the notes say how, for the next one to read."""
        assert self.dep is not None
        out = []
        tries = sorted(self.dep.tries(run.dag_id, run.run_id, task_id), key=lambda t: t.get("try_number") or 0)
        for attempt in tries[:-1]:
            number = attempt.get("try_number")
            # the worker's part (its file ends with how the try ended; the triggerer's part, a file
            # of its own, comes after it in `events` whatever the order in time)
            mine = [e for e in events if e["try"] == number and e["event"].strip()]
            last = [e["event"] for e in mine if e["source"] == "worker"] or [e["event"] for e in mine]
            out.append(f"{label}: try {number} {attempt.get('state')} at {attempt.get('end_date')}; its log's "
                       f"last line: {(last[-1] if last else '(no log)')[:300]}")
        return out

    def _wrong_stop(self, row: Row, job: dict[str, Any]) -> bool:
        for stop in job.get("stop_requests") or []:
            at = stop["at"]
            ended = job.get("ended_at")
            if ended is not None and at >= ended:
                continue          # the job had already ended: the request changed nothing
            if job.get("stopped_by") == "deadline" or at >= job["created_at"] + MAX_RUN_SECONDS - 5:
                continue          # past its deadline
            marked = row.marked_failed.get(base_of(job["name"]))
            if marked is not None and at >= marked - 1:
                continue          # the user marked the task failed
            if job["name"] in row.service_stopped:
                continue
            if (row.queue_limit_s is not None and not job.get("started_at")
                    and at >= job["created_at"] + row.queue_limit_s - 1):
                continue          # past the stage's max_queue_seconds, never started
            return True
        return False


def _lost_progress(runs: list[list[int]]) -> tuple[int, int]:
    """(the most lines a later run of a task's job printed again, how many later runs there
    were), from each run's numbered lines in creation order: each run resumes after its newest
    checkpoint, so what it prints again is what the failure before it cost."""
    runs = [lines for lines in runs if lines]
    worst, reached = 0, -1
    for lines in runs:
        worst = max(worst, reached - min(lines) + 1)
        reached = max(reached, max(lines))
    return worst, max(0, len(runs) - 1)


def hyperpod_job(job: dict[str, Any]) -> dict[str, Any]:
    """A HyperPod job of tests/chaos/fake_eks.py's report in the fake AWS's job shape: a delete
    is its stop request (the backend's stop), and a deleted job ended when its pods were gone;
    the training operator's DeadlineExceeded (runPolicy.activeDeadlineSeconds, the compressed
    MaxRuntime) is a stop at its deadline."""
    ended = job["ended_at"] or job.get("pods_gone_at")
    stops = [{"at": job["deleted_at"], "user_agent": "kubernetes (delete)"}] if job.get("deleted_at") else []
    return {**job, "ended_at": ended, "stop_requests": stops, "streams": [],
            "stopped_by": "deadline" if job.get("condition_reason") == "DeadlineExceeded" else ""}


def _log_group(job: dict[str, Any]) -> str:
    """The CloudWatch log group the service writes the job's streams to."""
    return "/aws/sagemaker/TrainingJobs" if job["service"] == "sagemaker" else "/aws/batch/job"


def _cancelled_before_start(job: dict[str, Any]) -> bool:
    """A stop was asked for before the job's container started (or it never started)."""
    stops = [s["at"] for s in job.get("stop_requests") or []]
    return bool(stops) and (not job.get("started_at") or min(stops) <= job["started_at"])


def _most_at_once(jobs: list[dict[str, Any]]) -> int:
    """The most jobs alive at one moment: each from its creation to its end or its first stop
    request, whichever came first."""
    edges = []
    for job in jobs:
        ends = [t for t in [job.get("ended_at"), *(s["at"] for s in job.get("stop_requests") or [])] if t]
        edges += [(job["created_at"], 1), (min(ends) if ends else float("inf"), -1)]
    alive = most = 0
    for _, step in sorted(edges):       # at a tie the end (-1) sorts first: a hand-over, not two
        alive += step
        most = max(most, alive)
    return most


def _agent(user_agent: str) -> str:
    """The caller, in short, from a botocore User-Agent."""
    parts = [p for p in user_agent.split() if p.startswith(("Airflow", "airflow", "Botocore", "md/"))]
    return " ".join(parts[:2]) or user_agent[:40]


# -- rows ------------------------------------------------------------------------------------------
# Each row function triggers its runs, applies its fault, records where it landed (Row.land) or
# why not (Row.miss) for every half it claims, and returns when its runs have ended.

PARALLELISM = 8   # the deployment's worker slots (see Matrix.start)
OWN_CONNECTIONS = 8   # AWS connections for rows whose faults are narrowed to their jobs (Matrix.own_connection)
HALVES = {"pretrain": "sagemaker", "finetune": "batch"}   # the chaos DAGs' AWS tasks and their service


def halves(runs: list[Run]) -> list[tuple[Run, str]]:
    """(run, task_id) for each remote task of each run."""
    return [(r, t) for r in runs for t in r.tasks]


def _each_task(body: Callable[..., None], runs: list[Run] | None = None) -> None:
    """`body(task_id)` for both tasks at once, or with `runs`, `body(run, task_id)` for each
    task of each run: a fault waited for on one task must not let another's moment pass (a
    worker that defers while we wait on the other task's)."""
    calls = [(t,) for t in REMOTE_TASKS] if runs is None else halves(runs)
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        for future in [pool.submit(body, *call) for call in calls]:
            future.result()


def row_faults(rules: list[dict[str, Any]], both: bool = True, own_jobs: bool = False,
               halves: dict[str, str] | None = None, wait: float = 300.0,
               hyperpod: bool | Callable[[Matrix, str], None] = False,
               hyperpod_dags: tuple[str, ...] = (HYPERPOD_DAG,)) -> Callable[[Matrix, Row], None]:
    """Fault rules while a deferred run (and, with `both`, an in-worker one) runs. `own_jobs`:
    the rules are narrowed to the calls about this row's jobs (by their run_id tag), and its runs
    reach AWS through a connection of their own (Matrix.own_connection), so the row can run
    beside others; otherwise they hit every call and the row runs alone. `halves`: the
    service each task's half must see the rules hit (HALVES by default); `wait`: how long the
    runs may take beyond twice the job's length. `hyperpod`: a run of each of `hyperpod_dags`
    too (the rules narrowed to its jobs as well: its pods' S3 calls); as `hyperpod(m, run_id)`,
    with the fault this arms in the simulated cluster for that run's jobs, each run's half
    (`<dag>/train`) landing where the cluster injected it."""
    def body(m: Matrix, row: Row) -> None:
        dags = [SMALL_DAG] + ([WORKER_DAG] if both else [])
        run_ids = [m.new_run_id() for _ in dags]
        hyperpod_runs = [(dag_id, m.new_run_id()) for dag_id in hyperpod_dags] if hyperpod else []
        narrowed = [f"run_id={i}" for i in run_ids + [run_id for _, run_id in hyperpod_runs]]
        applied = [{**r, "jobs": narrowed} if own_jobs else r for r in rules]
        row.rule_halves = dict(halves or HALVES)
        row.claim(*row.rule_halves)
        if callable(hyperpod):
            for dag_id, run_id in hyperpod_runs:
                row.claim(f"{dag_id}/{HYPERPOD_TASKS[0]}")
                hyperpod(m, run_id)
        conf = {**m.conf(), **(m.own_connection() if own_jobs else {})}
        m.add_faults(row, applied)
        try:
            for dag_id, run_id in list(zip(dags, run_ids)) + hyperpod_runs:
                m.trigger(row, dag_id, conf, run_id)
            m.wait_runs(row, timeout=wait + 2 * m.seconds)
        finally:
            m.remove_faults(row)
        row.notes.append(f"faults: {json.dumps(applied)}")
        if callable(hyperpod):
            injections = m.eks.report()["injections"]
            for dag_id, run_id in hyperpod_runs:
                hits = [i for i in injections if i.get("run_id") == run_id]
                if hits:
                    row.land(f"{dag_id}/{HYPERPOD_TASKS[0]}",
                             f"{len(hits)} {'/'.join(sorted({i['kind'] for i in hits}))} injections "
                             f"into its Kubernetes API calls {_count(i['operation'] for i in hits)}",
                             at=hits[0]["at"])
    return body


def row_lifecycle_throttle(m: Matrix, row: Row) -> None:
    """The whole lifecycle, pretraining on SageMaker and fine-tuning on Batch, its jobs' describe
    and log calls throttled (the rule narrowed to its run's jobs: it runs beside other rows)."""
    conf = {"recipe": "tiny", "sweep_trials": 1, "backend_pretrain": "sagemaker",
            "backend_finetune": "batch", "storage_root": str(m.workdir / "storage"),
            "stage_resources": {"pretrain": {"instance_type": "ml.g5.2xlarge", "max_run_seconds": 3600},
                                "finetune": {"instance_type": "p4d.24xlarge", "max_run_seconds": 3600}}}
    assert m.dep is not None
    # Beside other rows on 2 cores, a re-parse of the lifecycle file can run past the
    # dag-processor's timeout and the DAG be briefly gone (a 404 seen once): wait for it.
    m.dep.wait_dag(LIFECYCLE_DAG, timeout=300)
    run_id = m.new_run_id()
    rules = [{**rule, "jobs": [f"run_id={run_id}"]} for rule in THROTTLE]
    row.rule_halves = dict(HALVES)
    row.claim(*HALVES)
    m.add_faults(row, rules)
    try:
        m.trigger(row, LIFECYCLE_DAG, conf, run_id)
        # the whole lifecycle: ~10 minutes beside the other rows, and at load 11 fine-tuning was
        # submitted only after 15 (past a 900 s wait, its half unhit by the then removed rules)
        m.wait_runs(row, timeout=1800)
    finally:
        m.remove_faults(row)
    row.notes.append(f"faults: {json.dumps(rules)}")


def row_component(component: str, how: str) -> Callable[[Matrix, Row], None]:
    """A component killed (SIGKILL to its whole session, then started again) or restarted
    (SIGTERM, then a new one), while both runs' jobs run: it lands on each task whose job was
    running (and, for the triggerer, whose task was deferred) at that moment."""
    def body(m: Matrix, row: Row) -> None:
        assert m.dep is not None
        runs = [m.trigger(row, SMALL_DAG, m.conf()), m.trigger(row, HYPERPOD_DAG, m.conf())]
        if component != "triggerer":
            runs.append(m.trigger(row, WORKER_DAG, m.conf()))
        row.claim(*[f"{r.dag_id}/{t}" for r, t in halves(runs)])
        started = time.monotonic()
        for run, task_id in halves(runs):
            m.wait_running(run, task_id, after=5)
        deferred = set()
        if component == "triggerer":
            for run, task_id in halves(runs):
                if m.wait_ti(run, task_id, {"deferred"}, timeout=60)["state"] == "deferred":
                    deferred.add(f"{run.dag_id}/{task_id}")
        waited = time.monotonic() - started
        hit_at = time.time()
        if how == "kill":
            m.dep.kill(component)
            time.sleep(2)
            m.dep.restart(component, sig=None)
        else:
            m.dep.restart(component, sig=signal.SIGTERM, grace=20)
        row.notes.append(f"{component} {how} + start took {time.time() - hit_at:.0f}s")
        report = m.report()
        for run, task_id in halves(runs):
            half = f"{run.dag_id}/{task_id}"
            live = [j for j in m.jobs_of(run, task_id, report) if j.get("started_at")
                    and j["started_at"] <= hit_at and (not j.get("ended_at") or j["ended_at"] > hit_at)]
            if not live:
                row.miss(half, f"no job of it was running when the {component} was hit")
            elif component == "triggerer" and half not in deferred:
                row.miss(half, "its task was not deferred when the triggerer was killed")
            else:
                row.land(half, f"{component} {how} while {live[0]['name']} ran", waited, at=hit_at)
        m.wait_runs(row, timeout=300 + 2 * m.seconds)
    return body


def _worker_of(m: Matrix, run: Run, task_id: str, timeout: float) -> tuple[int, int] | None:
    """The task runner of the task's running try, watched for from the moment it exists. Each
    try has a task instance id of its own: a try that died before its worker was seen (its start
    call to the API server timing out on busy cores, seen in a full run at high load) is followed
    by the next try's id, which is read again every 2 s."""
    assert m.dep is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ti = m.ti(run, task_id)           # the task instance exists from the run's creation
        if ti["state"] in TERMINAL_TI:
            return None
        until = min(deadline, time.monotonic() + 2)
        while time.monotonic() < until:
            pids = m.dep.worker_pids(ti["id"])
            if pids:
                return pids
            time.sleep(0.05)
    return None


def _kill_worker(m: Matrix, row: Row, run: Run, task_id: str, sig: int, when: str) -> None:
    """`sig` to the task runner of the task's running try: `mid_job` once its job has run 5 s,
    `after_submit` as soon as its log names the submitted job (before it defers: the worker
    is watched from the moment it exists, so the short window is not missed)."""
    assert m.dep is not None
    started = time.monotonic()
    if when == "after_submit":
        # A try can die on its own before it submits (in a CI run at load 3-5 a first try did,
        # and the worker watched was gone when the signal came): the next try's worker is then
        # watched instead, until one names its job while it lives.
        deadline = time.monotonic() + 600
        pids = _worker_of(m, run, task_id, timeout=600)
        while pids and time.monotonic() < deadline:
            if not alive(pids[0]):
                row.notes.append(f"{task_id}: task runner {pids[0]} exited before the signal; "
                                 "watching the next try")
                pids = _worker_of(m, run, task_id, timeout=max(1.0, deadline - time.monotonic()))
            elif m.named_in_log(run, task_id):
                break
            else:
                time.sleep(0.02)
    else:
        m.wait_running(run, task_id, after=5)
        pids = _worker_of(m, run, task_id, timeout=10)
    waited = time.monotonic() - started
    if not pids:
        row.miss(task_id, f"no worker process found in {waited:.0f}s (state {m.ti(run, task_id)['state']})")
        return
    try:
        os.kill(pids[0], sig)
    except ProcessLookupError:
        row.miss(task_id, f"the worker had exited before the signal (state {m.ti(run, task_id)['state']})")
        return
    named = sorted(m.named_in_log(run, task_id))
    row.land(task_id, f"{signal.Signals(sig).name} to task runner {pids[0]} ({when}, job {named})", waited)
    time.sleep(1.5)
    row.notes.append(f"{task_id}: sent {signal.Signals(sig).name} to task runner {pids[0]} "
                     f"({when}); task then {m.ti(run, task_id)['state']}")


def row_worker(sig: int, when: str, dag_id: str, hyperpod: bool = False) -> Callable[[Matrix, Row], None]:
    """`hyperpod`: a run of the HyperPod DAG that waits as `dag_id` does (deferred, or in the
    worker) too, its worker signalled the same way."""
    def body(m: Matrix, row: Row) -> None:
        runs = [m.trigger(row, dag_id, m.conf())]
        if hyperpod:
            runs.append(m.trigger(row, HYPERPOD_WORKER_DAG if dag_id == WORKER_DAG else HYPERPOD_DAG, m.conf()))
        row.claim(*[t for _, t in halves(runs)])
        _each_task(lambda run, t: _kill_worker(m, row, run, t, sig, when), runs)
        m.wait_runs(row, timeout=300 + 2 * m.seconds)
    return body


def row_clear_after_success(m: Matrix, row: Row) -> None:
    assert m.dep is not None
    runs = [m.trigger(row, dag_id, m.conf(seconds=max(5, m.seconds // 3))) for dag_id in (SMALL_DAG, HYPERPOD_DAG)]
    row.claim(*REMOTE_TASKS, *HYPERPOD_TASKS)
    # long enough for the run to get worker slots beside 18 other rows on a loaded machine (at
    # load 11 it was still queued after 300 s, and the clear found nothing that had succeeded)
    m.wait_runs(row, timeout=900)
    before = {t: len(m.jobs_of(r, t)) for r, t in halves(runs)}
    states = {(r.run_id, t): m.ti(r, t) for r, t in halves(runs)}
    for run in runs:
        m.dep.clear_task(run.dag_id, run.run_id, list(run.tasks))
    for run, task_id in halves(runs):
        ti = states[(run.run_id, task_id)]
        if ti["state"] == "success":
            row.land(task_id, f"cleared after success (try {ti['try_number']})")
        else:
            row.miss(task_id, f"it had not succeeded when cleared ({ti['state']})")
    time.sleep(3)
    m.wait_runs(row, timeout=300)
    after = {t: len(m.jobs_of(r, t)) for r, t in halves(runs)}
    row.notes.append(f"jobs per task before the clear {before}, after {after}")


def row_clear_mid_run(m: Matrix, row: Row) -> None:
    """Each run's tasks cleared once its jobs run (a run clears as soon as its own jobs run: the
    30 s SageMaker and Batch jobs would end while waiting on the HyperPod job's start)."""
    assert m.dep is not None
    runs = [m.trigger(row, dag_id, m.conf()) for dag_id in (SMALL_DAG, HYPERPOD_DAG)]
    row.claim(*REMOTE_TASKS, *HYPERPOD_TASKS)

    def clear(run: Run) -> None:
        assert m.dep is not None
        started = time.monotonic()
        jobs: dict[str, Any] = {}
        _each_task(lambda r, t: jobs.__setitem__(t, m.wait_running(r, t, after=5)), [run])
        waited = time.monotonic() - started
        m.dep.clear_task(run.dag_id, run.run_id, list(run.tasks))
        report = m.report()
        for task_id in run.tasks:
            job = next((j for j in m.jobs_of(run, task_id, report) if jobs.get(task_id)
                        and j["job_id"] == jobs[task_id]["job_id"]), None)
            if job is None or job.get("ended_at"):
                row.miss(task_id, "no job of it was running when the task was cleared")
            else:
                row.land(task_id, f"cleared while {job['name']} ran", waited)

    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        for future in [pool.submit(clear, run) for run in runs]:
            future.result()
    time.sleep(3)
    m.wait_runs(row, timeout=300 + 2 * m.seconds)


def row_same_conf_twice(m: Matrix, row: Row) -> None:
    conf = m.conf()
    pairs = [[m.trigger(row, dag_id, conf), m.trigger(row, dag_id, conf)] for dag_id in (SMALL_DAG, HYPERPOD_DAG)]
    row.claim(*REMOTE_TASKS, *HYPERPOD_TASKS)
    # What is judged is each run's end: its four runs wait for worker slots beside the other rows,
    # and in a CI run at load 3-5 they were still running after 360 s (with no job yet for some)
    m.wait_runs(row, timeout=900)
    report = m.report()
    for runs in pairs:
        for task_id in runs[0].tasks:
            jobs = [m.jobs_of(r, task_id, report) for r in runs]
            if all(jobs):
                row.land(task_id, f"both runs of one conf submitted: {[j[0]['name'] for j in jobs]}")
            else:
                row.miss(task_id, f"a run submitted no job ({[len(j) for j in jobs]} jobs)")


SERVICE_ACTIONS = {"fail": "fail", "stop": "stop", "host": "lose_host",
                   "reclaim": "reclaim"}   # action -> ChaosClient method
# action -> what the simulated cluster does to the job's first pod (or the job) for it
HYPERPOD_ACTIONS: dict[str, Callable[[Any, str], None]] = {
    "fail": lambda eks, name: eks.crash(name, 0), "stop": lambda eks, name: eks.delete(name),
    "host": lambda eks, name: eks.lose_host(name, 0)}


def row_service(action: str, after: float = 5.0, conf: dict[str, Any] | None = None,
                hyperpod: bool = False) -> Callable[[Matrix, Row], None]:
    """The first attempt of each task's job, `after` s into its run, fails (its container
    crashes), is stopped from the console, loses its node's host (and the node's disk with
    it), or has its spot capacity reclaimed, on the service side. A crash or a stop fails the
    try, and the task's retry must start `-r2`; a lost host is the service's fault, and the
    operator's next attempt goes on at once; a reclaimed SageMaker managed spot job restarts
    inside itself (Batch: its host is lost). Either way the new container resumes from the
    newest checkpoint on S3 (lost_progress_steps). `conf`: the run's extra Params. `hyperpod`:
    a run of the HyperPod DAG too. Its job's first pod crashes, or a user deletes the job
    (`kubectl delete`: the backend is not told), or the pod's host is lost. A crash or a lost
    host: the operator restarts every pod on replaced nodes with empty disks, in the same job
    (HyperPod's auto-resume). A deleted job is gone: the try fails, and the retry's new job
    resumes from S3."""
    def body(m: Matrix, row: Row) -> None:
        assert m.dep is not None
        runs = [m.trigger(row, SMALL_DAG, {**m.conf(), **(conf or {})})]
        if hyperpod:
            runs.append(m.trigger(row, HYPERPOD_DAG, m.conf()))
        row.claim(*[t for _, t in halves(runs)])

        def hit(run: Run, task_id: str) -> None:
            started = time.monotonic()
            job = m.wait_running(run, task_id, after=after)
            waited = time.monotonic() - started
            if job is None:
                row.miss(task_id, f"no running job to {action} in {waited:.0f}s")
                return
            if job["service"] == "hyperpod":
                if action == "stop":
                    row.service_stopped.add(job["name"])
                HYPERPOD_ACTIONS[action](m.eks, job["name"])
            else:
                target = job["job_id"] if job["service"] == "batch" else job["name"]
                if action == "stop":
                    row.service_stopped.add(job["name"])
                getattr(m.chaos, SERVICE_ACTIONS[action])(target)
            row.land(task_id, f"{action} {job['name']} on the service side", waited)

        _each_task(hit, runs)
        m.wait_runs(row, timeout=300 + 2 * m.seconds)
        report = m.report()
        run = runs[0]
        for task_id in run.tasks:
            first = [j for j in m.jobs_of(run, task_id, report) if not BASE.search(j["name"])]
            reason = first[0].get("reason", "") if first else ""
            text = "\n".join(e["event"] for e in m.dep.task_log_events(run.dag_id, run.run_id, task_id))
            shown = bool(reason) and reason.split(":")[0][:40] in text
            row.notes.append(f"{task_id}: service reason {reason[:80]!r} "
                             f"{'is' if shown else 'is NOT'} in the task log")
    return body


# The stage's max_queue_seconds against a capacity wait six times as long: every job of the row
# waits held for capacity, and past the bound Airflow stops it and fails the task with the
# service's own reason (the simulators' capacity waits hold every job made meanwhile: the row
# runs alone). HyperPod: no node fits the job's pods (the scheduler's Unschedulable, "Insufficient
# <resource>"), the bound our own check.
QUEUE_LIMIT_S = 20
CAPACITY_WORDS = {"pretrain": "capacity", "finetune": "capacity", "train": "insufficient"}


def row_queue_limit(m: Matrix, row: Row) -> None:
    assert m.dep is not None
    row.queue_limit_s = QUEUE_LIMIT_S
    bound = {"max_queue_seconds": QUEUE_LIMIT_S}
    m.chaos.config(capacity_wait_seconds=QUEUE_LIMIT_S * 6)
    m.eks.hold_nodes(QUEUE_LIMIT_S * 6)
    try:
        runs = [m.trigger(row, dag_id, {**m.conf(), "settings_overrides": {
            "SageMakerSettings": bound, "BatchSettings": bound, "HyperPodSettings": bound}})
            for dag_id in (SMALL_DAG, HYPERPOD_DAG)]
        row.claim(*REMOTE_TASKS, *HYPERPOD_TASKS)
        m.wait_runs(row, timeout=300 + QUEUE_LIMIT_S * 6)
    finally:
        m.chaos.config(capacity_wait_seconds=0.0)
        m.eks.hold_nodes(0)
    report = m.report()
    for run, task_id in halves(runs):
        # none of its jobs ever ran, so none printed its label: they are the ones its log names
        run.bases[task_id] |= {base_of(n) for n in m.named_in_log(run, task_id)}
        jobs = m.jobs_of(run, task_id, report)
        ti = m.ti(run, task_id)
        text = "\n".join(e["event"] for e in m.dep.task_log_events(run.dag_id, run.run_id, task_id))
        started = [j["name"] for j in jobs if j.get("started_at")]
        if not jobs:
            row.miss(task_id, f"no job was made (task {ti['state']})")
        elif started:
            row.miss(task_id, f"{started} started: the capacity wait did not hold them")
        else:
            row.land(task_id, f"{len(jobs)} job(s) held for capacity, none started; task {ti['state']}")
            if ti["state"] != "failed":
                row.notes.append(f"ERROR: {task_id} ended {ti['state']}, not failed, past max_queue_seconds")
            if (not re.search(r"max_queue_seconds \(%ds\)" % QUEUE_LIMIT_S, text)
                    or CAPACITY_WORDS[task_id] not in text.lower()):
                row.notes.append(f"ERROR: {task_id}'s log does not say the job passed max_queue_seconds "
                                 "waiting for capacity, in the service's words")


# The compressed MaxRuntime: 60 s per attempt (Batch's least attemptDurationSeconds) for a job of
# 170 lines, ~55 of which fit in an attempt: three stops at least, each resumed from the newest
# checkpoint inside the same task try.
MAX_RUNTIME_S, MAX_RUNTIME_LINES = 60, 170


def row_max_runtime(m: Matrix, row: Row) -> None:
    """The stage outlives its MaxRuntime three times: the service stops each attempt at its
    deadline (SageMaker MaxRuntimeExceeded, Batch's attempt duration, HyperPod's
    activeDeadlineSeconds) and the operator's next attempt goes on from the newest checkpoint,
    in the same try."""
    runs = [m.trigger(row, dag_id, {**m.conf(seconds=MAX_RUNTIME_LINES), "max_run_seconds": MAX_RUNTIME_S})
            for dag_id in (SMALL_DAG, HYPERPOD_DAG)]
    row.claim(*REMOTE_TASKS, *HYPERPOD_TASKS)
    m.wait_runs(row, timeout=1200)
    report = m.report()
    for run, task_id in halves(runs):
        stops = [j for j in m.jobs_of(run, task_id, report) if j.get("stopped_by") == "deadline"]
        if len(stops) >= 3:
            row.land(task_id, f"{len(stops)} MaxRuntime stops: {', '.join(j['name'] for j in stops)}",
                     at=stops[0]["ended_at"])
        else:
            row.miss(task_id, f"{len(stops)} MaxRuntime stop(s), not 3")


def row_mark_failed(m: Matrix, row: Row) -> None:
    """Control row: the user marks the deferred tasks failed (once their trigger runs: what a
    user does to a multi-day job); their jobs must be stopped (the stops are expected) and none
    must be left running (orphaned_jobs: within ORPHAN_AFTER s). HyperPod: the trigger's clean-up
    deletes the job."""
    assert m.dep is not None
    runs = [m.trigger(row, dag_id, m.conf(seconds=max(m.seconds, 90))) for dag_id in (SMALL_DAG, HYPERPOD_DAG)]
    row.claim(*REMOTE_TASKS, *HYPERPOD_TASKS)

    def mark(run: Run, task_id: str) -> None:
        assert m.dep is not None
        started = time.monotonic()
        m.wait_running(run, task_id, after=5)
        m.wait_ti(run, task_id, {"deferred"}, timeout=120)
        # The trigger runs: its log part shows a poll (a job line it forwarded), not only its
        # "starting" line.
        deadline, polled = time.monotonic() + 120, False
        while time.monotonic() < deadline and not polled:
            polled = any(e["source"].startswith("trigger.") and "chaos-line" in e["event"]
                         for e in m.dep.task_log_events(run.dag_id, run.run_id, task_id))
            time.sleep(0.5)
        state = m.ti(run, task_id)["state"]
        run.bases[task_id] |= {base_of(n) for n in m.named_in_log(run, task_id)}
        for base in run.bases[task_id]:
            row.marked_failed[base] = time.time()
        m.dep.mark_failed(run.dag_id, run.run_id, task_id)
        if state == "deferred" and polled:
            row.land(task_id, f"marked failed while deferred, its trigger polling "
                              f"({sorted(run.bases[task_id])})", time.monotonic() - started)
        else:
            row.miss(task_id, f"marked failed while {state}, "
                              f"{'its trigger polling' if polled else 'NO trigger poll seen in 120 s'}")

    _each_task(mark, runs)
    m.wait_runs(row, timeout=300 + 2 * m.seconds)


# Rows narrowed to their own jobs count their windows per job from its first matched call
# ("per_job_seconds"): counted from the row's start, a window closed before a job that a loaded
# machine started late made its first call (three rows' faults did not land at load 11).
# The first two status reads of each service's jobs are throttled for sure, then half of every
# describe and log call: at 50% alone a short job's few polls could all pass (the lifecycle's
# pretraining job on a quiet machine once did, and its half of the row did not land).
THROTTLE = [{"operations": ["DescribeTrainingJob"], "kind": "throttle", "count": 2},
            {"operations": ["DescribeJobs"], "kind": "throttle", "count": 2},
            {"operations": DESCRIBE_AND_LOGS, "kind": "throttle", "rate": 0.5, "per_job_seconds": 900}]
# The answers to the row's own creates lost after the service acted on them (a read timeout on
# AWS): botocore sends the same request again, and the job it made first must be the only one.
# Twice per service: both runs' first creates, or one create and its resend. HyperPod: the
# connection drops after the API server made the job; urllib3 does not resend a POST, the
# backend does, gets a 409 Conflict, and must know the job as its own (by its token).
LOST_CREATES = [{"operations": ["CreateTrainingJob"], "kind": "lost", "count": 2},
                {"operations": ["SubmitJob"], "kind": "lost", "count": 2}]


def lose_hyperpod_creates(m: Matrix, run_id: str) -> None:
    m.eks.lose_responses("create_namespaced_custom_object", 1, run_id=run_id)


def throttle_hyperpod(m: Matrix, run_id: str) -> None:
    """The Kubernetes API's priority and fairness answers 429 to the run's job's reads: its
    first two for sure, then half of them (THROTTLE's shape)."""
    m.eks.inject("429", KUBE_READS, count=2, run_id=run_id)
    m.eks.inject("429", KUBE_READS, rate=0.5, seconds=900, run_id=run_id)
SERVICES = ["sagemaker", "batch", "logs", "s3"]
# 150 s from the row's start: long enough to cover both halves' submits and first polls even on
# a loaded machine (with 60 s, at load 27 the SageMaker half made its first call after the window)
FIVE_XX = [{"operations": ["*"], "services": SERVICES, "kind": "500", "rate": 0.15, "seconds": 150},
           {"operations": ["*"], "services": SERVICES, "kind": "503", "rate": 0.18, "seconds": 150}]
RESETS = [{"operations": ["*"], "services": SERVICES, "kind": "reset", "rate": 0.2, "seconds": 150}]


def five_xx_hyperpod(m: Matrix, run_id: str) -> None:
    """FIVE_XX on every Kubernetes API call about the run's job, its create and delete too."""
    for rule in FIVE_XX:
        m.eks.inject(rule["kind"], KUBE_CALLS, rate=rule["rate"], seconds=rule["seconds"], run_id=run_id)


def resets_hyperpod(m: Matrix, run_id: str) -> None:
    """RESETS on every Kubernetes API call about the run's job: the connection drops before the
    API server reads the call (urllib3 resends a GET or DELETE by itself, never a POST)."""
    for rule in RESETS:
        m.eks.inject("reset", KUBE_CALLS, rate=rule["rate"], seconds=rule["seconds"], run_id=run_id)
# Every status and log read about the row's jobs answered 503 for 10 minutes: far longer than the
# jobs (they end meanwhile) and than any retry budget. Nothing may fail or stop; once the reads
# come back, the task must pick up the job's end, its result and its whole log.
OUTAGE_S = 600
# How long the row's runs may take beyond the jobs: the outage, then a watch's last wait before
# its next read (a full-jitter backoff capped at Backoff.cap, 300 s: after 10 minutes of failed
# reads that wait is uniform in [0, 300] s), then the runs' starts and ends at the scoped group's
# load. 300 s of slack was too little once: a CI run's row timed out at 962 s with one run left.
OUTAGE_WAIT_S = OUTAGE_S + Backoff.cap + 300
OUTAGE = [{"operations": DESCRIBE_AND_LOGS, "kind": "503", "per_job_seconds": OUTAGE_S}]


def hyperpod_outage(m: Matrix, run_id: str) -> None:
    """The Kubernetes API's status and log reads about the run's job answer 503 for OUTAGE_S
    from the first one (the job's create and the reads before it are not hit)."""
    m.eks.outage(KUBE_READS, OUTAGE_S, run_id=run_id)
# S3's 503 SlowDown to the jobs' own writes (their checkpoints, their result) for 60 s: the jobs
# retry with backoff (tasks/train/checkpoint_s3.py) and neither fail nor lose a checkpoint. The
# Batch and HyperPod halves: a SageMaker job writes its checkpoints to local disk and the service
# syncs them (its own traffic, which S3 may slow down without the job knowing), so no upload of the
# job is slowed.
SLOWDOWN = [{"operations": ["PutObject", "UploadPart", "CreateMultipartUpload", "CompleteMultipartUpload"],
             "services": ["s3"], "kind": "throttle", "origin": "jobs", "per_job_seconds": 60}]
SPOT = {"settings_overrides": {"SageMakerSettings": {"spot": True}}}

# The side-by-side rows start this many seconds apart. Started at once, some 40 DAG runs' first
# tries and their jobs' torch imports met on 2 cores: in the first full run with HyperPod in 21
# rows two first tries died before their workers were seen, and one marked-failed task's job got
# no stop request.
STAGGER_S = 3.0
# The global rows start this long after the "beside" row: its runs' starts and jobs (the busiest
# part of it) are over by then, and its reads already fail.
OUTAGE_LEAD_S = 60.0

# (fault, body, group): "global" rows run alone, one after another (their faults hit every
# client: 5xx and resets also hit S3 and creates, which no job tag narrows; a component restart
# hits every run); the "scoped" rows touch only their own runs and jobs and run side by side.
# The "beside" row, the read outage, runs from the start beside them all. After its jobs' first
# minute it only waits: its jobs have ended, and every read about them gets its own rule's 503
# (the first rule that fires wins, and its rule is pushed first), so no global row's fault
# reaches its calls. What does reach it is what reaches a real deployment in an outage: a
# triggerer killed or a scheduler restarted meanwhile (the deferred task's trigger is re-created,
# the in-worker task's next try reattaches). Run after the scoped rows, as before, it alone held
# the matrix 470 s longer (1,032 s against 560 s for the next longest row).
ROWS: list[tuple[str, Callable[[Matrix, Row], None], str]] = [
    ("throttle storm 50% describe+logs (HyperPod: 429 to the Kubernetes API's reads)",
     row_faults(THROTTLE, own_jobs=True, hyperpod=throttle_hyperpod), "scoped"),
    ("throttle storm, full lifecycle (pretrain SageMaker, finetune Batch)", row_lifecycle_throttle, "scoped"),
    ("answers to CreateTrainingJob / SubmitJob / the HyperPod create lost after the job was made",
     row_faults(LOST_CREATES, own_jobs=True, hyperpod=lose_hyperpod_creates), "scoped"),
    ("5xx burst 30% for 150s", row_faults(FIVE_XX, hyperpod=five_xx_hyperpod), "global"),
    ("connection resets 20% for 150s", row_faults(RESETS, hyperpod=resets_hyperpod), "global"),
    ("triggerer SIGKILLed mid-deferral, restarted", row_component("triggerer", "kill"), "global"),
    ("scheduler restarted (SIGTERM) mid-job", row_component("scheduler", "restart"), "global"),
    ("API server restarted (SIGTERM) mid-job", row_component("api-server", "restart"), "global"),
    ("worker SIGKILLed mid-job (in-worker wait)", row_worker(signal.SIGKILL, "mid_job", WORKER_DAG, hyperpod=True),
     "scoped"),
    ("worker SIGKILLed right after submit (deferred)",
     row_worker(signal.SIGKILL, "after_submit", SMALL_DAG, hyperpod=True), "scoped"),
    ("worker SIGTERMed mid-job (in-worker wait)", row_worker(signal.SIGTERM, "mid_job", WORKER_DAG, hyperpod=True),
     "scoped"),
    ("task cleared after success", row_clear_after_success, "scoped"),
    ("task cleared mid-run", row_clear_mid_run, "scoped"),
    ("same conf triggered twice", row_same_conf_twice, "scoped"),
    ("job fails on the service side (HyperPod: a pod crashes)", row_service("fail", hyperpod=True), "scoped"),
    ("job stopped on the service side (HyperPod: kubectl delete)", row_service("stop", hyperpod=True), "scoped"),
    ("node's host lost mid-job (next attempt on a fresh disk, from S3; HyperPod: pods on replaced nodes)",
     row_service("host", after=20, hyperpod=True), "scoped"),
    ("stage outlives MaxRuntime three times (60 s attempts)", row_max_runtime, "scoped"),
    ("capacity wait past max_queue_seconds (20 s)", row_queue_limit, "global"),
    ("spot capacity reclaimed mid-job (SageMaker managed spot; Batch: its host)",
     row_service("reclaim", after=12, conf=SPOT), "scoped"),
    ("describe and log reads down for 10 minutes (503; HyperPod: the Kubernetes API's)",
     row_faults(OUTAGE, own_jobs=True, wait=OUTAGE_WAIT_S, hyperpod=hyperpod_outage,
                hyperpod_dags=(HYPERPOD_DAG, HYPERPOD_WORKER_DAG)), "beside"),
    ("SlowDown on the jobs' own checkpoint uploads for 60 s (Batch, HyperPod)",
     row_faults(SLOWDOWN, own_jobs=True, halves={"finetune": "s3", "train": "s3"}, hyperpod=True), "scoped"),
    ("task marked failed by the user (control)", row_mark_failed, "scoped"),
]


def _run_row(m: Matrix, fault: str, body: Callable[[Matrix, Row], None], after: float = 0.0) -> Row:
    time.sleep(after)
    row = Row(fault, started_at=time.time())
    started = time.monotonic()
    try:
        body(m, row)
    except Exception as exc:  # a row that breaks is reported, the others still run
        row.error = f"{type(exc).__name__}: {exc}"[:2000]
        traceback.print_exc()
    row.seconds = time.monotonic() - started
    row.ended_at = time.time()
    print(f"[{time.strftime('%H:%M:%S')}] row done in {row.seconds:4.0f}s: {fault}", flush=True)
    return row


def run_matrix(workdir: Path | None = None, only: list[str] | None = None, seconds: float = 30.0,
               lifecycle: bool = True, database: str = "postgresql") -> dict[str, Any]:
    """Run the selected rows (substrings of their fault names; all by default) and measure."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="llmops-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    selected = [r for r in ROWS if (not only or any(o.lower() in r[0].lower() for o in only))
                and (lifecycle or r[1] is not row_lifecycle_throttle)]
    started = time.monotonic()
    load_before = os.getloadavg()
    m = Matrix(workdir, seconds=seconds, database=database)
    rows: list[Row] = []
    setup_seconds = 0.0
    try:
        m.start()
        setup_seconds = time.monotonic() - started
        print(f"deployment up in {setup_seconds:.0f}s (workdir {workdir})", flush=True)
        # Global rows run alone (but for the "beside" row), one after another; then the scoped
        # rows side by side (they touch only their own runs, the lifecycle's throttle only its
        # own jobs).
        beside = [e for e in selected if e[2] == "beside"]
        groups = [[e] for e in selected if e[2] == "global"]
        scoped = [e for e in selected if e[2] == "scoped"]
        if scoped:
            groups.append(scoped)
        with concurrent.futures.ThreadPoolExecutor(max(1, len(beside))) as background:
            try:
                waiting = [background.submit(_run_row, m, f, b) for f, b, _ in beside]
                if waiting and groups:
                    time.sleep(OUTAGE_LEAD_S)
                for group in groups:
                    if len(group) == 1:
                        rows.append(_run_row(m, group[0][0], group[0][1]))
                        continue
                    bodies = [(f, b) for f, b, _ in group]
                    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
                        futures = [pool.submit(_run_row, m, f, b, i * STAGGER_S) for i, (f, b) in enumerate(bodies)]
                        rows.extend(f.result() for f in futures)
                rows.extend(f.result() for f in waiting)
            finally:
                m.chaos.clear()
        time.sleep(SETTLE)
        # A job still running with no stop request may yet get one: wait out ORPHAN_AFTER
        # after the last row's end before judging it.
        report = m.report()
        last = max((r.ended_at for r in rows), default=time.time())
        if any(not j.get("ended_at") and not j.get("stop_requests") for j in report["jobs"]):
            time.sleep(max(0.0, last + ORPHAN_AFTER + 5 - time.time()))
            report = m.report()
        measured = [m.measure(row, report) for row in rows]
        injections = report.get("injections") or []
        summary = {"injections": len(injections),
                   "injections_by_kind": _count(i.get("kind") for i in injections),
                   "jobs": len(report.get("jobs") or []),
                   "component_restarts": dict(m.dep.restarts) if m.dep else {},
                   "component_crashes": list(m.dep.crashes) if m.dep else []}
    finally:
        m.stop()
    total = time.monotonic() - started
    return {"rows": measured, "total_seconds": round(total, 1), "setup_seconds": round(setup_seconds, 1),
            "job_seconds": seconds, "database": database, "only": only or [], "summary": summary, "machine": machine_info(load_before),
            "workdir": str(workdir)}


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def machine_info(load_before: tuple[float, float, float]) -> dict[str, Any]:
    from importlib.metadata import version

    def v(name: str) -> str:
        try:
            return version(name)
        except Exception:
            return "?"

    return {"cpu_count": os.cpu_count(), "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(), "platform": platform.platform(),
            "airflow": v("apache-airflow"), "amazon_provider": v("apache-airflow-providers-amazon"),
            "moto": v("moto"), "boto3": v("boto3"),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "git_commit": _git_commit()}


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except Exception:
        return ""


def table(result: dict[str, Any]) -> str:
    header = ["fault", "runs", *COLUMNS, "seconds"]
    header.insert(-1, "lost_progress_steps")
    short = {"duplicate_jobs": "dup_jobs", "live_jobs_max": "live>1", "orphaned_jobs": "orphans", "wrongly_stopped_jobs": "wrong_stops",
             "lost_results": "lost", "duplicated_log_lines": "dup_lines", "lost_progress_steps": "lost_steps"}
    width = max(len(r["fault"]) for r in result["rows"]) if result["rows"] else 10
    lines = [f"{'fault':<{width}}  " + "  ".join(f"{short.get(h, h):>9}" for h in header[1:]) + "     landed"]
    for r in result["rows"]:
        landed = len({e["half"] for e in r.get("fault_landed", [])})
        lines.append(f"{r['fault']:<{width}}  " + "  ".join(f"{r.get(h, ''):>9}" for h in header[1:])
                     + f"  {landed:>4}/{landed + len(r.get('fault_missed', []))}")
    lines.append(f"total {result['total_seconds']:.0f}s (setup {result['setup_seconds']:.0f}s) on "
                 f"{result['machine']['cpu_count']} CPUs, load {result['machine']['load_average_before']} -> "
                 f"{result['machine']['load_average_after']}")
    return "\n".join(lines)


OUT = ROOT / "benchmarks" / "results" / "fault_matrix.json"   # the committed full run


def is_full(result: dict[str, Any]) -> bool:
    """Every row, at the default job length, on PostgreSQL: the run the committed JSON holds."""
    return (not result.get("only") and result.get("job_seconds") == 30.0
            and result.get("database") == "postgresql" and len(result["rows"]) == len(ROWS))


def write(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.matrix", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write the result (default {OUT.relative_to(ROOT)}, for a full "
                             "run only: a subset run is written only where --out says)")
    parser.add_argument("--only", default="", help="comma-separated substrings of fault names")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each small job")
    parser.add_argument("--no-lifecycle", action="store_true", help="skip the full lifecycle row")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--database", choices=("postgresql", "sqlite"), default="postgresql",
                        help="the deployment's metadata DB (MWAA uses PostgreSQL)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # SIGTERM too ends the matrix through its clean-up (the deployment and the fake AWS stop).
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    only = [o.strip() for o in args.only.split(",") if o.strip()]
    result = run_matrix(args.workdir, only or None, args.seconds, lifecycle=not args.no_lifecycle,
                        database=args.database)
    print(table(result))
    out = args.out or (OUT if is_full(result) else None)
    if out is None:
        print(f"a subset run: not written to {OUT.relative_to(ROOT)} (name a file with --out)")
    else:
        write(result, out)
        print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
