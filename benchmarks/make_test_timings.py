"""How long the quick start's two commands take: the figures the README quotes.

    python benchmarks/make_test_timings.py [--target test|demo] [--out FILE]

`--target test` (the default): runs `make test` in this checkout (run it on a clean clone, as CI
does: `.ci/run` is exactly `make test`), its output streamed to the terminal and kept; then reads
each pytest run's summary line (the suite on two xdist workers, `make test-slow`, `make
test-matrix`, each told apart by the command make echoed before it) and writes their counts and
seconds to benchmarks/results/make_test.json. `--target demo`: runs `make demo` (the whole lifecycle DAG
under `airflow standalone`) and writes benchmarks/results/make_demo.json. Either file has the
command's wall time, whether its set-up (the venv's installs) was already done, and the
machine, commit and load at the start and the end; it is written only when the command passed:
a failed run's time says nothing about how long it takes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.pretrain_common import CODE, git_commit  # noqa: E402
from tasks.common.io import write_json  # noqa: E402

# what `make test` runs beside the benchmarked code (a clone's untracked .venv link is not it)
TESTED = (*CODE, "dags", "tests", "scripts", "Makefile", "requirements.txt",
          "requirements-dev.txt")
PARTS = ("suite", "test_slow", "test_matrix")   # the pytest runs `make test` makes
# "==== 1107 passed, 1 skipped in 1455.12s (0:24:15) ====" (pytest's last line; bare with -q)
SUMMARY = re.compile(r"^(=+ )?(?P<counts>\d+ [^=]*?) in (?P<seconds>[\d.]+)s\b[^=]*( =+)?$")
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)")


def summaries(output: str) -> list[dict[str, Any]]:
    """Each pytest run's summary: {"seconds": s, "passed": n, ...}, in the order they printed."""
    return [summary for _, summary in labelled(output)]


def part_of(command: str) -> str:
    """Which part of `make test` a pytest command line (as make echoes it) is."""
    if re.search(r"-m pytest tests/test_fault_matrix\.py", command):   # the suite --ignores it
        return "test_matrix"
    return "test_slow" if "LLMOPS_SLOW_TESTS" in command else "suite"


def labelled(output: str) -> list[tuple[str, dict[str, Any]]]:
    """(part, summary) for each pytest run: the part from the last pytest command make echoed
    before the summary, so the parts read right in whatever order the Makefile runs them."""
    found, command = [], ""
    for line in output.splitlines():
        if " -m pytest " in line:
            command = line
        m = SUMMARY.match(line.strip())
        if m and COUNT.search(m["counts"]):
            found.append((part_of(command), {
                "seconds": float(m["seconds"]),
                **{kind.rstrip("s") if kind.startswith(("error", "warning")) else kind: int(n)
                   for n, kind in COUNT.findall(m["counts"])}}))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", choices=("test", "demo"), default="test")
    ap.add_argument("--out", type=Path, help="default: benchmarks/results/make_<target>.json")
    args = ap.parse_args(argv)
    out = args.out or ROOT / "benchmarks" / "results" / f"make_{args.target}.json"
    start = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "load_avg_1_5_15_at_start": [round(x, 2) for x in os.getloadavg()],
             "git_commit": git_commit(TESTED),
             # the Makefile's marker of a finished install: without it the time includes the installs
             "installed_before": (ROOT / ".venv" / ".installed").exists()}
    t0 = time.time()
    lines: list[str] = []
    # A recorded run of `make test` also records its fault matrix (plain `make test` writes it to
    # a temp dir); a failed matrix is written too, but then this file is not.
    env = {**os.environ, "FAULT_MATRIX_OUT": str(ROOT / "benchmarks" / "results" / "fault_matrix.json")}
    with subprocess.Popen(["make", "--no-print-directory", args.target], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
    wall = time.time() - t0
    if proc.returncode != 0:
        print(f"make {args.target} failed (exit {proc.returncode}): nothing written", file=sys.stderr)
        return proc.returncode
    result: dict[str, Any] = {f"make_{args.target}_wall_s": round(wall, 1)}
    if args.target == "test":
        runs = dict(labelled("".join(lines)))
        if sorted(runs) != sorted(PARTS):
            print(f"expected the pytest summaries of {PARTS}, found {sorted(runs)}: nothing written",
                  file=sys.stderr)
            return 1
        result["parts"] = {part: runs[part] for part in PARTS}
    else:   # the demo's own last words: its stages' key figures and the registered model
        result["last_lines"] = [line.rstrip() for line in lines[-15:]]
    result["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(),
                         "python": platform.python_version(), **start,
                         "load_avg_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
                         "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json(out, result)   # atomically: a file is there whole or not at all
    print(json.dumps(result.get("parts") or result[f"make_{args.target}_wall_s"]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
