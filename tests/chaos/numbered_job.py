"""The fault matrix's job: `python -m tests.chaos.numbered_job`, like tests.sample_job but every
line it prints is numbered and carries a token drawn when the process starts:

    chaos-line 7 run=3f9a1c2e

so a line seen twice in a task's log (across its tries and the triggerer's parts) is a line of
the same job run shown twice, never two jobs that happen to print the same text. Its first line,
`chaos-label <label>`, says which task instance submitted it (the DAG passes
`<dag_id>/<run_id>/<task_id>`): the matrix reads it from the job's CloudWatch stream to attribute
jobs to task instances whatever naming scheme the operator uses."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from tasks.common.entry import run_stage


@dataclass(kw_only=True)
class NumberedConfig:
    seconds: float = 30.0      # how long to run, one line per second
    exit_code: int = 0         # non-zero: fail with it at the end
    label: str = ""            # who submitted it: <dag_id>/<run_id>/<task_id>


def main(cfg: NumberedConfig) -> dict:
    token = os.urandom(4).hex()
    count = max(1, int(cfg.seconds))
    print(f"chaos-label {cfg.label} run={token}", flush=True)
    for n in range(count):
        print(f"chaos-line {n} run={token}", flush=True)
        time.sleep(cfg.seconds / count)
    if cfg.exit_code:
        print(f"chaos job failing on purpose with exit code {cfg.exit_code} run={token}", flush=True)
        sys.exit(cfg.exit_code)
    return {"metrics": {"answer": 42.0, "lines": float(count)}, "outputs": {"token": token}}


if __name__ == "__main__":
    run_stage("chaos", NumberedConfig, main)
