"""Pretraining: next-token prediction on the packed token shards of data prep.

    python -m tasks.pretrain --config CONFIG.json --result RESULT.json [--faults SPEC]   (a TrainConfig)

That command is the job's supervisor (tasks/train/supervisor.py): it trains in a worker process
(one per rank; under torchrun, one per process torchrun starts), restarts a failed or hung worker
from the newest valid checkpoint up to max_restarts times, and only then fails the task. The same
command runs on every backend. --faults (or $LLMOPS_FAULTS) injects failures for testing
(tasks/train/faults.py).

A marker output_dir/checkpoints/PAUSE (or <checkpoint_uri>/PAUSE) pauses it (tasks/train/pause.py):
it checkpoints the step, logs "paused at step N", writes a result with paused: true and
paused_at_step (no model is published) and exits with PAUSED_EXIT (77) from the job's rank 0.

Writes output_dir/checkpoints/step_*/ while training (mirrored to checkpoint_uri when set),
output_dir/resilience/ (events, step times, skipped batches, goodput) and output_dir/model/ at
the end, logged to the stage's MLflow run as a model with the goodput report beside it.

This file is the command line only; the supervisor's and the worker's code, the training and its
report are tasks/train/pretraining.py (which sweep trials also call, in-process).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from typing import Any

from tasks.common.entry import run_stage
from tasks.configs import TrainConfig
from tasks.train.faults import ENV as FAULTS_ENV
from tasks.train.faults import FaultSpecError, parse_faults
from tasks.train.pretraining import run_worker, supervise
from tasks.train.supervisor import PAUSED_EXIT, WorkerEnv

log = logging.getLogger("tasks.pretrain")


def main(cfg: TrainConfig, config_path: str) -> dict[str, Any] | None:
    """`config_path`: the file `cfg` was read from, which the supervisor's workers read too."""
    env = WorkerEnv.from_env()
    if env.role is not None:
        return run_worker(cfg, env)
    return supervise(cfg, env, config_path)


if __name__ == "__main__":
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--faults", default=None)
    flags.add_argument("--config", default=None)
    known, rest = flags.parse_known_args()
    if known.faults is not None:
        try:
            parse_faults(known.faults)
        except FaultSpecError as exc:
            print(f"--faults: {exc}", file=sys.stderr)
            sys.exit(2)
        os.environ[FAULTS_ENV] = known.faults  # workers inherit it
    worker = WorkerEnv.from_env().role is not None
    try:
        # run_stage parses and validates the file; the path goes on to the supervisor, whose
        # workers are started with the job's own config file, not a copy of it.
        argv = rest if known.config is None else ["--config", known.config, *rest]
        outcome = run_stage("pretrain", TrainConfig, functools.partial(main, config_path=known.config),
                            argv=argv)
        code = PAUSED_EXIT if outcome and outcome.get("paused") else 0
    except Exception:
        if not worker:
            raise
        # a failed worker: its supervisor restarts it, and with FSDP its peers wait for it in
        # the next round, so it exits as fast as a successful one (below)
        log.exception("the worker failed; its supervisor restarts it")
        if "mlflow" in sys.modules:
            sys.modules["mlflow"].flush_async_logging()  # the metrics of the attempt that failed
        code = 1
    if worker:
        # A worker's outcome is its result file, already written and fsynced, and its log.
        # Skip the interpreter's teardown of torch and MLflow (seconds under load): the
        # supervisor is waiting for this exit to finish the job or promote a replacement.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)
