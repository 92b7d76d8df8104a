"""The evaluation report: one table (a row per model, a column per metric) and two plots, written
beside report.json and logged to the evaluation's MLflow run (table as an MLflow table, so the UI
can compare runs; markdown for people; PNGs for a glance)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLUMNS = ("params", "perplexity", "bits_per_byte", "task_accuracy")


def table(models: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Header and rows: model, the headline metrics, then every suite and harness score."""
    extra = sorted({k for m in models.values() for k in m["metrics"]
                    if k not in COLUMNS and not k.endswith((".items", ".sample_len"))})
    header = ["model", *COLUMNS, *extra]
    rows = [[name, *(m["metrics"].get(c) for c in (*COLUMNS, *extra))] for name, m in models.items()]
    return header, rows


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def markdown(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def plot_headline(models: dict[str, dict[str, Any]]):
    """Task accuracy and perplexity side by side, with parameter counts in the labels."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a worker
    import matplotlib.pyplot as plt

    names = list(models)
    get = lambda n, k: models[n]["metrics"][k]  # noqa: E731
    labels = [f"{n}\n{get(n, 'params') / 1e6:.2f}M params" for n in names]
    fig, (acc_ax, ppl_ax) = plt.subplots(1, 2, figsize=(4 + 1.5 * len(names), 3.5))
    acc_ax.bar(labels, [get(n, "task_accuracy") for n in names], color="tab:green")
    acc_ax.set_ylim(0, 1)
    acc_ax.set_title("task exact match")
    ppl_ax.bar(labels, [get(n, "perplexity") for n in names], color="tab:blue")
    # log scale: a model tuned on one narrow task can be orders of magnitude off on prose
    ppl_ax.set_yscale("log")
    ppl_ax.set_title("held-out perplexity (log)")
    for ax, key, fmt in ((acc_ax, "task_accuracy", "{:.2f}"), (ppl_ax, "perplexity", "{:.3g}")):
        for i, n in enumerate(names):
            ax.annotate(fmt.format(get(n, key)), (i, get(n, key)), ha="center", va="bottom")
    fig.tight_layout()
    return fig


def plot_suites(models: dict[str, dict[str, Any]]):
    """Grouped bars: each suite's accuracy per model (None when there are no suites)."""
    keys = sorted({k for m in models.values() for k in m["metrics"]
                   if k.endswith(".accuracy") and (k.startswith("suite.") or k.startswith("harness."))}
                  | {k for m in models.values() for k in m["metrics"]
                     if k.startswith("harness.") and k.endswith(".acc")})
    if not keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(models)
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(3 + 1.2 * len(keys), 3.5))
    for j, name in enumerate(names):
        ax.bar([i + j * width for i in range(len(keys))],
               [models[name]["metrics"].get(k, 0.0) for k in keys], width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
    ax.set_xticklabels([k.rsplit(".", 1)[0] for k in keys], rotation=20, ha="right")
    ax.set_ylim(0, 1)
    ax.set_title("suite accuracy")
    ax.legend()
    fig.tight_layout()
    return fig


def log_report(models: dict[str, dict[str, Any]], output_dir: str | Path) -> Path:
    """Write report.md and log the table and plots to the active MLflow run."""
    import mlflow

    from tasks.common.job_tracking import log_figure

    header, rows = table(models)
    path = Path(output_dir) / "report.md"
    path.write_text(markdown(header, rows))
    mlflow.log_artifact(str(path))
    mlflow.log_table({h: [row[i] for row in rows] for i, h in enumerate(header)},
                     artifact_file="eval_table.json")
    log_figure(plot_headline(models), "eval_report.png")
    suites = plot_suites(models)
    if suites is not None:
        log_figure(suites, "eval_suites.png")
    return path
