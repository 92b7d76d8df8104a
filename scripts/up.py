"""`make up`: the Airflow UI and the MLflow UI, on ports from the environment.

    AIRFLOW_PORT=8080 MLFLOW_PORT=5000 make up      # the defaults

Trigger `llm_lifecycle` from the Airflow UI ("Trigger" -> the Params form). Ctrl-C stops both.
`airflow standalone` is stopped with SIGINT (SIGTERM would orphan its components). Its own output
goes to `$LLMOPS_HOME/up.log`, so the block that ends start-up (URLs, user, password, how to stop)
is not lost in hundreds of lines of component logs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

AIRFLOW_PORT = int(os.environ.get("AIRFLOW_PORT") or 8080)
MLFLOW_PORT = int(os.environ.get("MLFLOW_PORT") or 5000)


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
    # The pool sweep trials and ladder rungs run in (their accelerator quota), before any run.
    subprocess.run([sys.executable, "-m", "llmops.sweep.pool"], check=True)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
           "AIRFLOW__API__PORT": str(AIRFLOW_PORT)}
    log_path = home / "up.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    mlflow = subprocess.Popen(
        ["mlflow", "server", "--backend-store-uri", os.environ["MLFLOW_TRACKING_URI"],
         "--default-artifact-root", (home / "mlartifacts").as_uri(),
         "--host", "127.0.0.1", "--port", str(MLFLOW_PORT), "--workers", "1"],
        env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_default_sigint,
        start_new_session=True)
    airflow = subprocess.Popen(["airflow", "standalone"], env=env, stdout=log,
                               stderr=subprocess.STDOUT, preexec_fn=_default_sigint,
                               start_new_session=True)
    print(f"Starting Airflow and MLflow (their output: {log_path}) ...", flush=True)
    password_file = airflow_home / "simple_auth_manager_passwords.json.generated"
    deadline = time.time() + 180
    while time.time() < deadline and airflow.poll() is None and not _ready(password_file):
        time.sleep(1)
    creds = json.loads(password_file.read_text()) if password_file.exists() else {}
    users = ", ".join(f"{u} / {p}" for u, p in creds.items()) or f"see {password_file}"
    print("\n" + "\n".join([
        "-" * 72,
        f"Airflow UI   http://localhost:{AIRFLOW_PORT}   user / password: {users}",
        f"MLflow UI    http://localhost:{MLFLOW_PORT}",
        "Trigger      'llm_lifecycle' -> Trigger -> fill in the Params form",
        f"Logs         {log_path}",
        "Stop         Ctrl-C (stops both)",
        "-" * 72]) + "\n", flush=True)
    try:
        while airflow.poll() is None and mlflow.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    for proc in (airflow, mlflow):
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    for proc in (airflow, mlflow):
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    log.close()
    return 0


def _ready(password_file: Path) -> bool:
    """The admin password is written and the API server answers."""
    import urllib.request

    if not password_file.exists():
        return False
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{AIRFLOW_PORT}/api/v2/monitor/health", timeout=2)
        return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
