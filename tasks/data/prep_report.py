"""Data prep's MLflow report (tasks/data/prep.py is the driver): a finished data set's metrics,
its figure (drop reasons, kept-document lengths, tokens per source), and logging them to the
stage's run.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np


def metrics(manifest: dict) -> dict[str, float]:
    counts, splits = manifest["counts"], manifest["splits"]
    metrics = {
        "documents_in": counts["input_documents"],
        "documents_kept": counts["kept_documents"],
        "documents_dropped": sum(counts["dropped"].values()),
        "train_tokens": splits["train"]["tokens"],
        "val_tokens": splits["val"]["tokens"],
        "train_rows": splits["train"]["rows"],
        "val_rows": splits["val"]["rows"],
        "vocab_size": manifest["vocab_size"],
        "sft_train_examples": manifest["sft"]["train_examples"],
        "sft_eval_examples": manifest["sft"]["eval_examples"],
    }
    for step, stats in manifest.get("steps", {}).items():
        for key, value in stats.items():
            if key.startswith("redacted.") or key in ("exact_duplicates", "near_duplicates", "clusters"):
                metrics[f"{step}.{key}"] = value
    return metrics


def figure(manifest: dict) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reasons_ax, lengths_ax, sources_ax) = plt.subplots(1, 3, figsize=(16, 4.5))
    reasons = manifest["counts"]["dropped"]
    reasons_ax.barh(list(reasons) or ["(none)"], list(reasons.values()) or [0], height=0.6)
    reasons_ax.set_title(f"Dropped documents ({sum(reasons.values())} of "
                         f"{manifest['counts']['input_documents']})")
    reasons_ax.set_xlabel("documents")
    hist = manifest["length_histogram"]
    edges, counts = np.array(hist["bin_edges"]), np.array(hist["counts"])
    lengths_ax.stairs(counts, edges, fill=True)
    lengths_ax.set_xscale("log")
    lengths_ax.set_title(f"Kept document length ({int(counts.sum())} documents)")
    lengths_ax.set_xlabel("characters")
    names = [os.path.basename(s["input"].rstrip("/")) or s["input"] for s in manifest["sources"]]
    sources_ax.barh(names, [s["train_tokens"] for s in manifest["sources"]], height=0.6, label="train")
    sources_ax.barh(names, [s["val_tokens"] for s in manifest["sources"]], height=0.6,
                    left=[s["train_tokens"] for s in manifest["sources"]], label="val")
    sources_ax.set_title("Tokens per source (after mix weights)")
    sources_ax.set_xlabel("tokens")
    sources_ax.legend()
    fig.tight_layout()
    return fig


def log_run(prepared: Any, started: float) -> dict[str, float]:
    """Log a prepare() result (prep.Prepared) to the active MLflow run, `started` being the
    time.time() the stage began: the metrics (returned), seconds per phase, drop reasons, the data
    hash and engine tags, the manifest, and the figure when this run made the data set."""
    import mlflow

    from tasks.common.job_tracking import log_figure, log_json_artifact

    manifest = prepared.manifest
    logged = metrics(manifest)
    mlflow.log_metrics({**logged, "seconds": time.time() - started,
                        **{f"seconds/{k}": v for k, v in prepared.seconds.items()},
                        **{f"dropped/{r}": n for r, n in manifest["counts"]["dropped"].items()}})
    mlflow.set_tag("data_hash", manifest["content_hash"])
    if prepared.engine:  # what ran this data set's work, and why (choose_engine)
        mlflow.set_tags({"data_prep.engine": prepared.engine,
                         "data_prep.engine_reason": prepared.engine_reason[:5000]})
    log_json_artifact(manifest, "manifest.json")
    if not prepared.reused:
        log_figure(figure(manifest), "data_prep.png")
    return logged
