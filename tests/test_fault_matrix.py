"""The fault matrix (tests/chaos/matrix.py) through a real Airflow deployment on PostgreSQL (as
MWAA's metadata DB) against a fake AWS that throttles, fails, resets connections and runs the
jobs: every fault must land where it claims, and leave no duplicate, orphaned or wrongly stopped
job, no lost result and no log line shown twice.

SETUP     one PostgreSQL cluster in a temp dir (tests/chaos/postgres.py), one fake AWS and one
          Airflow deployment (api-server, scheduler, dag-processor, triggerer; LocalExecutor) for
          the whole matrix.
BODY      every row of the matrix: the rows whose faults hit every client or component alone,
          then the rest side by side. The result, with machine information, is written to the
          test's tmp dir, or to FAULT_MATRIX_OUT when set: `make test` leaves the committed
          benchmarks/results/fault_matrix.json alone; `make chaos` (the matrix alone) and
          benchmarks/make_test_timings.py (a recorded clean-clone run) write it. A subset:
          FAULT_MATRIX_ONLY=substring,...
TEARDOWN  the deployment, the fake AWS and PostgreSQL stop, their processes and jobs with them.

Asserted, per row: at least one DAG run; no ERROR note (a row that broke); every half the row
claims (each task, or each run's task) has a record of its fault landing there (what and when:
a worker signalled while alive, a job failed/stopped while running, a component hit while the
task's job ran, injections into that service's calls...) and none was missed; every column zero,
the user's mark-failed control included (its jobs stopped, none orphaned); no failure cost more
than one checkpoint interval of the job's progress (lost_progress_steps).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos import matrix


@pytest.mark.timeout(3600)   # the matrix took 30+ min at load 15-26 on 2 cores
def test_every_fault_lands_and_leaves_no_duplicate_orphan_wrong_stop_lost_result_or_repeated_line(tmp_path):
    only = [o for o in os.environ.get("FAULT_MATRIX_ONLY", "").split(",") if o.strip()]
    result = matrix.run_matrix(tmp_path / "chaos", only=only or None)
    out = Path(os.environ.get("FAULT_MATRIX_OUT") or tmp_path / "fault_matrix.json")
    matrix.write(result, out)
    print(matrix.table(result))
    rows = result["rows"]
    assert rows, "no row ran"
    problems = []
    for row in rows:
        if row["runs"] < 1:
            problems.append(f"{row['fault']}: no DAG run ({row['notes'][-1:]})")
        problems += [f"{row['fault']}: {n}" for n in row.get("notes", []) if n.startswith("ERROR")]
        problems += [f"{row['fault']}: fault not landed: {m}" for m in row["fault_missed"]]
        if not row["fault_landed"]:
            problems.append(f"{row['fault']}: no record of its fault landing anywhere")
        problems += [f"{row['fault']}: {c}={row[c]}" for c in matrix.COLUMNS if row[c]]
        if row["lost_progress_steps"] > matrix.LOST_PROGRESS_BOUND:
            problems.append(f"{row['fault']}: a failure cost {row['lost_progress_steps']} steps, more "
                            f"than one checkpoint interval ({matrix.LOST_PROGRESS_BOUND})")
    # The failing rows' notes (what each task and job did) in the message itself, and printed last
    # too: on a CI machine the results file is gone once the run ends, and CI keeps only the end of
    # the output (the message comes before the captured output, and the table and the row timings
    # pushed the notes out of a CI log's tail once).
    failing = {p.split(": ", 1)[0] for p in problems}
    notes = [f"{row['fault']}:\n  " + "\n  ".join(row.get("notes", [])) for row in rows if row["fault"] in failing]
    if notes:
        print("\nTHE FAILING ROWS' NOTES\n" + "\n".join(notes))
    assert not problems, (f"{len(problems)} problems (details in {out}):\n" + "\n".join(problems)
                          + "\n\n" + matrix.table(result) + "\n\n" + "\n".join(notes))
