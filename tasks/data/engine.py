"""Where the per-shard work runs: in this process, in a pool of processes, on Ray Data, or split
across SageMaker hosts.

A job is a JSON-able dict; a shard function takes one job and returns a JSON-able summary. The
function only ever writes its own shard's files, atomically, so any engine may retry it.

- `local`: a loop in this process.
- `processes`: `workers` jobs at once on this machine: this process runs jobs itself beside a pool
  of `workers - 1` processes, all taking the next job as they finish one (largest first). The
  pool's processes fork from a server that has imported the shard code and the libraries it uses
  once (PRELOAD), so the pool is ready in about a second where a local Ray takes 5-10 s to start;
  on one machine Ray adds nothing else that pays for that. That second is not waited for: the pool
  starts in the background when the engine is opened, and this process, whose imports are done,
  works meanwhile. A worker that dies (out of memory) fails the run; a rerun keeps every shard
  that finished.
- `ray`: one Ray Data task per shard (`Dataset.map` on a task pool of `workers`). On the cluster at
  RAY_ADDRESS when it is set (its workers must have this repository, as the job image does),
  else on a local Ray started here with `workers` CPUs and stopped at the end.
- SageMaker Processing runs the container once per instance: `host_share()` tells this instance
  its rank and the number of instances, and the caller keeps the shards with index % hosts == rank.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import multiprocessing
import os
import sys
import shutil
import tempfile
import threading
from pathlib import Path
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

ShardFn = Callable[[dict], dict]
RESOURCE_CONFIG = "/opt/ml/config/resourceconfig.json"
# One tokenizer thread per worker: the workers are the parallelism, threads would oversubscribe.
WORKER_ENV = {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class LocalEngine:
    name = "local"

    def map(self, fn: ShardFn, jobs: list[dict]) -> list[dict]:
        return [fn(job) for job in jobs]


def _importable_name(fn: ShardFn) -> tuple[str, str]:
    """(module, name) another process imports `fn` by. Run as `python -m tasks.data.prep`, the
    shard functions live in `__main__`, which a pool worker's `__main__` is not."""
    module = fn.__module__
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is None:
            raise ValueError(f"{fn.__qualname__} is defined in a script, not a module: a pool worker "
                             "cannot import it. Run it as `python -m <module>`.")
        module = spec.name
    return module, fn.__qualname__


class _NoPandas:
    """An import hook under which `import pandas` fails (ImportError), as if it were not installed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.partition(".")[0] == "pandas":
            raise ImportError("pandas is hidden while pyarrow probes for it")


def skip_pyarrow_pandas_probe() -> None:
    """Keep pyarrow from importing pandas (~0.3 s of CPU, in every process) just to ask whether a
    Python list it converts is a pandas object: data prep never hands it one. pyarrow asks once per
    process and remembers the answer; with pandas hidden for that one question it remembers "no
    pandas". What asks pyarrow for pandas later (`to_pandas`) still gets it: pyarrow imports
    pandas when explicitly asked."""
    if "pandas" in sys.modules:
        return
    import pyarrow as pa

    hook = _NoPandas()
    sys.meta_path.insert(0, hook)  # type: ignore[arg-type]
    try:
        pa.array([0])
    finally:
        sys.meta_path.remove(hook)  # type: ignore[arg-type]


def _start_worker(environment: dict[str, str]) -> None:
    os.environ.update(environment)
    skip_pyarrow_pandas_probe()


def _call_by_name(target: tuple[str, str], job: dict) -> dict:
    module, name = target
    return getattr(importlib.import_module(module), name)(job)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block (for processes started in it, and
    libraries that read them on each call)."""
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


# What the pool's server imports before it forks any worker, so no worker imports it again: the
# modules of every function data prep maps, and the libraries they import only when first called.
# A worker's first job used to pay for these (~0.3 s of CPU each on 2 cores). A missing one is
# skipped.
PRELOAD = ("tasks.data.prep", "tasks.data.dedup", "tasks.data.contamination", "pyarrow.parquet", "phonenumbers",
           "tokenizers")


class ProcessEngine:
    name = "processes"

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._starting: threading.Thread | None = None

    def start(self) -> None:
        """Start the pool now, without waiting for it: launching a worker waits for the server's
        imports (about a second), which this process's own work can overlap."""
        if self._pool is not None or self.workers < 2:
            return
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOAD))
        self._pool = ProcessPoolExecutor(self.workers - 1, mp_context=context,
                                         initializer=_start_worker, initargs=(WORKER_ENV,))
        # The first submit launches every worker (forkserver pools do not grow on demand).
        self._starting = threading.Thread(target=self._pool.submit, args=(int,), daemon=True,
                                          name="data-prep-pool-start")
        self._starting.start()

    def map(self, fn: ShardFn, jobs: list[dict]) -> list[dict]:
        """fn over the jobs, `workers` at once; the results in the jobs' order. A failed job stops
        the others from starting and its error is raised (the first job's, if several failed)."""
        if not jobs:
            return []
        spread = min(self.workers - 1, len(jobs) - 1)  # pool workers this map uses
        target = _importable_name(fn) if spread else None
        self.start()
        # Largest first (shards and documents-and-tokens jobs know their input bytes): the jobs
        # that start last are then the small ones, so the workers finish close together.
        order = iter(sorted(range(len(jobs)), key=lambda i: -jobs[i].get("bytes", 0)))
        results: list[Any] = [None] * len(jobs)
        errors: dict[int, BaseException] = {}
        lock = threading.Lock()

        def take() -> int | None:
            with lock:
                return None if errors else next(order, None)

        def fail(i: int, exc: BaseException) -> None:
            with lock:
                errors[i] = exc

        def feed() -> None:  # one pool worker's jobs, one at a time: none waits queued behind another
            assert self._starting is not None
            self._starting.join()  # until the pool is up, this process takes every job
            while (i := take()) is not None:
                try:
                    assert self._pool is not None
                    results[i] = self._pool.submit(_call_by_name, target, jobs[i]).result()
                except BaseException as exc:  # noqa: BLE001 - raised below, in this thread
                    fail(i, exc)

        feeders = [threading.Thread(target=feed, daemon=True, name=f"data-prep-feed-{k}")
                   for k in range(spread)]
        for thread in feeders:
            thread.start()
        # This process is one of the workers: its imports are done, and it works while the pool
        # starts, so a stage of a few small jobs (the dedup buckets) never waits for the pool, and
        # a map of one job makes no round trip. Its tokenizer uses one thread, like a pool
        # worker's: the workers are the parallelism.
        with _environment({"TOKENIZERS_PARALLELISM": "false"}):
            while (i := take()) is not None:
                try:
                    results[i] = fn(jobs[i])
                except BaseException as exc:  # noqa: BLE001 - raised below, after the pool's jobs stop
                    fail(i, exc)
        for thread in feeders:
            thread.join()
        if errors:
            exc = errors[min(errors)]
            if isinstance(exc, BrokenProcessPool):
                raise RuntimeError(f"A data prep worker process died (out of memory? {self.workers} workers "
                                   "share this machine); rerun it: shards that finished are kept, or "
                                   "lower DataPrepConfig.workers.") from exc
            raise exc
        return results

    def close(self) -> None:
        if self._starting is not None:
            self._starting.join()
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None


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
def open_engine(name: str, workers: int) -> Iterator[LocalEngine | ProcessEngine | RayEngine]:
    """The engine for one run; a process pool (in the background) or a local Ray is started here
    and stopped after."""
    skip_pyarrow_pandas_probe()
    if name == "local":
        yield LocalEngine()
        return
    if name == "processes":
        engine = ProcessEngine(workers)
        try:
            engine.start()
            yield engine
        finally:
            engine.close()
        return
    import ray

    # Local clusters of this Ray version ask for an auth token unless told not to.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started_here, temp_dir = not ray.is_initialized(), None
    repo_root = str(Path(__file__).resolve().parents[2])
    pythonpath = os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": pythonpath, **WORKER_ENV}
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
