"""The fault matrix (tests/chaos/matrix.py) through a real Airflow deployment against a fake AWS
that throttles, fails, resets connections and runs the jobs: every fault must leave no duplicate,
orphaned or wrongly stopped job, no lost result and no log line shown twice.

SETUP     one fake AWS and one Airflow deployment (api-server, scheduler, dag-processor,
          triggerer; LocalExecutor) for the whole matrix, ~15 s.
BODY      every row of the matrix (about 11 minutes on 2 busy CPU cores); the result, with machine
          information, goes to benchmarks/results/fault_matrix.json (`make chaos` runs only this).
TEARDOWN  the deployment and the fake AWS stop, their processes and jobs with them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos import matrix

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("FAULT_MATRIX_OUT", ROOT / "benchmarks" / "results" / "fault_matrix.json"))


@pytest.mark.timeout(1500)
def test_every_fault_leaves_no_duplicate_orphan_wrong_stop_lost_result_or_repeated_line(tmp_path):
    only = [o for o in os.environ.get("FAULT_MATRIX_ONLY", "").split(",") if o.strip()]
    result = matrix.run_matrix(tmp_path / "chaos", only=only or None)
    matrix.write(result, OUT)
    print(matrix.table(result))
    rows = result["rows"]
    assert rows, "no row ran"
    problems = []
    for row in rows:
        if row["runs"] < 1:
            problems.append(f"{row['fault']}: no DAG run ({row['notes'][-1:]})")
        problems += [f"{row['fault']}: {n}" for n in row.get("notes", []) if n.startswith("ERROR")]
        for column in matrix.COLUMNS:
            if row[column]:
                problems.append(f"{row['fault']}: {column}={row[column]}")
    assert not problems, (f"{len(problems)} non-zero cells (details in {OUT}):\n" + "\n".join(problems)
                          + "\n\n" + matrix.table(result))
