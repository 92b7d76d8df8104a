"""Where the per-shard work runs: in this process, on Ray Data, or split across SageMaker hosts.

A job is a JSON-able dict; a shard function takes one job and returns a JSON-able summary. The
function only ever writes its own shard's files, atomically, so any engine may retry it.

- `local`: a loop in this process.
- `ray`: one Ray Data task per shard (`Dataset.map` on a task pool of `workers`). On the cluster at
  RAY_ADDRESS when it is set (its workers must have this repository, as the job image does),
  else on a local Ray started here with `workers` CPUs and stopped at the end.
- SageMaker Processing runs the container once per instance: `host_share()` tells this instance
  its rank and the number of instances, and the caller keeps the shards with index % hosts == rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

ShardFn = Callable[[dict], dict]
RESOURCE_CONFIG = "/opt/ml/config/resourceconfig.json"


class LocalEngine:
    name = "local"

    def map(self, fn: ShardFn, jobs: list[dict]) -> list[dict]:
        return [fn(job) for job in jobs]


def _call_json(fn: ShardFn) -> Callable[[dict], dict]:
    # Ray Data rows become Arrow columns; a JSON string keeps nested dicts exactly as they are.
    def run(row: dict) -> dict:
        return {"result": json.dumps(fn(json.loads(row["job"])))}
    return run


class RayEngine:
    name = "ray"

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def map(self, fn: ShardFn, jobs: list[dict]) -> list[dict]:
        import ray.data

        if not jobs:
            return []
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ds = ray.data.from_items([{"job": json.dumps(job)} for job in jobs],
                                 override_num_blocks=len(jobs))
        # One task per shard, at most `workers` at once. Ray reruns a task whose worker died,
        # which is safe: a shard writes only its own files, atomically.
        pool = ray.data.TaskPoolStrategy(size=min(self.workers, len(jobs)))
        rows = ds.map(_call_json(fn), num_cpus=1, compute=pool).take_all()
        return [json.loads(row["result"]) for row in rows]


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block (for processes started in it)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def open_engine(name: str, workers: int) -> Iterator[LocalEngine | RayEngine]:
    """The engine for one run; a local Ray is started lazily on first use and stopped after."""
    if name == "local":
        yield LocalEngine()
        return
    import ray

    # Local clusters of this Ray version ask for an auth token unless told not to.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started_here, temp_dir = not ray.is_initialized(), None
    repo_root = str(Path(__file__).resolve().parents[2])
    pythonpath = os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p)
    # One tokenizer thread per worker: the workers are the parallelism, threads would oversubscribe.
    env = {"PYTHONPATH": pythonpath, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        if started_here and os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False, runtime_env={"env_vars": env})
        elif started_here:
            # Ray's socket paths must stay under ~107 characters: no deep temp dirs here.
            temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
            # The local workers inherit the environment Ray is started with; a runtime_env would
            # do the same through Ray's runtime-env agent, at several seconds per start.
            with _environment(env):
                ray.init(num_cpus=workers, include_dashboard=False, _temp_dir=temp_dir,
                         log_to_driver=False)
        yield RayEngine(workers)
    finally:
        if started_here and ray.is_initialized():
            ray.shutdown()
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)


def host_share(resource_config: str = RESOURCE_CONFIG) -> tuple[int, int]:
    """(rank, hosts) of this machine among the instances of one job.

    DATA_PREP_HOST_RANK and DATA_PREP_NUM_HOSTS win when set (any scheduler can set them);
    otherwise SageMaker's resourceconfig.json (`current_host` among the sorted `hosts`);
    otherwise (0, 1): a single machine does every shard."""
    rank, hosts = os.environ.get("DATA_PREP_HOST_RANK"), os.environ.get("DATA_PREP_NUM_HOSTS")
    if rank is not None or hosts is not None:
        if rank is None or hosts is None or not rank.isdigit() or not hosts.isdigit() \
                or not 0 <= int(rank) < int(hosts):
            raise ValueError(f"DATA_PREP_HOST_RANK={rank!r} and DATA_PREP_NUM_HOSTS={hosts!r} must "
                             "both be set, as integers with 0 <= rank < hosts.")
        return int(rank), int(hosts)
    if os.path.exists(resource_config):
        with open(resource_config) as fh:
            info: dict[str, Any] = json.load(fh)
        hosts_list = sorted(info["hosts"])
        return hosts_list.index(info["current_host"]), len(hosts_list)
    return 0, 1
