"""The process engine as data prep uses it: `workers` jobs at once (this process and a pool started
when the engine opens), results in the jobs' order, a failing job's own error, and no worker
process left behind once the engine closes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tasks.data.engine import open_engine
from tests.test_jobs import pid_alive


def _meet(job: dict) -> dict:
    """Wait (up to a minute) until every job of the map has started: only runs that have them all
    going at once get past it."""
    Path(job["dir"], f"{job['n']}.started").touch()
    deadline = time.monotonic() + 60
    while len(list(Path(job["dir"]).glob("*.started"))) < job["of"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job['n']}: the other jobs never started alongside it")
        time.sleep(0.01)
    return {"n": job["n"], "pid": os.getpid()}


def _whoami(job: dict) -> dict:
    if job.get("fail"):
        raise ValueError(f"job {job['n']} failed")
    return {"n": job["n"], "pid": os.getpid()}


def _gone(pid: int, within: float = 10.0) -> bool:
    """The process has exited within `within` seconds (reaped, or a zombie waiting for its parent)."""
    deadline = time.monotonic() + within
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_two_workers_run_two_jobs_at_once_and_leave_no_process_behind(tmp_path):
    with open_engine("processes", 2) as engine:
        # Two jobs that each wait for the other: they finish only if both run at the same time,
        # one in this process and one in the pool's worker.
        met = engine.map(_meet, [{"n": n, "of": 2, "dir": str(tmp_path), "bytes": n} for n in range(2)])
        assert [r["n"] for r in met] == [0, 1]
        worker = ({r["pid"] for r in met} - {os.getpid()}).pop()
        assert os.getpid() in {r["pid"] for r in met}

        # Results come back in the jobs' order, though the largest ("bytes") are started first.
        jobs = [{"n": n, "bytes": (n * 7) % 10} for n in range(10)]
        assert [r["n"] for r in engine.map(_whoami, jobs)] == list(range(10))
        # A map of one job (a small stage) runs here, with no round trip to the pool.
        assert engine.map(_whoami, [{"n": 0}]) == [{"n": 0, "pid": os.getpid()}]
        # A failing job raises its own error, wherever it ran.
        with pytest.raises(ValueError, match="job 3 failed"):
            engine.map(_whoami, [{"n": n, "fail": n == 3} for n in range(6)])
    assert _gone(worker), f"pool worker {worker} still running after the engine closed"


def test_one_worker_runs_every_job_here(tmp_path):
    with open_engine("processes", 1) as engine:
        out = engine.map(_whoami, [{"n": n} for n in range(4)])
    assert out == [{"n": n, "pid": os.getpid()} for n in range(4)]


def _table_from_lists(job: dict) -> dict:
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [f"d{job['n']}"], "tokens": [[1, 2, 3]]}),
                   Path(job["dir"], f"{job['n']}.parquet"))
    return {**_meet(job), "pandas": "pandas" in sys.modules}  # one job in each process


_NO_PANDAS_RUN = """
import json, os, sys
from tasks.data.engine import open_engine
from tests.test_data_engine import _table_from_lists
with open_engine("processes", 2) as engine:
    out = engine.map(_table_from_lists, [{"n": n, "of": 2, "dir": sys.argv[1]} for n in range(2)])
import pyarrow.parquet as pq
print(json.dumps({"jobs": out, "driver": os.getpid(), "driver_pandas": "pandas" in sys.modules,
                  "to_pandas": len(pq.read_table(sys.argv[1] + "/0.parquet").to_pandas())}))
"""


def test_data_prep_processes_never_import_pandas_yet_to_pandas_still_works(tmp_path):
    """pyarrow imports pandas (~0.3 s of CPU per process) the first time it converts a Python list,
    only to ask whether it is a pandas object; the engine answers that question for it. Run in a
    fresh interpreter: this one may have pandas imported already."""
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{repo / 'plugins'}"}
    done = subprocess.run([sys.executable, "-c", _NO_PANDAS_RUN, str(tmp_path)], cwd=repo, check=True,
                          capture_output=True, text=True, env=env, timeout=120)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert {job["pid"] for job in result["jobs"]} - {result["driver"]}, "no job ran in the pool's worker"
    assert not any(job["pandas"] for job in result["jobs"]), result
    assert not result["driver_pandas"], result
    assert result["to_pandas"] == 1  # pandas is still there when asked for explicitly
    assert len(list(tmp_path.glob("*.parquet"))) == 2
