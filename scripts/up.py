"""`make up`: the Airflow UI (http://localhost:8080) and the MLflow UI (http://localhost:5000).

Trigger `llm_lifecycle` from the Airflow UI ("Trigger" -> the Params form). Ctrl-C stops both.
`airflow standalone` is stopped with SIGINT (SIGTERM would orphan its components).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

AIRFLOW_PORT, MLFLOW_PORT = 8080, 5000


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
    mlflow = subprocess.Popen(
        ["mlflow", "server", "--backend-store-uri", os.environ["MLFLOW_TRACKING_URI"],
         "--default-artifact-root", (home / "mlartifacts").as_uri(),
         "--host", "127.0.0.1", "--port", str(MLFLOW_PORT), "--workers", "1"],
        env=env, preexec_fn=_default_sigint, start_new_session=True)
    airflow = subprocess.Popen(["airflow", "standalone"], env=env, preexec_fn=_default_sigint,
                               start_new_session=True)
    password_file = airflow_home / "simple_auth_manager_passwords.json.generated"
    deadline = time.time() + 120
    while not password_file.exists() and time.time() < deadline and airflow.poll() is None:
        time.sleep(1)
    if password_file.exists():
        creds = json.loads(password_file.read_text())
        print(f"\nAirflow UI: http://localhost:{AIRFLOW_PORT}  user/password: "
              + ", ".join(f"{u} / {p}" for u, p in creds.items()), flush=True)
    print(f"MLflow UI:  http://localhost:{MLFLOW_PORT}\n"
          "Trigger 'llm_lifecycle' from the Airflow UI to fill in its Params. Ctrl-C stops both.\n",
          flush=True)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
