"""In-job supervision: restart only the failed worker, from the latest checkpoint, within a budget,
without failing the Airflow task.

`python -m tasks.pretrain --config C --result R` is the supervisor; every backend runs that same
command (the local backend under torchrun when a job has several processes per node, SageMaker
and HyperPod likewise). Each process it is started as supervises one rank:

    supervisor (this module: standard library only, starts in milliseconds)
      ├── worker   python -m tasks.pretrain ... with LLMOPS_TRAIN_ROLE=worker: trains this rank
      └── spare    the same with LLMOPS_TRAIN_ROLE=spare: imports done, data opened, model built,
                   waiting on stdin to be promoted when the worker fails (a hot spare)

The supervisor
  - restarts a worker that exits non-zero (a crash, a kill, an error after training began):
    the spare is promoted (no import or set-up time), or a fresh worker started, and it resumes
    from the newest valid checkpoint; with several ranks only the failed one is restarted, the
    others rejoin a new process group in place (tasks/train/distributed.py);
  - watches the worker's heartbeat: no progress for hang_timeout_s, it dumps every thread's
    stack to the task log (faulthandler, on SIGUSR1), then kills and restarts the worker. A
    worker inside a collective may only be waiting for a hung peer, so it gets 1.5x the time:
    the hung rank is killed first and its peers recover in place;
  - gives the phases that are slow by nature a budget of their own instead of hang_timeout_s
    (`phase_timeouts`, from TrainConfig's save/restore/upload/compile_timeout_s): a checkpoint
    save, a restore, the wait for the final checkpoint to be durable (UPLOAD) and the first step
    after torch.compile. In save, restore and upload the checkpoint I/O beats too (bytes written,
    parts uploaded, chunks downloaded), so the budget bounds a stall, not the transfer: slow but
    moving I/O is never killed, and the final upload is not killed half-way. RENDEZVOUS and
    FINISHING (after the final checkpoint is durable) are left to their own timeouts;
  - stops after max_restarts restarts (the task then fails, and Airflow's retry takes over), and
    never restarts a worker that exits with FATAL_EXIT (3): bad config or data found while
    setting up, or a NaN/spike the spike guard gave up on (tasks/train/guard.py): a restart
    would only repeat either; nor one that exits with PAUSED_EXIT (77): it paused on request
    (tasks/train/pause.py) with its checkpoint committed, and the job ends there;
  - records every event (job_start, spawn, restart, hang, worker_exit, budget_exhausted) in
    events.jsonl and the task log; the worker logs them to the MLflow run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.train import telemetry as tm

log = logging.getLogger(__name__)

ROLE_ENV = "LLMOPS_TRAIN_ROLE"  # "worker" or "spare" in a child; unset in the supervisor
ATTEMPT_ENV = "LLMOPS_TRAIN_ATTEMPT"
RUN_DIR_ENV = "LLMOPS_TRAIN_RUN_DIR"
FATAL_EXIT = 3  # a failure a restart would repeat (bad config or data, the guard gave up)
# a node failed a health check (tasks/train/health.py): restarting on it would repeat the failure
NODE_UNHEALTHY_EXIT = 76
# the job paused on request (tasks/train/pause.py): its checkpoint of that step is committed and
# its result says paused_at_step; not a failure to restart. Not 75: that is a worker stuck in a
# group its peers left (tasks/train/distributed.STALE_GROUP_EXIT), which must be restarted
PAUSED_EXIT = 77
STOP_GRACE_S = 10.0


@dataclass
class WorkerEnv:
    """What a worker learns from its environment."""

    role: str | None
    attempt: int
    rank: int
    local_rank: int
    world_size: int
    run_dir: Path | None

    @classmethod
    def from_env(cls) -> "WorkerEnv":
        run_dir = os.environ.get(RUN_DIR_ENV)
        return cls(role=os.environ.get(ROLE_ENV) or None,
                   attempt=int(os.environ.get(ATTEMPT_ENV, "1")),
                   rank=int(os.environ.get("RANK", "0")),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                   world_size=int(os.environ.get("WORLD_SIZE", "1")),
                   run_dir=Path(run_dir) if run_dir else None)

    @property
    def heartbeat_path(self) -> Path | None:
        return self.run_dir / f"heartbeat.rank{self.rank}" if self.run_dir else None

    def wait_for_promotion(self) -> None:
        """A spare blocks here until the supervisor sends one JSON line: the environment of the
        worker it replaces. End of input (the supervisor is gone or finished) ends the spare."""
        line = sys.stdin.readline()
        if not line:
            sys.exit(0)
        message = json.loads(line)
        os.environ.update(message["env"])
        os.environ[ROLE_ENV] = "worker"
        self.role, self.attempt = "worker", int(message["env"][ATTEMPT_ENV])


def _die_with_parent() -> None:
    """Runs in the child before exec: if the supervisor is killed outright (SIGKILL), the
    kernel kills its workers too, so nothing is left training on its own."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class _Child:
    def __init__(self, proc: subprocess.Popen, attempt: int, role: str) -> None:
        self.proc, self.attempt, self.role = proc, attempt, role
        self.started = time.time()
        self.dumped_at: float = 0.0  # heartbeat time of the stall we already dumped stacks for
        self.training_since: float | None = None  # when its first step was seen

    @property
    def pid(self) -> int:
        return self.proc.pid


class Supervisor:
    def __init__(self, *, run_dir: Path, worker_cmd: list[str], max_restarts: int,
                 hang_timeout_s: float, hot_spare: bool, rank: int = 0,
                 poll_s: float = 0.05, dump_grace_s: float = 1.0,
                 victim_factor: float = 1.5, spare_delay_s: float = 10.0,
                 phase_timeouts: dict[int, float] | None = None) -> None:
        self.run_dir, self.worker_cmd, self.rank = run_dir, worker_cmd, rank
        # phase -> seconds without progress before a kill; hang_timeout_s for the phases not
        # named, never for the phases another timeout bounds
        self.phase_timeouts = {**(phase_timeouts or {}), tm.RENDEZVOUS: None, tm.FINISHING: None}
        self.max_restarts, self.hang_timeout_s, self.hot_spare = max_restarts, hang_timeout_s, hot_spare
        self.poll_s, self.dump_grace_s, self.victim_factor = poll_s, dump_grace_s, victim_factor
        self.spare_delay_s = spare_delay_s
        self.events = tm.EventLog(run_dir, rank=rank, source="supervisor")
        self.heartbeat = run_dir / f"heartbeat.rank{rank}"
        self.restarts, self.hangs = 0, 0
        self._stop: int | None = None
        self._spare_failures = 0

    # -- children ----------------------------------------------------------------------------
    def _env(self, attempt: int) -> dict[str, str]:
        env = {ATTEMPT_ENV: str(attempt), RUN_DIR_ENV: str(self.run_dir)}
        run_id_file = self.run_dir / "mlflow_run_id"
        if not os.environ.get("MLFLOW_RUN_ID") and run_id_file.exists():
            # run from the command line: the first worker opened the run; later ones reuse it
            env["MLFLOW_RUN_ID"] = run_id_file.read_text().strip()
        return env

    def _start(self, role: str, attempt: int) -> _Child:
        env = {**os.environ, **self._env(attempt), ROLE_ENV: role}
        proc = subprocess.Popen(self.worker_cmd, env=env, preexec_fn=_die_with_parent,
                                stdin=subprocess.PIPE if role == "spare" else subprocess.DEVNULL)
        return _Child(proc, attempt, role)

    def _spawn(self, attempt: int) -> _Child:
        tm.reset_heartbeat(self.heartbeat)
        child = self._start("worker", attempt)
        self.events.emit("spawn", attempt=attempt, worker_pid=child.pid, mode="cold")
        return child

    def _promote(self, spare: _Child, attempt: int) -> _Child | None:
        """Hand the failed worker's place to the spare; None if the spare is not usable."""
        if spare.proc.poll() is not None:
            return None
        tm.reset_heartbeat(self.heartbeat)
        try:
            assert spare.proc.stdin is not None
            spare.proc.stdin.write(json.dumps({"env": self._env(attempt)}).encode() + b"\n")
            spare.proc.stdin.close()
        except OSError:
            return None
        spare.attempt, spare.role = attempt, "worker"
        self.events.emit("spawn", attempt=attempt, worker_pid=spare.pid, mode="hot_spare")
        return spare

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """Supervise until the worker succeeds (0) or the budget is spent (its exit code)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        self.events.emit("job_start", max_restarts=self.max_restarts,
                         hang_timeout_s=self.hang_timeout_s, hot_spare=self.hot_spare,
                         phase_timeouts={tm.PHASES[p]: s for p, s in self.phase_timeouts.items()})
        worker: _Child | None = self._spawn(attempt=1)
        spare: _Child | None = None
        try:
            while True:
                assert worker is not None
                if self._stop is not None:
                    self.events.emit("stopped", signal=self._stop)
                    return 128 + self._stop
                code = worker.proc.poll()
                if code is None and self._watch(worker):
                    code = worker.proc.wait()
                if code is None:
                    spare = self._tend_spare(worker, spare)
                    time.sleep(self.poll_s)
                    continue
                step = tm.read_heartbeat(self.heartbeat).step
                self.events.emit("worker_exit", code=code, attempt=worker.attempt, step=step)
                if code == 0:
                    return 0
                if code == PAUSED_EXIT:
                    self.events.emit("paused", attempt=worker.attempt, step=step)
                    return code
                if code in (FATAL_EXIT, NODE_UNHEALTHY_EXIT):
                    self.events.emit("fatal", attempt=worker.attempt,
                                     reason="the worker stopped on an error a restart would "
                                            "repeat (its log says which)" if code == FATAL_EXIT
                                     else "a node failed a health check: the job stops for it "
                                          "to be replaced (its log names the rank and host)")
                    return code
                if self.restarts >= self.max_restarts:
                    self.events.emit("budget_exhausted", restarts=self.restarts)
                    return code if code > 0 else 128 - code
                self.restarts += 1
                attempt = worker.attempt + 1
                worker = self._promote(spare, attempt) if spare is not None else None
                spare = None
                if worker is None:
                    worker = self._spawn(attempt)
                self.events.emit("restart", restart=self.restarts, of=self.max_restarts,
                                 attempt=attempt, worker_pid=worker.pid)
        finally:
            for child in (worker, spare):
                if child is not None:
                    _terminate(child.proc)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._stop = signum  # the loop stops the children and returns 128 + signum

    def _tend_spare(self, worker: _Child, spare: _Child | None) -> _Child | None:
        if not self.hot_spare or self._spare_failures >= 3:
            return spare
        if spare is not None:
            if spare.proc.poll() is None:
                return spare
            self._spare_failures += 1
            self.events.emit("spare_exit", code=spare.proc.returncode)
            spare = None
        # Start the spare once the worker has trained for spare_delay_s: during the worker's
        # start-up it would compete for the CPU on the critical path, and a job that ends
        # within seconds gains nothing from a spare (its own warm-up takes seconds).
        beat = tm.read_heartbeat(self.heartbeat)
        if beat.pid != worker.pid or beat.step < 1:
            return None
        if worker.training_since is None:
            worker.training_since = time.time()
        if time.time() - worker.training_since >= self.spare_delay_s:
            spare = self._start("spare", worker.attempt)
            self.events.emit("spare_start", spare_pid=spare.pid)
        return spare

    def budget(self, phase: int) -> float | None:
        """Seconds without progress the watchdog allows in `phase`; None: no limit of its own."""
        return self.phase_timeouts.get(phase, self.hang_timeout_s)

    def _watch(self, worker: _Child) -> bool:
        """The hang watchdog; True when it killed the worker."""
        beat = tm.read_heartbeat(self.heartbeat)
        budget = self.budget(beat.phase)
        if beat.pid != worker.pid or beat.t == 0.0 or budget is None:
            return False  # not started yet, or blocked where a timeout of its own applies
        t = beat.progress_t()
        stale = time.time() - t
        if stale < budget:
            return False
        phase = tm.PHASES[beat.phase]
        if worker.dumped_at != t:
            worker.dumped_at = t
            log.error("[supervisor rank %d] no progress from worker %d for %.1fs (step %d, %s, "
                      "budget %.0fs); dumping its stacks", self.rank, worker.pid, stale, beat.step,
                      phase, budget)
            _signal(worker.proc, signal.SIGUSR1)
            time.sleep(self.dump_grace_s)  # let faulthandler write every thread's stack
            if tm.read_heartbeat(self.heartbeat).progress_t() != t:
                return False  # it moved on (a waiting peer that got its error, say)
        limit = budget * (self.victim_factor if beat.phase == tm.SYNC else 1.0)
        if time.time() - t < limit:
            return False
        _signal(worker.proc, signal.SIGKILL)
        worker.proc.wait()
        self.hangs += 1
        self.events.emit("hang", attempt=worker.attempt, step=beat.step, phase=phase,
                         budget_s=budget, last_progress=t, stale_s=round(time.time() - t, 3))
        return True


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _terminate(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after a grace period: a worker may be flushing a checkpoint."""
    if proc.poll() is not None:
        return
    if proc.stdin is not None:
        try:
            proc.stdin.close()  # a waiting spare reads end of input and exits at once
        except OSError:
            pass
    _signal(proc, signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal(proc, signal.SIGKILL)
        proc.wait()
