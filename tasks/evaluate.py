"""Evaluation: the numbers that decide what ships, for each named model.

    python -m tasks.evaluate --config CONFIG.json --result RESULT.json   (an EvalConfig)

Per model (a Hugging Face directory of any causal LM, an s3:// prefix holding one, an int8
directory from distill, a checkpoint or an MLflow model URI; each scored with its own tokenizer):
held-out perplexity and bits per byte on the val shards (tasks/eval/language.py), exact-match
accuracy of greedy answers on up to max_task_examples of sft/eval.jsonl (overall and per skill),
every task suite (tasks/eval/suites.py: multiple choice by log-likelihood, generation by exact
match), with whether each item was right (`per_item`, for the gate's paired comparisons), and,
with lm_eval (the default), the same suites through lm-evaluation-harness's own Hugging Face
model type (tasks/eval/harness.py).
Every item is first looked up in the training data's N-word runs (tasks/data/contamination.py):
items seen there are marked in `per_item` (`seen`) and listed in output_dir/contamination.json.
Writes output_dir/report.json and report.md; logs "<name>.<metric>" metrics, the table as an
MLflow table, and plots.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tasks.common.entry import run_stage
from tasks.common.job_tracking import stage_run
from tasks.configs import EvalConfig

log = logging.getLogger("tasks.evaluate")

LINEAGE_KEYS = ("stage", "step", "source_checkpoint", "data_content_hash", "sft_sha256",
                "parent_run_id", "parent_model_uri", "parent_registered_version",
                "registered_model", "registered_version", "content_sha256")


# The held-out text scored document by document: the gate's primary paired metric (thousands of
# tokens in whole documents even on the tiny recipe, where a task suite has 20 items).
HELD_OUT = "heldout.bits_per_byte"


def held_out_documents(documents: dict[str, Any]) -> dict[str, Any]:
    """language_scores' documents as a per_item entry: each whole held-out document's name, bits
    and scored bytes (its bits per byte is bits / bytes)."""
    return {"kind": "continuous", "n": len(documents["keys"]), "keys": documents["keys"],
            "bits": [round(b, 6) for b in documents["bits"]], "bytes": documents["bytes"],
            "tokens": documents["tokens"]}


def item_texts(examples: list, suite=None) -> list[str]:
    """Each item's text as the contamination audit reads it: the question with its gold answer."""
    if suite is None:
        return [f"{ex.prompt} {ex.completion}" for ex in examples]
    return ([f"{i['query']} {i['choices'][i['gold']]}" for i in suite.choice_items]
            + [f"{i['prompt']} {i['answer']}" for i in suite.generation_items])


def evaluate_model(name: str, ref: str, cfg: EvalConfig, suites: list, device,
                   ngrams=None) -> dict[str, Any]:
    import torch

    from tasks.eval.harness import run_harness
    from tasks.eval.language import (document_keys, eos_id_of, held_out_batches,
                                     language_scores, token_byte_lengths)
    from tasks.eval.suites import (item_id, item_results, score_suite_items, suite_item_ids,
                                   suite_passages)
    from tasks.posttrain.sources import resolve_model_dir
    from tasks.train.prepared_data import DataDir, load_sft, load_tokenizer
    from tasks.train.export import load_model
    from tasks.train.scoring import exact_match

    model_dir = resolve_model_dir(ref, Path(cfg.output_dir) / "sources")
    if (model_dir / "model_int8.pt").is_file():  # distill's quantize_int8 output: CPU only
        from tasks.posttrain.quantize import load_int8

        device = torch.device("cpu")
        model, meta = load_int8(model_dir)
    else:
        model, meta = load_model(model_dir, device)
    data = DataDir(cfg.data_dir)
    tokenizer_path = model_dir / "tokenizer.json"
    tokenizer = load_tokenizer(tokenizer_path)
    eos_id = eos_id_of(tokenizer, data, tokenizer_path)

    batches = held_out_batches(data, tokenizer, eos_id, tokenizer_path, model.config.block_size,
                               cfg.batch_size, cfg.eval_batches)
    metrics: dict[str, float] = {"params": model.num_params()}
    language = language_scores(model, batches, token_byte_lengths(tokenizer_path, tokenizer),
                               device, eos_id=eos_id,
                               doc_keys=document_keys(data, cfg.batch_size, cfg.eval_batches))
    metrics.update({k: language[k] for k in ("val_loss", "perplexity", "bits_per_byte")})
    examples = load_sft(data.sft_path("eval"), tokenizer, eos_id, limit=cfg.max_task_examples)
    task = exact_match(model, tokenizer, examples, eos_id, cfg.max_new_tokens, device)
    metrics["task_accuracy"] = task["accuracy"]
    metrics.update({f"task_accuracy.{skill}": acc for skill, acc in task["per_skill"].items()})
    # Per-item results of every item-level metric: the gate compares two models item by item
    # (plugins/llmops/policy/paired.py), which needs both scored on the same items.
    per_item = {HELD_OUT: held_out_documents(language["documents"]),
                "task_accuracy": item_results(
        [item_id(ex.prompt + "\x00" + ex.completion) for ex in examples], task["correct"])}
    texts = {"task_accuracy": item_texts(examples)}
    for suite in suites:
        scores, correct = score_suite_items(model, tokenizer, eos_id, suite, device)
        for key, value in scores.items():
            metrics[f"suite.{suite.name}.{key}"] = value
        per_item[f"suite.{suite.name}.accuracy"] = item_results(
            suite_item_ids(suite), correct,
            suite_passages([*suite.choice_items, *suite.generation_items]))
        texts[f"suite.{suite.name}.accuracy"] = item_texts([], suite)
    contamination = {}
    if ngrams is not None:   # which items the training data holds: the gate leaves them out
        from tasks.data.contamination import audit, seen_mask

        for metric, items in texts.items():
            contamination[metric] = audit(ngrams, items)
            per_item[metric]["seen"] = seen_mask(contamination[metric])
    if cfg.lm_eval and suites and not (model_dir / "model_int8.pt").is_file():
        harness_scores, harness_items = run_harness(model, model_dir, eos_id, [s.path for s in suites],
                                                    device, limit=cfg.suite_examples,
                                                    batch_size=cfg.batch_size)
        metrics.update(harness_scores)
        for metric, result in harness_items.items():
            # the items that fit the context are a subset of the suite's: its audit's mask, cut
            positions = result.pop("positions")
            suite_metric = f"suite.{metric[len('harness.'):].rsplit('.', 1)[0]}.accuracy"
            mask = (per_item.get(suite_metric) or {}).get("seen")
            if mask:
                result["seen"] = "".join(mask[i] for i in positions)
            clusters = (per_item.get(suite_metric) or {}).get("clusters")
            if clusters:   # the passages of the items that fit, as the suite's own result has them
                result["clusters"] = [clusters[i] for i in positions]
            per_item[metric] = result
    log.info("%s: perplexity %.2f, %.3f bits/byte, task accuracy %.3f (%d examples), %d "
             "parameters%s", name, metrics["perplexity"], metrics["bits_per_byte"],
             task["accuracy"], task["n"], model.num_params(),
             "".join(f", {s.name} {metrics[f'suite.{s.name}.accuracy']:.3f}" for s in suites))
    return {
        "model_ref": str(ref),
        "model_dir": str(model_dir),
        "model_uri": meta.get("model_uri"),
        "stage": meta.get("stage"),
        "mlflow_run_id": meta.get("run_id"),
        "lineage": {k: meta[k] for k in LINEAGE_KEYS if meta.get(k) not in (None, "")},
        "params": model.num_params(),
        "val_loss": metrics["val_loss"],
        "perplexity": metrics["perplexity"],
        "task_accuracy": task["accuracy"],
        "task_examples": task["n"],
        "per_skill": task["per_skill"],
        "samples": task["samples"],
        "metrics": metrics,
        "per_item": per_item,
        "contamination": contamination,
    }


def contamination_summary(models: dict[str, Any]) -> dict[str, Any]:
    """One audit per metric: the items are the same for every model scored on the same data and
    tokenizer; where a model's tokenizer kept other SFT examples, the larger count is kept."""
    out: dict[str, Any] = {}
    for model in models.values():
        for metric, found in (model.get("contamination") or {}).items():
            if metric not in out or found["contaminated"] > out[metric]["contaminated"]:
                out[metric] = found
    return out


def load_suites(cfg: EvalConfig) -> list:
    from tasks.eval.suites import load_suite, suite_files, write_demo_suites

    paths = suite_files(cfg.suites, cfg.output_dir)
    if cfg.demo_suites:
        paths += write_demo_suites(cfg.data_dir, Path(cfg.output_dir) / "suites",
                                   cfg.suite_examples)
    return [load_suite(p, limit=cfg.suite_examples) for p in paths]


def main(cfg: EvalConfig) -> dict[str, Any]:
    import mlflow

    from tasks.common.io import write_json
    from tasks.eval.harness import INSTALL_HINT, available
    from tasks.eval.eval_report import log_report
    from tasks.train.runtime import pick_device

    if cfg.lm_eval and not available():
        raise ImportError(INSTALL_HINT)  # before any model is scored
    with stage_run("evaluate", cfg) as run:
        device = pick_device()
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        suites = load_suites(cfg)
        from tasks.train.telemetry import Progress

        from tasks.data.contamination import open_index

        ngrams = open_index(cfg.data_dir, Path(cfg.output_dir) / "contamination")
        progress, models = Progress(len(cfg.models)), {}
        for i, (name, ref) in enumerate(cfg.models.items(), 1):
            models[name] = evaluate_model(name, str(ref), cfg, suites, device, ngrams)
            log.info("evaluated model %d/%d (%s) | %s", i, len(cfg.models), name, progress.line(i))
        metrics = {f"{name}.{key}": value for name, m in models.items()
                   for key, value in m["metrics"].items()}
        # "<model>/<metric>" in MLflow: one chart section per model; the result keeps the dots
        mlflow.log_metrics({k.replace(".", "/", 1): v for k, v in metrics.items()})
        report_path = write_json(Path(cfg.output_dir) / "report.json",
                                 {"models": models, "metrics": metrics,
                                  "suites": {s.name: str(s.path) for s in suites},
                                  "data_dir": cfg.data_dir, "mlflow_run_id": run.info.run_id})
        mlflow.log_artifact(str(report_path))
        audit = contamination_summary(models)
        audit_path = write_json(Path(cfg.output_dir) / "contamination.json", audit)
        mlflow.log_artifact(str(audit_path))
        for metric, found in audit.items():
            log.info("contamination audit, %s: %d of %d items seen in training data (%d too short "
                     "to check)", metric, found["contaminated"], found["items"], found["too_short"])
        for suite in suites:
            mlflow.log_artifact(str(suite.path), artifact_path="suites")
        markdown = log_report(models, cfg.output_dir)
        return {
            "metrics": metrics,
            "models": {name: {k: m[k] for k in ("model_ref", "model_dir", "model_uri", "params",
                                                "mlflow_run_id", "stage", "lineage", "per_item")}
                       for name, m in models.items()},
            "contamination": {m: {k: v for k, v in a.items() if k != "seen"} for m, a in audit.items()},
            "outputs": {"report": str(report_path), "report_md": str(markdown),
                        "contamination": str(audit_path)},
            "mlflow_run_id": run.info.run_id,
        }


if __name__ == "__main__":
    run_stage("evaluate", EvalConfig, main)
