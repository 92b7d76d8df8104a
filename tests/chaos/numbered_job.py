"""The fault matrix's job: `python -m tests.chaos.numbered_job`, like tests.sample_job but every
line it prints is numbered and carries a token drawn when the process starts:

    chaos-line 7 run=3f9a1c2e

so a line seen twice in a task's log (across its tries and the triggerer's parts) is a line of
the same job run shown twice, never two jobs that happen to print the same text. Its first line,
`chaos-label <label>`, says which task instance submitted it (the DAG passes
`<dag_id>/<run_id>/<task_id>`): the matrix reads it from the job's CloudWatch stream to attribute
jobs to task instances whatever naming scheme the operator uses.

Its progress is the line number, and it checkpoints it as a training stage does, every
`checkpoint_every` lines, where a new attempt on a fresh machine finds it: a `step_NNNNNN`
directory with its manifest written last, under `<output_dir>/checkpoints` (the platform's
synced dir: SageMaker's /opt/ml/checkpoints, linked there by docker/job_entry.py) and, where
nothing syncs the node's disk (Batch), written through to `checkpoint_uri` on S3 by the same
S3Mirror the training loop uses. A new attempt resumes after the newest complete one, saying
`chaos-resume <line> run=<token>`: the lines it prints again are the progress a failure cost
(the matrix's lost_progress_steps)."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tasks.common.entry import run_stage
from tasks.train.checkpoint_s3 import MANIFEST, S3Mirror   # boto3 is imported on a mirror's first call


@dataclass(kw_only=True)
class NumberedConfig:
    seconds: float = 30.0        # how long to run, one line per second
    exit_code: int = 0           # non-zero: fail with it at the end
    label: str = ""              # who submitted it: <dag_id>/<run_id>/<task_id>
    # (None: a DAG's "" rendered as a native object)
    output_dir: str | None = None       # the entry's output dir; checkpoints go under it
    checkpoint_uri: str | None = None   # s3:// prefix that every checkpoint is written through to
    checkpoint_every: int = 5    # lines between checkpoints: the most a failure may cost


class LineCheckpoints:
    """The newest line reached, committed as `step_<line>/manifest.json` locally and on S3."""

    def __init__(self, cfg: NumberedConfig) -> None:
        self.root = Path(cfg.output_dir) / "checkpoints" if cfg.output_dir else None
        self.mirror = None
        if (cfg.checkpoint_uri or "").startswith("s3://"):
            self.mirror = S3Mirror(cfg.checkpoint_uri)

    def newest(self) -> int | None:
        steps: set[int] = set()
        if self.root is not None and self.root.is_dir():
            steps.update(int(p.name[5:]) for p in self.root.glob("step_*")
                         if p.name[5:].isdigit() and (p / MANIFEST).is_file())
        if self.mirror is not None:
            steps.update(self.mirror.steps())
        return max(steps) if steps else None

    def save(self, line: int) -> None:
        if self.root is None:
            return
        final = self.root / f"step_{line:06d}"
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / MANIFEST).write_text(json.dumps({"files": {}, "line": line}))
        os.replace(tmp, final)
        if self.mirror is not None:
            self.mirror.upload_checkpoint(final)


def main(cfg: NumberedConfig) -> dict:
    token = os.urandom(4).hex()
    count = max(1, int(cfg.seconds))
    checkpoints = LineCheckpoints(cfg)
    print(f"chaos-label {cfg.label} run={token}", flush=True)
    newest = checkpoints.newest()
    start = 0 if newest is None else newest + 1
    if newest is not None:
        print(f"chaos-resume {start} run={token}", flush=True)
    for n in range(start, count):
        print(f"chaos-line {n} run={token}", flush=True)
        time.sleep(cfg.seconds / count)
        if cfg.checkpoint_every and (n + 1) % cfg.checkpoint_every == 0 and n + 1 < count:
            checkpoints.save(n)
    if cfg.exit_code:
        print(f"chaos job failing on purpose with exit code {cfg.exit_code} run={token}", flush=True)
        sys.exit(cfg.exit_code)
    return {"metrics": {"answer": 42.0, "lines": float(count)}, "outputs": {"token": token}}


if __name__ == "__main__":
    run_stage("chaos", NumberedConfig, main)
