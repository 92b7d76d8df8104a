"""`make demo`: run the lifecycle DAG once through Airflow on the demo recipe, then say where to look.

Runs `airflow dags test` (SQLite + in-process executor, no scheduler to start), which executes
every task for real: each stage's job is a local process, logged to the MLflow store in
$MLFLOW_TRACKING_URI. Extra Params: DEMO_CONF='{"pretrain_steps": 300}' make demo
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "plugins"))
from llmops.summary import summarize  # noqa: E402

DAG_ID = "llm_lifecycle"


def main() -> int:
    conf = {"recipe": "demo", **json.loads(os.environ.get("DEMO_CONF") or "{}")}
    started = time.time()
    print(f"Running {DAG_ID} with {json.dumps(conf)}; every task's log follows.", flush=True)
    code = subprocess.call(["airflow", "dags", "test", DAG_ID, "--conf", json.dumps(conf)])
    minutes = (time.time() - started) / 60
    print("\n" + "=" * 100)
    print(summarize(DAG_ID))
    print(f"\nThe DAG run took {minutes:.1f} min; `airflow dags test` exited {code}.")
    return code


if __name__ == "__main__":
    sys.exit(main())
