"""Runs one local job and records how it ended: `python -m llmops.jobs.backends.local.local_runner
JOB_DIR`.

The backend starts this as the leader of a new process session, so the job outlives the Airflow
worker that submitted it (a deferred task leaves the worker) and stopping the job is one signal to
the whole process group. The exit code is written atomically when the command ends; a job whose
runner died without one is reported failed.

The job's environment is the runner's own (inherited from the worker, never written to disk) with
the job's recorded env laid over it. The runner's umask makes what the job writes private to the
user: its logs, outputs and checkpoints. When that environment holds secrets (llmops.jobs.
env_secrets), the job's output reaches its log through the runner, with each of them as ***.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from llmops.jobs import env_secrets

PRIVATE_UMASK = 0o077  # files 0600, directories 0700
MIN_MASKED_LENGTH = 5  # Airflow's own [logging] min_length_masked_secret: shorter would mask words
PUMP_DRAIN_SECONDS = 5.0


def main(job_dir: str) -> int:
    os.umask(PRIVATE_UMASK)
    job = Path(job_dir)
    command = json.loads((job / "command.json").read_text())
    # A background start from a non-interactive shell inherits SIGINT ignored; the job should not.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    env = {**os.environ, **command["env"]}
    secrets = sorted((v.encode() for v in env_secrets.secret_values(env) if len(v) >= MIN_MASKED_LENGTH),
                     key=len, reverse=True)
    proc = subprocess.Popen(command["argv"], cwd=command["cwd"], env=env,
                            stdout=subprocess.PIPE if secrets else None,
                            stderr=subprocess.STDOUT if secrets else None)
    pump = None
    if secrets:
        pump = threading.Thread(target=_copy_masked, args=(proc.stdout, sys.stdout.buffer, secrets),
                                daemon=True)
        pump.start()

    def forward(signum, _frame):  # let the job checkpoint or clean up before it ends
        proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    code = proc.wait()
    if pump is not None:
        # A grandchild left running (a Ray daemon) may hold the pipe open: the job's end is
        # its own exit, so the copy gets a moment to drain and no more.
        pump.join(timeout=PUMP_DRAIN_SECONDS)
    tmp = job / ".exit_code.tmp"
    tmp.write_text(str(code))
    os.replace(tmp, job / "exit_code")
    return code


def _copy_masked(source, sink, secrets: list[bytes]) -> None:
    """The job's output into its log, line by line, each secret of its environment as ***: what
    the job prints of its credentials never reaches the disk (nor, from there, the task log)."""
    for line in iter(source.readline, b""):
        for secret in secrets:
            line = line.replace(secret, b"***")
        sink.write(line)
        sink.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
