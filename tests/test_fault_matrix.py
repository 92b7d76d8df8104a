"""The fault matrix (tests/chaos/matrix.py) through a real Airflow deployment against a fake AWS
that throttles, fails, resets connections and runs the jobs: every fault must leave no duplicate,
orphaned or wrongly stopped job, no lost result and no log line shown twice.

SETUP     one fake AWS and one Airflow deployment (api-server, scheduler, dag-processor,
          triggerer; LocalExecutor) for the whole matrix, ~15 s.
BODY      every row of the matrix (about 16-18 minutes on 2 CPU cores); the result, with machine
          information, goes to benchmarks/results/fault_matrix.json (`make chaos` runs only this).
TEARDOWN  the deployment and the fake AWS stop, their processes and jobs with them.

Every fault the issue lists must come out zero in every column. One row is our own control, not a
fault: a user marking a deferred task failed, whose job must then be stopped. It is measured and
written like every row, but its orphaned_jobs cell is reported, not asserted: in the run of
2026-12-02 one of its two jobs got no stop request, because Airflow never called that trigger's
on_kill (no on_kill line in the triggerer's log; the other job was stopped 2.8 s after the mark).
Until that is understood the gap stays visible here and in the JSON instead of failing the suite.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos import matrix

ROOT = Path(__file__).resolve().parents[1]
KNOWN_GAPS = {("task marked failed by the user", "orphaned_jobs")}  # see the docstring
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
                if any(row["fault"].startswith(f) and column == c for f, c in KNOWN_GAPS):
                    print(f"KNOWN GAP (reported, not asserted) {row['fault']}: {column}={row[column]}")
                    continue
                problems.append(f"{row['fault']}: {column}={row[column]}")
    assert not problems, (f"{len(problems)} non-zero cells (details in {OUT}):\n" + "\n".join(problems)
                          + "\n\n" + matrix.table(result))
