"""A minimal stage for testing backends and the operator: `python -m tests.sample_job`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from tasks.common.entry import run_stage


@dataclass(kw_only=True)
class SampleConfig:
    seconds: float = 0.0          # how long to run
    exit_code: int = 0            # non-zero: fail with it
    spawn_child: bool = False     # start a grandchild, to prove stop() ends the whole group
    marker_dir: str = ""          # where to record the pids and each start
    print_env: list = field(default_factory=list)  # names of env vars to print (masker tests)
    pause_at_step: int = 0        # non-zero: end as a stage paused on request there (PAUSED_EXIT)


def main(cfg: SampleConfig) -> dict:
    print(f"sample job starting (pid {os.getpid()})", flush=True)
    for name in cfg.print_env:
        print(f"env {name}={os.environ.get(name, '<unset>')}", flush=True)
    if cfg.marker_dir:
        os.makedirs(cfg.marker_dir, exist_ok=True)
        with open(os.path.join(cfg.marker_dir, "starts"), "a") as fh:
            fh.write(f"{os.getpid()}\n")
        if cfg.spawn_child:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            with open(os.path.join(cfg.marker_dir, "child_pid"), "w") as fh:
                fh.write(str(child.pid))
    for i in range(int(cfg.seconds * 10)):
        if i % 10 == 0:
            print(f"working {i // 10}", flush=True)
        time.sleep(0.1)
    if cfg.exit_code:
        print("sample job failing on purpose", flush=True)
        sys.exit(cfg.exit_code)
    if cfg.pause_at_step:   # what tasks/pretrain.py returns when it paused (then exits 77)
        print(f"paused at step {cfg.pause_at_step}", flush=True)
        return {"paused": True, "paused_at_step": cfg.pause_at_step,
                "metrics": {"step": cfg.pause_at_step}}
    return {"metrics": {"answer": 42.0}, "outputs": {"where": cfg.marker_dir}}


if __name__ == "__main__":
    outcome = run_stage("sample", SampleConfig, main)
    sys.exit(77 if outcome and outcome.get("paused") else 0)
