"""Evaluation: the numbers that decide what ships, for each named model directory.

    python -m tasks.evaluate --config CONFIG.json --result RESULT.json   (an EvalConfig)

Per model: held-out perplexity on the val shards, and exact-match accuracy of greedy answers on
up to max_task_examples of sft/eval.jsonl (overall and per skill). Writes output_dir/report.json,
logs "<name>.perplexity", "<name>.task_accuracy", "<name>.params" and a comparison plot.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from tasks.common.entry import run_stage
from tasks.common.tracking import log_figure, stage_run
from tasks.configs import EvalConfig

log = logging.getLogger("tasks.evaluate")


def evaluate_model(name: str, model_dir: str, cfg: EvalConfig, device) -> dict[str, Any]:
    from tasks.train.data import DataDir, load_sft, model_tokenizer
    from tasks.train.export import load_model
    from tasks.train.scoring import exact_match, shard_loss

    model, meta = load_model(model_dir, device)
    data = DataDir(cfg.data_dir)
    tokenizer = model_tokenizer(data, model_dir)
    examples = load_sft(data.sft_path("eval"), tokenizer, data.eos_id, limit=cfg.max_task_examples)
    val_loss = shard_loss(model, data.split("val"), cfg.batch_size, cfg.eval_batches, device)
    task = exact_match(model, tokenizer, examples, data.eos_id, cfg.max_new_tokens, device)
    log.info("%s: perplexity %.2f, task accuracy %.3f (%d examples), %d parameters", name,
             math.exp(val_loss), task["accuracy"], task["n"], model.num_params())
    return {
        "model_dir": str(model_dir),
        "model_uri": meta.get("model_uri"),
        "stage": meta.get("stage"),
        "mlflow_run_id": meta.get("run_id"),
        "params": model.num_params(),
        "val_loss": val_loss,
        "perplexity": math.exp(val_loss),
        "task_accuracy": task["accuracy"],
        "task_examples": task["n"],
        "per_skill": task["per_skill"],
        "samples": task["samples"],
    }


def plot_report(models: dict[str, dict[str, Any]]):
    """Accuracy and perplexity side by side, with parameter counts in the labels."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a worker
    import matplotlib.pyplot as plt

    names = list(models)
    labels = [f"{n}\n{models[n]['params'] / 1e6:.2f}M params" for n in names]
    fig, (acc_ax, ppl_ax) = plt.subplots(1, 2, figsize=(4 + 1.5 * len(names), 3.5))
    acc_ax.bar(labels, [models[n]["task_accuracy"] for n in names], color="tab:green")
    acc_ax.set_ylim(0, 1)
    acc_ax.set_title("task exact match")
    ppl_ax.bar(labels, [models[n]["perplexity"] for n in names], color="tab:blue")
    # log scale: a model tuned on one narrow task can be orders of magnitude off on prose
    ppl_ax.set_yscale("log")
    ppl_ax.set_title("held-out perplexity (log)")
    for ax, key, fmt in ((acc_ax, "task_accuracy", "{:.2f}"), (ppl_ax, "perplexity", "{:.3g}")):
        for i, n in enumerate(names):
            ax.annotate(fmt.format(models[n][key]), (i, models[n][key]), ha="center", va="bottom")
    fig.tight_layout()
    return fig


def main(cfg: EvalConfig) -> dict[str, Any]:
    import mlflow

    from tasks.common.io import write_json
    from tasks.train.runtime import pick_device

    with stage_run("evaluate", cfg) as run:
        device = pick_device()
        models = {name: evaluate_model(name, str(model_dir), cfg, device)
                  for name, model_dir in cfg.models.items()}
        metrics: dict[str, float] = {}
        for name, m in models.items():
            metrics[f"{name}.perplexity"] = m["perplexity"]
            metrics[f"{name}.val_loss"] = m["val_loss"]
            metrics[f"{name}.task_accuracy"] = m["task_accuracy"]
            metrics[f"{name}.params"] = m["params"]
            for skill, acc in m["per_skill"].items():
                metrics[f"{name}.task_accuracy.{skill}"] = acc
        mlflow.log_metrics(metrics)
        report_path = write_json(Path(cfg.output_dir) / "report.json",
                                 {"models": models, "metrics": metrics,
                                  "data_dir": cfg.data_dir, "mlflow_run_id": run.info.run_id})
        mlflow.log_artifact(str(report_path))
        log_figure(plot_report(models), "eval_report.png")
        return {
            "metrics": metrics,
            "models": {name: {"model_dir": m["model_dir"], "model_uri": m["model_uri"],
                              "params": m["params"], "mlflow_run_id": m["mlflow_run_id"]}
                       for name, m in models.items()},
            "outputs": {"report": str(report_path)},
            "mlflow_run_id": run.info.run_id,
        }


if __name__ == "__main__":
    run_stage("evaluate", EvalConfig, main)
