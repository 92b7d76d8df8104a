"""Runs one local job and records how it ended: `python -m llmops.jobs.local_runner JOB_DIR`.

The backend starts this as the leader of a new process session, so the job outlives the Airflow
worker that submitted it (a deferred task leaves the worker) and stopping the job is one signal to
the whole process group. The exit code is written atomically when the command ends; a job whose
runner died without one is reported failed.

The job's environment is the runner's own (inherited from the worker, never written to disk) with
the job's recorded env laid over it. The runner's umask makes what the job writes private to the
user: its logs, outputs and checkpoints.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

PRIVATE_UMASK = 0o077  # files 0600, directories 0700


def main(job_dir: str) -> int:
    os.umask(PRIVATE_UMASK)
    job = Path(job_dir)
    command = json.loads((job / "command.json").read_text())
    # A background start from a non-interactive shell inherits SIGINT ignored; the job should not.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen(command["argv"], cwd=command["cwd"], env={**os.environ, **command["env"]})

    def forward(signum, _frame):  # let the job checkpoint or clean up before it ends
        proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    code = proc.wait()
    tmp = job / ".exit_code.tmp"
    tmp.write_text(str(code))
    os.replace(tmp, job / "exit_code")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
