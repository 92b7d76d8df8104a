"""`make up`: the Airflow UI and the MLflow UI, on ports from the environment.

    AIRFLOW_PORT=8080 MLFLOW_PORT=5000 make up      # the defaults
    BIND_HOST=0.0.0.0 make up                       # serve other machines too

Both servers listen on 127.0.0.1 (this machine only) unless BIND_HOST says otherwise (or an
AIRFLOW__API__HOST the user set, which must then agree with it). Airflow 3.3 binds the log
servers of its scheduler and triggerer to every interface whatever is set (they answer only
requests signed with this deployment's secret key); their ports are
AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT and ..._TRIGGER_LOG_SERVER_PORT.

Trigger `llm_lifecycle` from the Airflow UI ("Trigger" -> the Params form), or from the command
line with `scripts/airflow dags trigger llm_lifecycle -c '{...}'`. Ctrl-C stops both.
`airflow standalone` is stopped with SIGINT (SIGTERM would orphan its components). Its own output
goes to `$LLMOPS_HOME/up.log`, so the block that ends start-up (URLs, user, password, paused DAGs,
how to stop) is not lost in hundreds of lines of component logs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

DEFAULT_AIRFLOW_PORT = 8080
DEFAULT_MLFLOW_PORT = 5000
DEFAULT_HOST = "127.0.0.1"
DAG_ID = "llm_lifecycle"
# The MLflow UI's experiments in its training view (MLflow 3.17 opens its GenAI view unless the
# link says otherwise: llmops.infra.tracking.UI_VIEW_QUERY).
MLFLOW_UI_PATH = "/#/experiments?workflowType=machine_learning"


def airflow_port(environ: Mapping[str, str]) -> int:
    """The API server's port: AIRFLOW_PORT, else an AIRFLOW__API__PORT the user set, else 8080.
    Both set and different is refused: one of them would be silently ignored."""
    ours, theirs = environ.get("AIRFLOW_PORT"), environ.get("AIRFLOW__API__PORT")
    if ours and theirs and int(ours) != int(theirs):
        raise SystemExit(f"AIRFLOW_PORT={ours} and AIRFLOW__API__PORT={theirs} disagree: set one.")
    return int(ours or theirs or DEFAULT_AIRFLOW_PORT)


def bind_host(environ: Mapping[str, str]) -> str:
    """Where both servers listen: BIND_HOST, else an AIRFLOW__API__HOST the user set, else
    127.0.0.1. Both set and different is refused: one server would listen elsewhere."""
    ours, theirs = environ.get("BIND_HOST"), environ.get("AIRFLOW__API__HOST")
    if ours and theirs and ours != theirs:
        raise SystemExit(f"BIND_HOST={ours} and AIRFLOW__API__HOST={theirs} disagree: set one.")
    return ours or theirs or DEFAULT_HOST


def airflow_server_env(environ: Mapping[str, str], port: int) -> dict[str, str]:
    """What `airflow standalone` needs to serve on `port`, over `environ`.

    The API server's port is not the only place the port lives: task processes reach the execution
    API at `[core] execution_api_server_url`, which Airflow derives from `[api] base_url` and, when
    that is unset, from a hard-coded http://localhost:8080. Moving only the port left every task
    dying before it ran (connection refused, the TI still queued). So the base URL is set to this
    port as well, and the execution API address follows it; links in task logs and notifications
    use it too. A base URL or execution API address the user set is kept (a proxy, another host).
    """
    env = {**environ, "AIRFLOW__API__PORT": str(port), "AIRFLOW__API__HOST": bind_host(environ)}
    env.setdefault("AIRFLOW__API__BASE_URL", f"http://localhost:{port}")
    return env


def _default_sigint() -> None:
    # A process started from a non-interactive shell inherits SIGINT ignored: restore it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# Both servers run in sessions of their own (start_new_session): a terminal's Ctrl-C reaches
# only this script, which then sends one SIGINT to each server. If the terminal's SIGINT also hit
# every Airflow component directly, standalone's own orderly shutdown would hang.


def main() -> int:
    # Started in the background by a script, we would inherit SIGINT ignored: take Ctrl-C back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    home = Path(os.environ["LLMOPS_HOME"])
    airflow_home = Path(os.environ["AIRFLOW_HOME"])
    port = airflow_port(os.environ)
    host = bind_host(os.environ)
    mlflow_port = int(os.environ.get("MLFLOW_PORT") or DEFAULT_MLFLOW_PORT)
    # where this script reaches the API server: the host it listens on, or loopback for "any"
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}"
    # The pool sweep trials and ladder rungs run in (their accelerator quota), before any run.
    subprocess.run([sys.executable, "-m", "llmops.airflow.sweep_pool"], check=True)
    env = {**airflow_server_env(os.environ, port), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log_path = home / "up.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    mlflow = subprocess.Popen(
        ["mlflow", "server", "--backend-store-uri", os.environ["MLFLOW_TRACKING_URI"],
         "--default-artifact-root", (home / "mlartifacts").as_uri(),
         "--host", host, "--port", str(mlflow_port), "--workers", "1"],
        env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_default_sigint,
        start_new_session=True)
    airflow = subprocess.Popen(["airflow", "standalone"], env=env, stdout=log,
                               stderr=subprocess.STDOUT, preexec_fn=_default_sigint,
                               start_new_session=True)
    # Ctrl-C at any moment, start-up included, stops both servers: they run in sessions of their
    # own, so nothing else would, and an early Ctrl-C used to leave them running.
    try:
        print(f"Starting Airflow and MLflow (their output: {log_path}) ...", flush=True)
        password_file = airflow_home / "simple_auth_manager_passwords.json.generated"
        deadline = time.time() + 180
        while time.time() < deadline and airflow.poll() is None and not _ready(base, password_file):
            time.sleep(1)
        creds = json.loads(password_file.read_text()) if password_file.exists() else {}
        users = ", ".join(f"{u} / {p}" for u, p in creds.items()) or f"see {password_file}"
        # Ready for a trigger means the DAG is parsed: until then a CLI trigger says "not found".
        dags = _wait_for_dags(base, creds, airflow, time.time() + 180)
        print("\n" + "\n".join([
            "-" * 72,
            f"Airflow UI   http://localhost:{port}   user / password: {users}",
            f"MLflow UI    http://localhost:{mlflow_port}{MLFLOW_UI_PATH}",
            f"Listening    {host}" + (" (this machine only; BIND_HOST=0.0.0.0 make up serves others)"
                                      if host == DEFAULT_HOST else ""),
            f"Trigger      '{DAG_ID}' -> Trigger -> fill in the Params form, or from a shell:",
            f"             scripts/airflow dags trigger {DAG_ID} -c '{{\"recipe\": \"demo\"}}'",
            *_dag_lines(dags),
            f"Logs         {log_path}",
            "Stop         Ctrl-C (stops both)",
            "-" * 72]) + "\n", flush=True)
        while airflow.poll() is None and mlflow.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        print("Stopping Airflow and MLflow ...", flush=True)
        for proc in (airflow, mlflow):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        # One deadline for both (they stop side by side), then whatever is left of their
        # sessions: the caller (a terminal, a test) may not wait much longer than that.
        deadline = time.time() + 30
        for proc in (airflow, mlflow):
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        _stop_sessions([airflow.pid, mlflow.pid])
        for proc in (airflow, mlflow):
            proc.wait()
    log.close()
    return 0


def _stop_sessions(sids: list[int], grace_s: float = 10.0) -> None:
    """Stop every process left in the servers' sessions (SIGTERM, SIGKILL after `grace_s`).

    `airflow standalone` stops its components with SIGTERM and waits for their output to end,
    but its scheduler waits for the LocalExecutor's running tasks, and each task's supervisor
    runs in a process group of its own: stopped while a task ran, standalone would wait for that
    task, and killed, it left the scheduler and the supervisor running after `make up` returned.
    Everything the servers started stays in their sessions (start_new_session above), so this
    finds it all. A local job's runner starts a session of its own, so running jobs are left
    alone and a later `make up` reattaches to them."""
    import psutil  # Airflow's dependency; imported here to keep the script's start light

    left = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) in sids:
                left.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    for proc in left:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def _dag_lines(dags: list[dict] | None) -> list[str]:
    """What the block says about the DAGs: none parsed yet, or which are paused and why it matters.
    Runs of a paused DAG triggered from the CLI or REST wait in 'queued' with no word anywhere
    (only the UI form's "Unpause on trigger" box unpauses): say it here, once, with the fix."""
    if dags is None:
        return [f"DAGs         not parsed yet ({DAG_ID} not listed): see the log below"]
    paused = sorted(d["dag_id"] for d in dags if d["is_paused"])
    if not paused:
        return [f"DAGs         {len(dags)}, none paused"]
    return [f"Paused       {', '.join(paused)}: runs triggered from the CLI or REST wait in",
            "             'queued' until unpaused (scheduled DAGs start paused, so they run only",
            "             when you choose): scripts/airflow dags unpause <dag_id>"]


def _request(base: str, method: str, path: str, body: dict | None = None,
             token: str | None = None):
    req = urllib.request.Request(
        base + path, method=method, data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read() or b"null")


def _wait_for_dags(base: str, creds: dict[str, str], airflow: subprocess.Popen,
                   deadline: float) -> list[dict] | None:
    """Every DAG once `llm_lifecycle` is listed (the DAG processor has parsed the folder), or None
    when it is not by the deadline (an import error, or a slow machine)."""
    if not creds:
        return None
    user, password = next(iter(creds.items()))
    while time.time() < deadline and airflow.poll() is None:
        try:
            token = _request(base, "POST", "/auth/token",
                             {"username": user, "password": password})["access_token"]
            dags = _request(base, "GET", "/api/v2/dags?limit=100", token=token)["dags"]
            if any(d["dag_id"] == DAG_ID for d in dags):
                return dags
        except (OSError, KeyError, ValueError):  # urllib's errors are OSErrors
            pass
        time.sleep(2)
    return None


def _ready(base: str, password_file: Path) -> bool:
    """The admin password is written and the API server answers."""
    if not password_file.exists():
        return False
    try:
        urllib.request.urlopen(f"{base}/api/v2/monitor/health", timeout=2)
        return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
