"""`make demo`: run the lifecycle DAG once under a real Airflow scheduler, then say where to look.

Starts `airflow standalone` (SQLite, LocalExecutor, low parallelism), triggers `llm_lifecycle`
through the REST API exactly as the UI would, prints each task's progress, stops Airflow with
SIGINT and prints the figures of every stage from MLflow. Extra Params as JSON:

    DEMO_CONF='{"pretrain_steps": 400}' make demo

`DEMO_MODE=dags-test` runs the same DAG with `airflow dags test` instead (no scheduler: tasks run
one at a time in one process).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))
from llmops.stages import run_summary  # noqa: E402
from llmops.infra import tracking  # noqa: E402
from up import airflow_server_env  # noqa: E402  (scripts/up.py: the port's other places too)

DAG_ID = "llm_lifecycle"
PORT = int(os.environ.get("DEMO_AIRFLOW_PORT", "8080"))
BASE = f"http://127.0.0.1:{PORT}"
HOME = Path(os.environ["LLMOPS_HOME"])
AIRFLOW_HOME = Path(os.environ["AIRFLOW_HOME"])


def _request(method: str, path: str, body: dict | None = None, token: str | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(BASE + path, data=data, method=method,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"null")


def _wait_for(what: str, probe, timeout: float, airflow: subprocess.Popen):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if airflow.poll() is not None:
            raise RuntimeError(f"airflow standalone exited while waiting for {what}; "
                               f"see {HOME / 'standalone.log'}")
        try:
            result = probe()
            if result:
                return result
        except (urllib.error.URLError, OSError, KeyError, ValueError):
            pass
        time.sleep(1)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; see {HOME / 'standalone.log'}")


def _token() -> str:
    creds = json.loads((AIRFLOW_HOME / "simple_auth_manager_passwords.json.generated").read_text())
    user, password = next(iter(creds.items()))
    return _request("POST", "/auth/token", {"username": user, "password": password})["access_token"]


def _latest_job_line(seen: dict[str, str]) -> str | None:
    """The newest progress line of the most recently active job, if it changed."""
    logs = sorted((HOME / "jobs").glob("*/output.log"), key=lambda p: p.stat().st_mtime)
    if not logs:
        return None
    lines = logs[-1].read_text(errors="replace").strip().splitlines()
    line = lines[-1] if lines else ""
    job = logs[-1].parent.name
    if line and seen.get(job) != line:
        seen[job] = line
        return f"    {job}: {line}"
    return None


def run_standalone(conf: dict) -> int:
    log_path = HOME / "standalone.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**airflow_server_env(os.environ, PORT), "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5"}
    with open(log_path, "ab") as log:
        airflow = subprocess.Popen(
            ["airflow", "standalone"], stdout=log, stderr=subprocess.STDOUT, env=env,
            # A background start from a non-interactive shell inherits SIGINT ignored: restore it,
            # since SIGINT is how standalone stops cleanly (SIGTERM orphans its components).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            # Its own session: a Ctrl-C here stops the demo, which then stops Airflow in order.
            start_new_session=True)
    try:
        print(f"Starting Airflow (log: {log_path}) ...", flush=True)
        _wait_for("the API server", lambda: _request("GET", "/api/v2/monitor/health"), 180, airflow)
        token = _wait_for("the admin password", _token, 60, airflow)
        _wait_for(f"DAG {DAG_ID} to be parsed",
                  lambda: _request("GET", f"/api/v2/dags/{DAG_ID}", token=token), 180, airflow)
        _request("PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False}, token=token)
        run = _request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns",
                       {"logical_date": None, "conf": conf}, token=token)
        run_id = run["dag_run_id"]
        print(f"Triggered {DAG_ID} run {run_id} with {json.dumps(conf)}", flush=True)
        states: dict[str, str] = {}
        seen: dict[str, str] = {}
        started = time.time()
        while True:
            time.sleep(3)
            try:
                tis = _request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances"
                                      "?limit=100", token=token)["task_instances"]
                state = _request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}", token=token)["state"]
            except urllib.error.HTTPError as exc:
                if exc.code == 401:  # the token expired on a long run
                    token = _token()
                    continue
                raise
            for ti in sorted(tis, key=lambda t: (t.get("start_date") or "", t["task_id"])):
                key = ti["task_id"] + (f"[{ti['map_index']}]" if ti["map_index"] >= 0 else "")
                if ti["state"] and states.get(key) != ti["state"]:
                    states[key] = ti["state"]
                    print(f"[{time.time() - started:6.0f}s] {key:<16} {ti['state']}", flush=True)
            if line := _latest_job_line(seen):
                print(line, flush=True)
            if state in ("success", "failed"):
                print(f"DAG run {run_id}: {state}", flush=True)
                return 0 if state == "success" else 1
    finally:
        if airflow.poll() is None:
            airflow.send_signal(signal.SIGINT)
            try:
                airflow.wait(timeout=60)
            except subprocess.TimeoutExpired:
                airflow.kill()


def run_dags_test(conf: dict) -> int:
    return subprocess.call(["airflow", "dags", "test", DAG_ID, "--conf", json.dumps(conf)])


def main() -> int:
    # Started in the background by a script, we would inherit SIGINT ignored: take Ctrl-C back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    conf = {"recipe": "demo", **json.loads(os.environ.get("DEMO_CONF") or "{}")}
    # The pool the sweep's trials run in (their accelerator quota) must exist before the run.
    subprocess.run([sys.executable, "-m", "llmops.airflow.sweep_pool"], check=True)
    started = time.time()
    mode = os.environ.get("DEMO_MODE", "standalone")
    code = run_dags_test(conf) if mode == "dags-test" else run_standalone(conf)
    print("\n" + "=" * 100)
    print(run_summary.latest_text(DAG_ID))
    print(f"Open the MLflow UI: .venv/bin/mlflow ui --backend-store-uri {tracking.tracking_uri()} "
          "--port 5000   (or `make up`)")
    print(f"\nThe DAG run took {(time.time() - started) / 60:.1f} min. Task logs: "
          f"{AIRFLOW_HOME / 'logs'}; `make up` shows the run in the Airflow UI.")
    return code


if __name__ == "__main__":
    sys.exit(main())
