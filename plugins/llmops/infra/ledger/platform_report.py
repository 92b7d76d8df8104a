"""The platform report: the job ledger of a period as tables and plots in one MLflow run.

Run daily by the `llm_platform_report` DAG, into the experiment `llmops-platform` (run name
`platform-report <start>..<end>`, tags kind=platform_report, period_start, period_end):

    tables/usage_by_team_stage.csv   accelerator-hours, instance-hours, estimated cost and attempts
                                     per team and stage (ended attempts)
    tables/failures_by_reason.csv    attempts that failed or were stopped, per stage and reason, and
                                     their share of the stage's ended attempts
    tables/badput_by_team_stage.csv  badput hours of jobs that report goodput (pretraining)
    tables/queue_by_backend_stage.csv  queue seconds (submit to start): attempts, mean, p50, max
    tables/attempts.csv              every ended attempt, one row each
    plots/*.png                      one bar chart for each table but the last
    metrics                          platform/accelerator_hours, platform/cost_usd,
                                     platform/attempts, platform/failure_rate, platform/badput_hours

Badput comes from the job's MLflow run when it has the pretraining's resilience/badput_*_s
metrics (tasks/train/goodput.py), else from the ledger's goodput share x the attempt's running
time. matplotlib is imported only when the report is made.
"""

from __future__ import annotations

import csv
import io
import re
import statistics
from collections import defaultdict
from typing import Any, Iterable

from llmops.infra import ledger, tracking

EXPERIMENT = "llmops-platform"
BADPUT_PREFIX = "resilience/badput_"


def attempts(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ended attempts (the last `ended` row of each job name and attempt)."""
    last: dict[tuple[str, int], dict[str, Any]] = {}
    for row in sorted(events, key=lambda r: r["recorded_at"]):
        if row["event"] == "ended":
            last[(row["job_name"], int(row["attempt"]))] = row
    return list(last.values())


def reason_class(row: dict[str, Any]) -> str:
    """The failure reason without the job's own names, so that the same cause groups together."""
    reason = row.get("failure_reason") or row.get("state", "")
    for name in sorted({row.get("service_job_name"), row.get("job_name")} - {None, ""}, key=len,
                       reverse=True):  # the longer first: the service's name holds the spec's
        reason = reason.replace(name, "<job>")
    return re.sub(r"\s+", " ", reason).strip()[:160]


def usage_by_team_stage(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        g = groups.setdefault((r["team"], r["stage"]), {
            "team": r["team"], "stage": r["stage"], "attempts": 0, "instance_hours": 0.0,
            "accelerator_hours": 0.0, "estimated_cost_usd": 0.0, "unpriced_attempts": 0})
        g["attempts"] += 1
        g["instance_hours"] += r["instance_hours"] or 0.0
        g["accelerator_hours"] += r["accelerator_hours"] or 0.0
        if r["estimated_cost_usd"] is None:
            g["unpriced_attempts"] += 1
        else:
            g["estimated_cost_usd"] += r["estimated_cost_usd"]
    return sorted(groups.values(), key=lambda g: (-g["accelerator_hours"], g["team"], g["stage"]))


def failures_by_reason(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    per_stage: dict[str, int] = defaultdict(int)
    counts: dict[tuple[str, str, str], int] = defaultdict(int)
    for r in rows:
        per_stage[r["stage"]] += 1
        if r["state"] != "succeeded":
            counts[(r["stage"], r["state"], reason_class(r))] += 1
    out = [{"stage": stage, "state": state, "reason": reason, "attempts": n,
            "stage_attempts": per_stage[stage], "rate": n / per_stage[stage]}
           for (stage, state, reason), n in counts.items()]
    return sorted(out, key=lambda f: (-f["attempts"], f["stage"], f["reason"]))


def badput_seconds(row: dict[str, Any], client: Any = None) -> float | None:
    """Non-productive seconds of an attempt that reports goodput, or None when it reports none."""
    if row.get("badput_seconds") is not None:
        return float(row["badput_seconds"])
    if client is not None and row.get("mlflow_run_id"):
        try:
            metrics = client.get_run(row["mlflow_run_id"]).data.metrics
        except Exception:  # noqa: BLE001 - a deleted run: fall back to the ledger's share
            metrics = {}
        buckets = [v for k, v in metrics.items() if k.startswith(BADPUT_PREFIX) and k.endswith("_s")]
        if buckets:
            return float(sum(buckets))
    if row.get("goodput") is not None and row.get("started_at") and row.get("ended_at"):
        return (1.0 - float(row["goodput"])) * max(0.0, row["ended_at"] - row["started_at"])
    return None


def badput_by_team_stage(rows: list[dict[str, Any]], client: Any = None) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        seconds = badput_seconds(r, client)
        if seconds is None:
            continue
        g = groups.setdefault((r["team"], r["stage"]), {"team": r["team"], "stage": r["stage"],
                                                        "attempts": 0, "badput_hours": 0.0,
                                                        "badput_accelerator_hours": 0.0})
        g["attempts"] += 1
        g["badput_hours"] += seconds / 3600
        g["badput_accelerator_hours"] += seconds / 3600 * r["instance_count"] * (
            r["accelerators_per_instance"] or 0)
    return sorted(groups.values(), key=lambda g: (-g["badput_hours"], g["team"], g["stage"]))


def queue_by_backend_stage(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        if r["queue_seconds"] is not None:
            groups[(r["backend"], r["stage"])].append(float(r["queue_seconds"]))
    return [{"backend": b, "stage": s, "attempts": len(v), "mean_s": statistics.fmean(v),
             "p50_s": statistics.median(v), "max_s": max(v)}
            for (b, s), v in sorted(groups.items())]


def build(events: Iterable[dict[str, Any]], client: Any = None) -> dict[str, list[dict[str, Any]]]:
    """Every table of the report, from ledger rows (llmops.infra.ledger.read_events)."""
    rows = attempts(events)
    return {"usage_by_team_stage": usage_by_team_stage(rows),
            "failures_by_reason": failures_by_reason(rows),
            "badput_by_team_stage": badput_by_team_stage(rows, client),
            "queue_by_backend_stage": queue_by_backend_stage(rows),
            "attempts": sorted(rows, key=lambda r: r["recorded_at"])}


def to_csv(table: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    if table:
        writer = csv.DictWriter(out, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    return out.getvalue()


PLOTS = {  # table -> (file, title, label columns, value columns)
    "usage_by_team_stage": ("accelerator_hours_and_cost.png", "Accelerator-hours and estimated cost",
                            ("team", "stage"), ("accelerator_hours", "estimated_cost_usd")),
    "failures_by_reason": ("failure_rate_by_reason.png", "Failed or stopped share of attempts",
                           ("stage", "reason"), ("rate",)),
    "badput_by_team_stage": ("badput_hours.png", "Badput hours (jobs reporting goodput)",
                             ("team", "stage"), ("badput_hours",)),
    "queue_by_backend_stage": ("queue_seconds.png", "Queue time, submit to start (s)",
                               ("backend", "stage"), ("mean_s", "max_s")),
}


def bar_chart(table: list[dict[str, Any]], title: str, labels: tuple[str, ...],
              values: tuple[str, ...]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(values), 1, figsize=(9, 2.2 + 2.2 * len(values)), squeeze=False)
    names = [" / ".join(str(row[c])[:40] for c in labels) for row in table] or ["(none)"]
    for ax, column in zip(axes[:, 0], values):
        ax.barh(names, [row[column] or 0 for row in table] or [0])
        ax.set_xlabel(column)
        ax.invert_yaxis()
    axes[0, 0].set_title(title)
    fig.tight_layout()
    return fig


def log_report(events: Iterable[dict[str, Any]], *, period_start: str, period_end: str,
               client: Any = None) -> dict[str, Any]:
    """Build the tables, log them with their plots to a new run in `llmops-platform`; return
    {"run_id", "tables", "metrics"}."""
    import matplotlib.pyplot as plt

    client = client or tracking.client()
    tables = build(events, client)
    rows = tables["attempts"]
    failed = sum(r["state"] != "succeeded" for r in rows)
    metrics = {"platform/attempts": float(len(rows)),
               "platform/accelerator_hours": sum(r["accelerator_hours"] or 0.0 for r in rows),
               "platform/instance_hours": sum(r["instance_hours"] or 0.0 for r in rows),
               "platform/cost_usd": sum(r["estimated_cost_usd"] or 0.0 for r in rows),
               "platform/failure_rate": failed / len(rows) if rows else 0.0,
               "platform/badput_hours": sum(g["badput_hours"] for g in tables["badput_by_team_stage"])}
    run = client.create_run(tracking.ensure_experiment(EXPERIMENT),
                            run_name=f"platform-report {period_start}..{period_end}",
                            tags={"kind": "platform_report", "period_start": period_start,
                                  "period_end": period_end})
    run_id = run.info.run_id
    try:
        for key, value in metrics.items():
            client.log_metric(run_id, key, value)
        for name, table in tables.items():
            client.log_text(run_id, to_csv(table), f"tables/{name}.csv")
        for name, (file, title, labels, values) in PLOTS.items():
            fig = bar_chart(tables[name], title, labels, values)
            client.log_figure(run_id, fig, f"plots/{file}")
            plt.close(fig)
    except Exception:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
    return {"run_id": run_id, "tables": tables, "metrics": metrics}


def daily(period_start: Any, period_end: Any, source: str = "") -> dict[str, Any]:
    """The DAG's task: the ledger's events of [period_start, period_end) into one report run."""
    events = ledger.read_events(period_start, period_end, source=source)
    result = log_report(events, period_start=str(period_start), period_end=str(period_end))
    return {"run_id": result["run_id"], "metrics": result["metrics"], "events": len(events)}
