"""A real Airflow 3 deployment for tests: the four components `airflow standalone` runs, each its
own process in its own session, so that one can be killed and restarted while the others run.

`airflow standalone` starts the same four (`api-server`, `scheduler`, `dag-processor`,
`triggerer`) as threads of one parent that cannot restart a component: stopping one stops its
output thread, and SIGTERM to the parent orphans them. Here each component is `airflow <name>`
started with `start_new_session=True`, so everything it forks (the scheduler's LocalExecutor
workers and their task supervisors and task runners; the triggerer's runner; the API server's
workers) stays in that session and can be found, signalled and cleaned up as one.

Metadata DB: `database="postgresql"` starts a PostgreSQL cluster of its own in a temp dir
(tests/chaos/postgres.py), as MWAA uses PostgreSQL, and stops it with the deployment; the default
`"sqlite"` is what standalone uses with LocalExecutor in Airflow 3 (one writer at a time: the
settings below keep its lock waits from crashing components). What it sets, as standalone does:
LocalExecutor, SimpleAuthManager with a generated admin password
(`$AIRFLOW_HOME/simple_auth_manager_passwords.json.generated`, written by the API server at
start). What it sets that standalone does not need: one JWT secret for every component (the
scheduler signs task tokens that the API server checks; standalone components share a generated
airflow.cfg), the execution API URL on our port, a fast DAG refresh and a 30 s task heartbeat
timeout, so that a killed worker is noticed in about half a minute instead of five.

    dep = AirflowDeployment(workdir, dags_folder=ROOT / "tests" / "dags", env={...})
    dep.start()                        # db migrate, four components, wait until healthy
    run_id = dep.trigger("chaos_remote", {"seconds": 40})
    dep.kill("triggerer"); dep.restart("triggerer")
    worker, supervisor = dep.worker_pids(ti["id"])
    dep.stop()

Task logs: the worker's part of try N is `$AIRFLOW_HOME/logs/dag_id=.../run_id=.../task_id=...
/attempt=N.log` (JSON lines); the triggerer writes its part next to it as
`attempt=N.log.trigger.<triggerer job id>.log`, one file per triggerer that ran the trigger (a
restarted triggerer is a new job id, so a new file). `task_log_events` reads all of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterable

from tests.chaos.postgres import PostgresCluster, StartStop

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
# Components whose liveness the health endpoint reports (the API server's is the answer itself).
HEALTH_KEYS = {"scheduler": "scheduler", "dag-processor": "dag_processor", "triggerer": "triggerer"}
TERMINAL_TI = {"success", "failed", "skipped", "upstream_failed", "removed"}
TERMINAL_RUN = {"success", "failed"}
# SQLite connections wait this long for a lock instead of pysqlite's 5 s: with four components,
# their task workers and two busy cores, a write can wait longer, and a scheduler that gets
# "database is locked" exits. Read by Airflow through [database] sql_alchemy_connect_args.
SQLITE_CONNECT_ARGS = {"timeout": 120}
# ...but not the API server's: its requests that wait on the lock hold its threads (and, from its
# async routes, its event loop), so the request that holds the lock cannot finish and commit. Seen
# once in CI: two runs created at once, then every component waited on the lock for 30 minutes.
# Its requests give up after 15 s with a 500, which the Task SDK's client and `request` retry.
API_SQLITE_CONNECT_ARGS = {"timeout": 15}


def mwaa_worker_env() -> dict[str, str]:
    """The workers' settings the MWAA bundle ships (scripts/mwaa_bundle.py), as environment
    variables: this deployment stands in for MWAA, so its workers ride out an API server restart
    exactly as the shipped configuration lets them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mwaa_bundle", ROOT / "scripts" / "mwaa_bundle.py")
    assert spec is not None and spec.loader is not None
    bundle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bundle)
    return {"AIRFLOW__{}__{}".format(*(part.upper() for part in option.split(".", 1))): value
            for option, value in bundle.EXECUTION_API_RETRIES.items()}


def _connect_args_env(name: str) -> dict[str, str]:
    """The settings that make Airflow's sync and async engines read their SQLite connect
    arguments from this module's `name`."""
    return {f"AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS{suffix}": f"{__name__}.{name}"
            for suffix in ("", "_ASYNC")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _restore_sigint() -> None:
    # Started from a non-interactive shell, we would inherit SIGINT ignored; SIGINT is how the
    # components stop cleanly.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _all_pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def session_pids(sid: int) -> list[int]:
    """Every live process of session `sid` (procfs)."""
    pids = []
    for pid in _all_pids():
        try:
            if os.getsid(pid) == sid:
                pids.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name: [state, ppid, ...]; [] once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _ppid(pid: int) -> int:
    fields = _stat_fields(pid)
    try:
        return int(fields[1])
    except (IndexError, ValueError):
        return 0


def alive(pid: int) -> bool:
    """The process exists and is no zombie (a dead child its parent has not reaped yet)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] != "Z"


class AirflowError(RuntimeError):
    pass


class AirflowDeployment(StartStop):
    """`airflow db migrate` in a fresh AIRFLOW_HOME under `workdir`, then the four components.

    `env` is added to (and overrides) the environment every component gets: connections
    (`AIRFLOW_CONN_*`), Variables (`AIRFLOW_VAR_*`), MLflow and llmops settings.
    """

    def __init__(self, workdir: Path, *, dags_folder: Path, env: dict[str, str] | None = None,
                 port: int | None = None, parallelism: int = 4, heartbeat_timeout: int = 30,
                 database: str = "sqlite"):
        if database not in ("sqlite", "postgresql"):
            raise ValueError(f"database={database!r}: use 'sqlite' or 'postgresql'")
        self.database = database
        self.postgres: Any = None                 # the PostgresCluster, once migrate() started it
        self._migrated = False
        self.workdir = Path(workdir)
        self.home = self.workdir / "airflow"
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {c: 0 for c in COMPONENTS}
        self.crashes: list[dict[str, Any]] = []   # components that exited on their own
        self._lock = threading.RLock()            # restarts and revivals, one at a time
        self._down: set[str] = set()              # killed on purpose, restarted by the caller
        self._token: str | None = None
        # Our own writes (trigger, clear, mark failed, unpause) go one at a time: the matrix's
        # threads start their runs together, and concurrent run creation is where SQLite wedged.
        self._write_lock = threading.Lock()
        bin_dir = str(Path(sys.executable).parent)
        self.airflow = os.path.join(bin_dir, "airflow")
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")},
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")]),
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": str(parallelism),
            "AIRFLOW__CORE__AUTH_MANAGER":
                "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base}/execution/",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API__BASE_URL": self.base,
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
            "AIRFLOW__API_AUTH__JWT_EXPIRATION_TIME": "36000",
            **({"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.home / 'airflow.db'}",
                **_connect_args_env("SQLITE_CONNECT_ARGS")} if database == "sqlite" else {}),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            # Airflow's default: the DAG files do not change while it runs, and each re-parse of
            # the lifecycle file (a fresh process, ~1 s of CPU) at 5 s took 0.2-0.3 of a core.
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "30",
            # The lifecycle file imports much; on 2 busy cores its parse can pass the defaults
            # (30 s import, 50 s processor) and the DAG would vanish until the next parse.
            "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "120",
            "AIRFLOW__DAG_PROCESSOR__DAG_FILE_PROCESSOR_TIMEOUT": "150",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(heartbeat_timeout),
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_SEC": "5",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
            # A scheduler whose loop stalls past this threshold on busy cores marks its own job
            # failed at its next orphan check (every 30 s, below) and resets every task it
            # queued: in a CI run at load 4 a 34 s stall reset 39 running tries at once, and
            # three rows' waits ran out on the retries. The price: a restarted scheduler adopts
            # (resets) the old one's tasks once its last heartbeat is this old, 60 s later than
            # at 30 s.
            "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "90",
            # A restarted scheduler fails a dead worker's task (heartbeat timeout) only once it has
            # adopted the task from the scheduler job before it, which it checks every
            # orphaned_tasks_check_interval (300 s by default): with LocalExecutor a scheduler's
            # SIGTERM kills its workers (on MWAA's Celery workers it does not), and the in-worker
            # task's retry came 5 minutes later, near its row's timeout.
            "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "30",
            "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "2",
            "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "15",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            **mwaa_worker_env(),
            "RAY_AUTH_MODE": "disabled",
            "MPLBACKEND": "Agg",
            **(env or {}),
        }

    # -- lifecycle ---------------------------------------------------------------------------
    def migrate(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        if self.database == "postgresql" and self.postgres is None:
            self.postgres = PostgresCluster().start()
            # Airflow derives the API server's async URL from this one (postgresql+asyncpg).
            self.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = self.postgres.url("airflow")
        proc = subprocess.run([self.airflow, "db", "migrate"], env=self.env, capture_output=True,
                              text=True, timeout=300)
        if proc.returncode:
            raise AirflowError(f"airflow db migrate failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        self._migrated = True
        if self.database != "sqlite":
            return
        # SQLite in WAL mode: readers (API server, dag-processor) no longer block the scheduler's
        # and the workers' writes. The mode is stored in the file, so it holds for every process.
        import sqlite3

        with sqlite3.connect(self.home / "airflow.db") as db:
            db.execute("PRAGMA journal_mode=WAL")

    def start(self, timeout: float = 240) -> "AirflowDeployment":
        if not self._migrated and not (self.home / "airflow.db").exists():
            self.migrate()
        for component in COMPONENTS:
            self._spawn(component)
        self.wait_healthy(timeout)
        return self

    def _spawn(self, component: str) -> None:
        logs = self.workdir / "components"
        logs.mkdir(parents=True, exist_ok=True)
        args = [self.airflow, component]
        if component == "api-server":
            args += ["--port", str(self.port), "--host", "127.0.0.1"]
        with open(logs / f"{component}.log", "ab") as out:
            out.write(f"\n==== start {time.strftime('%H:%M:%S')} ====\n".encode())
            out.flush()
            env = self.env
            if component == "api-server" and self.database == "sqlite":
                env = {**env, **_connect_args_env("API_SQLITE_CONNECT_ARGS")}
            self.procs[component] = subprocess.Popen(
                args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir,
                preexec_fn=_restore_sigint, start_new_session=True)

    def component_log(self, component: str, tail: int = 4000) -> str:
        path = self.workdir / "components" / f"{component}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def exited(self) -> dict[str, int]:
        """Components whose main process has exited on its own: {name: exit code}."""
        return {name: proc.returncode for name, proc in self.procs.items() if proc.poll() is not None}

    def revive(self) -> list[str]:
        """Start again every component that exited on its own (not one we are restarting);
        what was revived, with the tail of its log, for the caller to report."""
        revived = []
        with self._lock:
            for name, code in self.exited().items():
                if name in self._down:
                    continue
                log_text = self.component_log(name, 3000)
                tail = [line for line in log_text.splitlines() if line.strip()][-3:]
                crash = {"component": name, "exit_code": code, "at": time.time(), "log_tail": tail}
                if "database is locked" in log_text:
                    crash["db_open_by"] = self.db_holders()
                self.crashes.append(crash)
                self.restarts[name] += 1
                self._spawn(name)
                revived.append(f"{name} exited with {code} and was started again: "
                               + " / ".join(t[-200:] for t in tail)
                               + (f" | DB open by: {crash['db_open_by']}" if "db_open_by" in crash else ""))
        return revived

    def db_holders(self) -> list[str]:
        """Every process with the metadata DB open, as 'pid state wchan: cmdline': who may hold
        the SQLite lock when a component exits on "database is locked"."""
        db = str(self.home / "airflow.db")
        out = []
        for pid in _all_pids():
            try:
                if any(os.readlink(fd) == db for fd in Path(f"/proc/{pid}/fd").iterdir()):
                    state = (_stat_fields(pid) or ["?"])[0]
                    wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
                    out.append(f"{pid} {state} {wchan}: {_cmdline(pid)[:150]}")
            except OSError:
                continue
        return out

    def pids(self, component: str) -> list[int]:
        proc = self.procs.get(component)
        return session_pids(proc.pid) if proc else []

    def kill(self, component: str, sig: int = signal.SIGKILL, whole_session: bool = True) -> None:
        """Signal a component: its whole session (a crash of its container, workers included),
        or only its main process (`whole_session=False`: a graceful stop it handles itself)."""
        proc = self.procs[component]
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            self._down.add(component)
        targets = self.pids(component) if whole_session else [proc.pid]
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL:
            proc.wait(10)

    def _end(self, component: str, grace: float) -> None:
        proc = self.procs.get(component)
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGINT)
                proc.wait(grace)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        for pid in session_pids(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def restart(self, component: str, sig: int | None = signal.SIGTERM, grace: float = 30,
                wait: bool = True, timeout: float = 120) -> None:
        """Stop a component (`sig` to its main process, then SIGKILL to what is left of its
        session after `grace` s; `sig=None`: it was already killed) and start a new one."""
        with self._lock:
            proc = self.procs[component]
            if sig is not None and proc.poll() is None:
                os.kill(proc.pid, sig)
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    pass
            self._down.add(component)
            self._end(component, grace=0)
            self.restarts[component] += 1
            self._spawn(component)
            self._down.discard(component)
        if component == "api-server":
            self._token = None
        if wait:
            self.wait_healthy(timeout, component)

    def stop(self, grace: float = 20) -> None:
        """SIGINT to every component (the scheduler first, so no new task starts), then SIGKILL
        to whatever is left in their sessions."""
        order = ["scheduler", "triggerer", "dag-processor", "api-server"]
        self._down.update(order)
        for component in order:
            proc = self.procs.get(component)
            if proc is not None and proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for component in order:
            proc = self.procs.get(component)
            if proc is not None:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for component in order:
            self._end(component, grace=0)
        if self.postgres is not None:
            self.postgres.stop()
            self.postgres = None

    # -- health ------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        return self.request("GET", "/api/v2/monitor/health", auth=False)

    def wait_healthy(self, timeout: float = 180, component: str | None = None) -> None:
        """Until the API answers and the scheduler, dag-processor and triggerer heartbeat
        (or only `component`), raising with the component's log tail when one exits."""
        wanted = [component] if component else list(COMPONENTS)
        deadline = time.monotonic() + timeout
        last: Any = None
        started = time.time()
        while time.monotonic() < deadline:
            for name in wanted:
                proc = self.procs[name]
                if proc.poll() is not None:
                    raise AirflowError(f"airflow {name} exited with {proc.returncode}:\n"
                                       + self.component_log(name))
            try:
                last = health = self.health()
                ok = True
                for name in wanted:
                    key = HEALTH_KEYS.get(name)
                    if key is None:
                        continue
                    part = health.get(key) or {}
                    beat = part.get(f"latest_{key}_heartbeat") or part.get("latest_heartbeat")
                    if part.get("status") != "healthy":
                        ok = False
                    elif component and beat and _epoch(beat) < started - 2:
                        ok = False  # still the heartbeat of the process we replaced
                if ok and (self._token or self._password_file().exists()):
                    if component in (None, "api-server"):
                        # The execution API's versioned app builds on its first request: warm it
                        # here, not in the first tasks' start calls (they time out and the try
                        # dies unrun if it takes long on busy cores).
                        self.request("GET", "/execution/health", auth=False, retries=3, timeout=120)
                    return
            except (urllib.error.URLError, OSError, ValueError, AirflowError) as exc:
                last = exc
            time.sleep(1)
        raise AirflowError(f"Airflow not healthy after {timeout:.0f}s ({wanted}): {last}\n"
                           + "\n".join(f"--- {n}\n{self.component_log(n, 1500)}" for n in wanted))

    # -- REST --------------------------------------------------------------------------------
    def _password_file(self) -> Path:
        return self.home / "simple_auth_manager_passwords.json.generated"

    def token(self) -> str:
        if self._token is None:
            creds = json.loads(self._password_file().read_text())
            user, password = next(iter(creds.items()))
            self._token = self.request("POST", "/auth/token",
                                       {"username": user, "password": password},
                                       auth=False)["access_token"]
        return self._token

    def request(self, method: str, path: str, body: Any = None, *, auth: bool = True,
                timeout: float = 60, raw: bool = False, retries: int = 30) -> Any:
        """One REST call; retried while the API server is down or restarting (connection
        refused, 5xx), re-authenticated on 401."""
        data = json.dumps(body).encode() if body is not None else None
        for attempt in range(retries):
            headers = {"Content-Type": "application/json", "Accept": "application/json"}
            if auth:
                headers["Authorization"] = f"Bearer {self.token()}"
            req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
            try:
                with self._write_lock if method != "GET" and auth else contextlib.nullcontext():
                    with urllib.request.urlopen(req, timeout=timeout) as resp:
                        payload = resp.read()
                return payload.decode(errors="replace") if raw else json.loads(payload or b"null")
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:2000]
                if exc.code == 401 and auth and attempt < retries - 1:
                    self._token = None
                    continue
                if exc.code >= 500 and attempt < retries - 1:
                    time.sleep(1)
                    continue
                raise AirflowError(f"{method} {path} -> HTTP {exc.code}: {detail}") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
                if attempt == retries - 1:
                    raise AirflowError(f"{method} {path}: {exc}") from None
                time.sleep(1)
        raise AirflowError(f"{method} {path}: no answer")

    def wait_dag(self, dag_id: str, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                dag = self.request("GET", f"/api/v2/dags/{dag_id}", retries=1)
                if dag.get("is_paused"):
                    dag = self.request("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})
                return dag
            except AirflowError as exc:
                if time.monotonic() > deadline:
                    errors = self.request("GET", "/api/v2/importErrors")
                    raise AirflowError(f"DAG {dag_id} not parsed: {exc}; import errors: {errors}") from None
                time.sleep(2)

    def trigger(self, dag_id: str, conf: dict | None = None, run_id: str | None = None) -> str:
        """A new DAG run, named so that a request retried after a timeout (the first one may
        have gone through) cannot create a second run: Airflow answers 409 to the retry."""
        run_id = run_id or f"manual__{time.strftime('%Y-%m-%dT%H:%M:%S')}-{secrets.token_hex(4)}"
        body: dict[str, Any] = {"logical_date": None, "conf": conf or {}, "dag_run_id": run_id}
        path = f"/api/v2/dags/{dag_id}/dagRuns"
        for attempt in range(30):
            try:
                return self.request("POST", path, body, retries=1, timeout=60)["dag_run_id"]
            except AirflowError as exc:
                if "HTTP 409" in str(exc) and attempt:
                    return run_id          # our earlier attempt created it
                if "HTTP 4" in str(exc) or attempt == 29:
                    raise
                time.sleep(1)
        return run_id

    def run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        return self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{_q(run_id)}")

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        return self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{_q(run_id)}/taskInstances"
                                   "?limit=100")["task_instances"]

    def task_instance(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> dict[str, Any]:
        path = f"/api/v2/dags/{dag_id}/dagRuns/{_q(run_id)}/taskInstances/{task_id}"
        if map_index >= 0:
            path += f"/{map_index}"
        return self.request("GET", path)

    def tries(self, dag_id: str, run_id: str, task_id: str) -> list[dict[str, Any]]:
        """Every try of a task so far (the task instance history and its current try)."""
        path = f"/api/v2/dags/{dag_id}/dagRuns/{_q(run_id)}/taskInstances/{task_id}/tries"
        return self.request("GET", path)["task_instances"]

    def wait_run(self, dag_id: str, run_id: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            state = self.run(dag_id, run_id)["state"]
            if state in TERMINAL_RUN or time.monotonic() > deadline:
                return state
            # every 5 s: the matrix waits on 40 runs at once, and at 2 s its polls alone kept
            # the one API server process busy on 2 loaded cores (each took 0.3 s there)
            time.sleep(min(5.0, max(0.5, deadline - time.monotonic())))

    def wait_task(self, dag_id: str, run_id: str, task_id: str, states: Iterable[str],
                  timeout: float, map_index: int = -1) -> dict[str, Any]:
        """Until the task instance is in one of `states`; its last seen description either way."""
        wanted = set(states)
        deadline = time.monotonic() + timeout
        while True:
            ti = self.task_instance(dag_id, run_id, task_id, map_index)
            if ti["state"] in wanted or time.monotonic() > deadline:
                return ti
            time.sleep(1)

    def clear_task(self, dag_id: str, run_id: str, task_ids: list[str], *,
                   only_failed: bool = False, reset_dag_runs: bool = True) -> Any:
        """Clear task instances (what the UI's Clear does), rerunning them."""
        return self.request("POST", f"/api/v2/dags/{dag_id}/clearTaskInstances", {
            "dry_run": False, "dag_run_id": run_id, "task_ids": task_ids,
            "only_failed": only_failed, "reset_dag_runs": reset_dag_runs,
            "include_upstream": False, "include_downstream": False})

    def mark_failed(self, dag_id: str, run_id: str, task_id: str) -> Any:
        """What the UI's 'Mark as failed' does: the running task is stopped by its supervisor."""
        return self.request("PATCH", f"/api/v2/dags/{dag_id}/dagRuns/{_q(run_id)}/taskInstances/{task_id}",
                            {"new_state": "failed"})

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        try:
            entry = self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{_q(run_id)}/taskInstances/"
                                        f"{task_id}/xcomEntries/{key}?deserialize=true", retries=3)
        except AirflowError as exc:
            if "HTTP 404" in str(exc):
                return None
            raise
        value = entry.get("value")
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError:
                return value
        return value

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
        """The log of one try as the UI shows it (the worker's and the triggerer's parts)."""
        path = (f"/api/v2/dags/{dag_id}/dagRuns/{_q(run_id)}/taskInstances/{task_id}/logs/"
                f"{try_number}?full_content=true")
        payload = self.request("GET", path)
        content = payload.get("content", "")
        if isinstance(content, list):
            return "\n".join(e.get("event", "") if isinstance(e, dict) else str(e) for e in content)
        return str(content)

    # -- logs on disk ------------------------------------------------------------------------
    def log_dir(self, dag_id: str, run_id: str, task_id: str) -> Path:
        return self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"

    def task_log_events(self, dag_id: str, run_id: str, task_id: str) -> list[dict[str, Any]]:
        """Every log record of every try of a task, from the files: {"try", "source" ("worker"
        or "trigger.<triggerer job id>"), "event"}; in file order within each file."""
        out: list[dict[str, Any]] = []
        base = self.log_dir(dag_id, run_id, task_id)
        for path in sorted(base.glob("attempt=*.log*")):
            name = path.name
            try_number = int(name.split("=", 1)[1].split(".", 1)[0])
            source = "worker"
            if ".trigger." in name:
                source = "trigger." + name.split(".trigger.", 1)[1].removesuffix(".log")
            for line in path.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                    event = str(record.get("event", ""))
                    for error in record.get("error_detail") or []:
                        event += f" | {error.get('exc_type')}: {error.get('exc_value')}"
                except ValueError:
                    event = line
                out.append({"try": try_number, "source": source, "event": event})
        return out

    # -- processes ---------------------------------------------------------------------------
    def worker_pids(self, ti_id: str) -> tuple[int, int] | None:
        """(task runner pid, its supervisor's pid) of the running try of task instance `ti_id`.

        The task runner sets its title to `airflow worker -- <ti id>` (setproctitle in
        airflow.sdk.execution_time.task_runner); its parent is the supervisor that the
        LocalExecutor's worker process forked."""
        wanted = f"airflow worker -- {ti_id}"
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and _cmdline(int(entry.name)).startswith(wanted):
                pid = int(entry.name)
                if alive(pid):
                    return pid, _ppid(pid)
        return None


def _q(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def _epoch(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
