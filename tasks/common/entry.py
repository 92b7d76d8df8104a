"""The one contract every stage entrypoint follows, on every backend.

    python -m tasks.<stage> --config CONFIG.json --result RESULT.json

The config is the stage's dataclass as JSON (validated, unknown keys refused). The stage returns
a dict of metrics and output paths; it is written atomically to the result file, which is how a
local process, a SageMaker container or a pod hands its outcome back to Airflow.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any, Callable, TypeVar

from tasks.common.io import read_json, write_json
from tasks.configs import ConfigError, from_dict

C = TypeVar("C")
log = logging.getLogger("tasks")


def run_stage(stage: str, config_cls: type[C], main: Callable[[C], dict[str, Any] | None],
              argv: list[str] | None = None) -> dict[str, Any] | None:
    """Parse, validate, run `main`, write its result, and return it. `main` returns None in a
    process whose job's result another process writes (a distributed job's ranks other than 0:
    the file may sit on another node's disk, so nobody waits for it)."""
    parser = argparse.ArgumentParser(prog=f"python -m tasks.{stage}")
    parser.add_argument("--config", required=True, help="Stage config JSON file.")
    parser.add_argument("--result", required=True, help="Where to write the result JSON.")
    args = parser.parse_args(argv)
    # MLflow draws a tqdm bar for every artifact download or upload ("Downloading artifacts",
    # 16 lines per job in the task log). Read at each use; the job's own processes inherit it.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # Likewise transformers, huggingface_hub, datasets and lm-evaluation-harness (a bar per model
    # load and save, per harness task: thousands of lines, which also fill a pipe nobody drains);
    # and nothing asks the Hub for anything: every model comes from a local directory.
    for name, value in (("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("TQDM_DISABLE", "1"),
                        ("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                        ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")):
        os.environ.setdefault(name, value)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = from_dict(config_cls, read_json(args.config))
    except (ConfigError, OSError, ValueError) as exc:
        # Fail before any expensive work, with the field named.
        log.error("invalid config %s: %s", args.config, exc)
        sys.exit(2)
    started = time.time()
    result = main(config)
    if result is None:
        log.info("%s finished in %.1fs; rank 0 writes the job's result", stage, time.time() - started)
        return None
    result.setdefault("stage", stage)
    result.setdefault("seconds", round(time.time() - started, 3))
    write_json(args.result, result)
    log.info("%s finished in %.1fs; result written to %s", stage, time.time() - started, args.result)
    return result
