"""Runs a job as local processes: `python -m <entrypoint>`, or torchrun for several processes.

One directory per job name under `$LLMOPS_HOME/jobs/`: the spec, the stage config, the output
log, the runner's pid and, once done, its exit code and the job's result.json. Submitting a name
that is running or already succeeded reattaches to it; a failed or stopped one is started again
(the stage resumes from its checkpoints), with the earlier attempt's log kept.

Nothing of the worker's own environment is written down: `command.json` holds only the job's env
(JobSpec.env and what this backend sets), and the runner adds it to the environment it inherited
when it starts the job. Job directories are 0700 and their files 0600: a spec, config or log can
still hold something only its user should read.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from llmops.core import settings
from llmops.jobs.backends.base import Backend, JobState, JobStatus
from llmops.jobs.spec import JobSpec, JobSpecError

STOP_GRACE_SECONDS = 10


PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with _open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) as fh:
        fh.write(text.encode())
    os.replace(tmp, path)


def _open_private(path: Path, flags: int):
    """Open a file created 0600 (an existing one is narrowed to 0600 too)."""
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    os.fchmod(fd, PRIVATE_FILE_MODE)
    return os.fdopen(fd, "ab" if flags & os.O_APPEND else "wb")


def _private_dir(path: Path) -> None:
    """Create `path` (and the jobs directory above it) 0700; an older, wider one is narrowed."""
    for directory in (path.parent, path):
        directory.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        os.chmod(directory, PRIVATE_DIR_MODE)


class LocalBackend(Backend):
    name = "local"
    poll_interval = 2.0  # a local process is cheap to watch: its log and exit code are files

    def __init__(self, jobs_dir: str | os.PathLike | None = None):
        self.jobs_dir = Path(jobs_dir or settings.home() / "jobs")

    # -- submit ------------------------------------------------------------------------------
    def command(self, spec: JobSpec, job_dir: Path) -> list[str]:
        entry = ["-m", spec.entrypoint, "--config", str(job_dir / "config.json"),
                 "--result", str(job_dir / "result.json"), *spec.argv]
        if spec.nproc_per_node > 1:
            # torchrun restarts nothing by itself here: in-job supervision belongs to the stage.
            return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={spec.nproc_per_node}", *entry]
        return [sys.executable, *entry]

    def submit(self, spec: JobSpec) -> dict[str, Any]:
        if not spec.name:
            raise JobSpecError("JobSpec.name is required to submit: it makes retries reattach.")
        if spec.instance_count != 1:
            raise JobSpecError(f"The local backend runs on one machine; JobSpec.instance_count is "
                               f"{spec.instance_count}. Use a cluster backend for several nodes.")
        job_dir = self.jobs_dir / spec.name
        handle = {"backend": self.name, "name": spec.name, "job_dir": str(job_dir)}
        current = self.status(handle) if (job_dir / "runner.json").exists() else None
        if current and current.state in (JobState.RUNNING, JobState.SUCCEEDED):
            handle["reattached"] = True
            return handle
        _private_dir(job_dir)
        attempt = self._archive_previous_attempt(job_dir)
        job_env = self.job_env(spec)
        _write_atomic(job_dir / "spec.json", json.dumps(spec.to_dict(), indent=2))
        _write_atomic(job_dir / "config.json", json.dumps(spec.config, indent=2))
        _write_atomic(job_dir / "command.json", json.dumps(
            {"argv": self.command(spec, job_dir), "cwd": str(settings.tasks_root()), "env": job_env}))
        with _open_private(job_dir / "output.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND) as log:
            # The runner inherits the worker's environment in memory (PATH, HOME, local
            # credentials) and hands it on to the job; only job_env was written down.
            proc = subprocess.Popen(
                [sys.executable, "-m", "llmops.jobs.backends.local.local_runner", str(job_dir)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=str(settings.tasks_root()),
                env={**os.environ, **job_env, "PYTHONPATH": _plugins_path(job_env)},
                start_new_session=True,  # own process group: stop() signals the whole job
            )
        _write_atomic(job_dir / "runner.json", json.dumps(
            {"pid": proc.pid, "started": time.time(), "attempt": attempt}))
        handle["reattached"] = False
        handle["attempt"] = attempt
        return handle

    def job_env(self, spec: JobSpec) -> dict[str, str]:
        """The job's own environment, what command.json records: the spec's env and what this
        backend sets. The runner lays it over the environment it inherits."""
        return {**spec.env,
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (str(settings.tasks_root()),
                                                          os.environ.get("PYTHONPATH", "")) if p)}

    def _archive_previous_attempt(self, job_dir: Path) -> int:
        runner = job_dir / "runner.json"
        if not runner.exists():
            return 1
        attempt = json.loads(runner.read_text()).get("attempt", 1)
        for name in ("output.log", "exit_code", "stopped", "result.json"):
            if (job_dir / name).exists():
                os.replace(job_dir / name, job_dir / f"{name}.attempt{attempt}")
        runner.unlink()
        return attempt + 1

    # -- observe -----------------------------------------------------------------------------
    def status(self, handle: dict[str, Any]) -> JobStatus:
        job_dir = Path(handle["job_dir"])
        if (job_dir / "stopped").exists():
            return JobStatus(JobState.STOPPED, (job_dir / "stopped").read_text())
        exit_file = job_dir / "exit_code"
        runner = job_dir / "runner.json"
        # This attempt's start and end, for the job ledger (the runner writes exit_code last).
        times = {"started_at": json.loads(runner.read_text())["started"]} if runner.exists() else {}
        if exit_file.exists():
            code = int(exit_file.read_text())
            times["ended_at"] = exit_file.stat().st_mtime
            result_file = job_dir / "result.json"
            if code == 0 and result_file.exists():
                return JobStatus(JobState.SUCCEEDED, result=json.loads(result_file.read_text()),
                                 details=times)
            if code == 0:
                return JobStatus(JobState.FAILED, "the job exited 0 but wrote no result.json",
                                 details=times)
            # A pretraining paused on request (tasks/train/pause.py) exits non-zero with a result
            # saying so (77 from its rank 0; under torchrun, torchrun's own code): pass it on.
            try:
                paused = json.loads(result_file.read_text()) if result_file.exists() else {}
            except ValueError:   # a failed job's half-written result: not a pause
                paused = {}
            return JobStatus(JobState.FAILED, f"the job exited with code {code}",
                             result=paused if isinstance(paused, dict) and paused.get("paused")
                             else None,
                             details={"exit_code": code, **times})
        if not runner.exists():
            return JobStatus(JobState.PENDING, "not started")
        pid = json.loads(runner.read_text())["pid"]
        if _alive(pid, job_dir):
            return JobStatus(JobState.RUNNING, f"runner pid {pid}", details=times)
        if exit_file.exists():  # it finished between the two checks
            return self.status(handle)
        return JobStatus(JobState.FAILED, "the job's runner died without recording an exit code")

    def read_logs(self, handle: dict[str, Any], cursor: Any = None) -> tuple[list[str], Any]:
        offset = int(cursor or 0)
        path = Path(handle["job_dir"]) / "output.log"
        if not path.exists():
            return [], offset
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
        # Hand back whole lines only; a partial last line waits for the next read.
        end = data.rfind(b"\n") + 1
        lines = data[:end].decode("utf-8", errors="replace").splitlines()
        return lines, offset + end

    # -- stop --------------------------------------------------------------------------------
    def stop(self, handle: dict[str, Any]) -> None:
        job_dir = Path(handle["job_dir"])
        runner = job_dir / "runner.json"
        if not runner.exists() or (job_dir / "exit_code").exists():
            return
        pid = json.loads(runner.read_text())["pid"]
        _write_atomic(job_dir / "stopped", f"stopped at {time.strftime('%Y-%m-%dT%H:%M:%S')}")
        if not _alive(pid, job_dir):
            return
        try:
            os.killpg(pid, signal.SIGTERM)  # the runner leads its own group: pid == pgid
            deadline = time.monotonic() + STOP_GRACE_SECONDS
            while time.monotonic() < deadline and _alive(pid, job_dir):
                time.sleep(0.2)
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _plugins_path(env: dict[str, str]) -> str:
    """The runner lives in llmops; make it importable next to the tasks root."""
    plugins = str(Path(__file__).resolve().parents[3])
    return os.pathsep.join(p for p in (plugins, env.get("PYTHONPATH", "")) if p)


def _alive(pid: int, job_dir: Path) -> bool:
    """True if `pid` is our runner: alive, not a zombie, and started for this job directory."""
    if not os.path.isdir("/proc"):  # macOS and other systems without procfs: liveness only
        try:
            _reap(pid)
            os.kill(pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                _reap(pid)
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read()
        # Just after Popen returns, cmdline can still read empty while the exec completes:
        # a live process in that state is our runner starting, not a stranger.
        return not cmdline or str(job_dir).encode() in cmdline
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
