"""Goodput: the share of a job's wall time spent on training steps that count toward the model.

As ml-goodput-measurement defines it: productive time is the time of the steps whose progress
survived; everything else is badput, split into buckets. Computed from rank 0's step timestamps
and the job's events (tasks/train/telemetry.py), over the whole job: from the first job_start
to the end of training (`until`: the job passes the moment its final checkpoint was committed,
which is what a fault can delay), across in-job restarts and across Airflow retries (the time
between a failed try and the next is recovery too). What follows training (the loss-curve plot,
this report, the model export) is the same with or without faults and is not counted.

    productive          compute of steps that survived (forward, backward, optimizer)
    data_loading        waiting for the batch of a step that survived
    checkpoint_save     training blocked by a checkpoint (waiting for the previous save, the CPU
                        snapshot, the final flush)
    checkpoint_restore  loading the checkpoint a start, restart or rollback resumes from
    wasted_progress     steps computed and then lost to a rollback or restart (and the part of a
                        step a failure cut short)
    hang_detection      a hung worker's time between its last progress and the watchdog's kill
                        (the configured wait; reported so it can be excluded)
    recovery            from a failure (or the rollback decision) to the restore: restart or
                        hot-spare promotion, imports, rendezvous, an Airflow retry's delay
    startup             job start to the first restore: process start, imports, data, model
    evaluation          validation evals
    other               the rest: logging, Python overhead between steps

Per fault (from fault injection), recovery_s is the time from the fault (for a hang: the kill)
until training resumed (the checkpoint loaded); lost_s is the time spent recomputing the steps
between that checkpoint and the fault.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tasks.train.telemetry import read_events, read_steps

BUCKETS = ("productive", "data_loading", "checkpoint_save", "checkpoint_restore",
           "wasted_progress", "hang_detection", "recovery", "startup", "evaluation", "other")
FAILURES = ("worker_exit", "hang", "peer_failure", "anomaly")


def compute(run_dir: str | Path, until: float | None = None) -> dict[str, Any]:
    """Goodput and badput buckets (seconds) of the job recorded in run_dir, up to `until`."""
    events = read_events(run_dir)
    steps = sorted(read_steps(run_dir), key=lambda s: s["t1"])
    until = until or time.time()
    starts = [e["t"] for e in events if e["kind"] == "job_start"]
    if not starts:
        return {"goodput": 0.0, "wall_s": 0.0, "buckets": {b: 0.0 for b in BUCKETS}, "faults": []}
    t_start = min(starts)
    wall = until - t_start
    mine = [e for e in events if e.get("rank", 0) == 0]
    resumes = sorted((e for e in mine if e["kind"] == "resume"), key=lambda e: e["t0"])

    # which steps survived: a resume at step s throws away every kept step after s
    kept: dict[int, dict[str, Any]] = {}
    wasted: list[dict[str, Any]] = []
    marks = [(r["t0"], r["step"]) for r in resumes]
    i = 0
    for s in steps:
        while i < len(marks) and marks[i][0] <= s["t0"]:
            _discard_after(kept, wasted, marks[i][1])
            i += 1
        if s["s"] in kept:  # replayed without a resume record (should not happen): keep newest
            wasted.append(kept[s["s"]])
        kept[s["s"]] = s
    while i < len(marks):
        _discard_after(kept, wasted, marks[i][1])
        i += 1

    intervals: list[tuple[float, float, str]] = []
    for s in kept.values():
        intervals += [(s["t0"], s["td"], "data_loading"), (s["td"], s["t1"], "productive")]
    intervals += [(s["t0"], s["t1"], "wasted_progress") for s in wasted]
    for e in mine:
        kind = e["kind"]
        if kind == "save":
            intervals.append((e["t0"], e["t1"], "checkpoint_save"))
        elif kind == "resume":
            intervals.append((e["t0"], e["t1"], "checkpoint_restore"))
        elif kind == "eval":
            intervals.append((e["t0"], e["t1"], "evaluation"))
        elif kind == "anomaly":
            intervals.append((e["t0"], e["t"], "wasted_progress"))
    intervals = _clip([iv for iv in intervals if iv[1] > iv[0]], t_start, until)

    failures = sorted((e for e in events if e["kind"] in FAILURES
                       and not (e["kind"] == "worker_exit" and e.get("code") == 0)),
                      key=lambda e: e["t"])
    hangs = [(e["last_progress"], e["t"]) for e in events if e["kind"] == "hang"]
    first_resume = resumes[0]["t0"] if resumes else until
    buckets = {b: 0.0 for b in BUCKETS}
    for a, b, bucket in intervals:
        buckets[bucket] += b - a
    for a, b in _gaps(intervals, t_start, until):
        _classify_gap(a, b, failures, hangs, resumes, first_resume, buckets)

    productive = buckets["productive"]
    hang_wait = buckets["hang_detection"]
    return {
        "goodput": productive / wall if wall > 0 else 0.0,
        "goodput_excluding_hang_wait": productive / (wall - hang_wait) if wall > hang_wait else 0.0,
        "wall_s": wall,
        "buckets": buckets,
        "steps_kept": len(kept),
        "steps_wasted": len(wasted),
        "faults": _faults(events, resumes, steps),
    }


def _discard_after(kept: dict[int, dict], wasted: list[dict], step: int) -> None:
    for s in [s for s in kept if s > step]:
        wasted.append(kept.pop(s))


def _clip(intervals: list[tuple[float, float, str]], lo: float, hi: float
          ) -> list[tuple[float, float, str]]:
    """Sorted and non-overlapping (a later interval starts where an earlier one ends)."""
    out: list[tuple[float, float, str]] = []
    end = lo
    for a, b, bucket in sorted(intervals):
        a, b = max(a, end, lo), min(b, hi)
        if b > a:
            out.append((a, b, bucket))
            end = b
    return out


def _gaps(intervals: list[tuple[float, float, str]], lo: float, hi: float) -> list[tuple[float, float]]:
    gaps, end = [], lo
    for a, b, _ in intervals:
        if a > end:
            gaps.append((end, a))
        end = max(end, b)
    if hi > end:
        gaps.append((end, hi))
    return gaps


def _classify_gap(a: float, b: float, failures: list[dict], hangs: list[tuple[float, float]],
                  resumes: list[dict], first_resume: float, buckets: dict[str, float]) -> None:
    """Time no interval covers. Before the first restore: startup. A gap that holds a failure:
    up to the failure the work was lost (or, inside a hang, waited for); after it, recovery.
    A gap that ends at a later restore without a failure in it (a rollback waiting for the
    checkpoint writer): recovery. Anything else: other."""
    if b <= first_resume:
        buckets["startup"] += b - a
        return
    inside = [f["t"] for f in failures if a <= f["t"] <= b]
    ends_at_resume = any(abs(r["t0"] - b) < 1e-6 for r in resumes)
    if inside:
        t_fail = inside[0]
        hung = sum(max(0.0, min(t_fail, h1) - max(a, h0)) for h0, h1 in hangs)
        buckets["hang_detection"] += hung
        buckets["wasted_progress"] += (t_fail - a) - hung
        buckets["recovery"] += b - t_fail
    elif ends_at_resume:
        buckets["recovery"] += b - a
    else:
        buckets["other"] += b - a


def _faults(events: list[dict], resumes: list[dict], steps: list[dict]) -> list[dict[str, Any]]:
    out = []
    for e in events:
        if e["kind"] != "fault_injected" or e.get("fault_kind") == "corrupt_ckpt":
            continue
        t_fault = e["t"]
        failure = next((f for f in events if f["kind"] in FAILURES and f["t"] >= t_fault
                        and not (f["kind"] == "worker_exit" and f.get("code") == 0)), None)
        if failure is None:
            continue
        # a hang's clock starts at the kill: the wait before it is the configured detection time
        t_from = failure["t"] if failure["kind"] == "hang" else t_fault
        in_place = next((r for r in events if r["kind"] == "rollback" and r.get("in_place")
                         and r["t"] >= failure["t"] - 1e-6), None)
        if failure["kind"] == "anomaly" and in_place is not None:
            # undone in place (the update was never applied): nothing to reload or recompute
            back = next((s for s in steps if s["t0"] >= in_place["t"]), None)
            out.append({"fault": e["fault"], "step": e["step"], "recovered": True,
                        "detected_by": "anomaly", "detect_s": round(failure["t"] - t_fault, 3),
                        "recovery_s": round((back["t0"] if back else in_place["t"]) - t_fault, 3),
                        "resumed_at_step": e["step"] - 1, "lost_s": 0.0, "in_place": True})
            continue
        resume = next((r for r in resumes if r["t0"] >= failure["t"] - 1e-6), None)
        if resume is None:
            out.append({"fault": e["fault"], "step": e["step"], "recovered": False})
            continue
        back = next((s for s in steps if s["t0"] >= resume["t1"] and s["s"] >= e["step"]), None)
        out.append({
            "fault": e["fault"], "step": e["step"], "recovered": True,
            "detected_by": failure["kind"],
            "detect_s": round(failure["t"] - t_fault, 3),
            "recovery_s": round(resume["t1"] - t_from, 3),
            "resumed_at_step": resume["step"],
            "lost_s": round(back["t0"] - resume["t1"], 3) if back else None,
        })
    return out


def chart(report: dict[str, Any], title: str = "where the time went"):
    """A matplotlib figure: the buckets as one stacked bar, with seconds and shares."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = {k: v for k, v in report["buckets"].items() if v > 0}
    wall = report["wall_s"] or 1.0
    colors = {"productive": "#2ca02c", "data_loading": "#98df8a", "checkpoint_save": "#1f77b4",
              "checkpoint_restore": "#aec7e8", "wasted_progress": "#d62728",
              "hang_detection": "#ff9896", "recovery": "#ff7f0e", "startup": "#9467bd",
              "evaluation": "#c5b0d5", "other": "#7f7f7f"}
    fig, (bar, table) = plt.subplots(2, 1, figsize=(8, 5), gridspec_kw={"height_ratios": [1, 2]})
    left = 0.0
    for name, seconds in buckets.items():
        bar.barh(0, seconds, left=left, color=colors.get(name, "#bbbbbb"), label=name)
        left += seconds
    bar.set_xlim(0, wall)
    bar.set_yticks([])
    bar.set_xlabel("seconds of wall time")
    bar.set_title(f"{title}: goodput {report['goodput']:.1%} "
                  f"({report.get('goodput_excluding_hang_wait', 0):.1%} without the hang wait)")
    bar.legend(ncol=5, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    table.axis("off")
    rows = [[name, f"{seconds:.1f}", f"{seconds / wall:.1%}"] for name, seconds in buckets.items()]
    table.table(cellText=rows, colLabels=["bucket", "seconds", "share"], loc="center")
    fig.tight_layout()
    return fig
