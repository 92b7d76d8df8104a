"""EleutherAI's lm-evaluation-harness on our models and our local suite files, with no hub.

Every model is scored through the harness's own Hugging Face model type (`HFLM`, what
`lm_eval --model hf` runs), given the transformers model the stage saves (our GPT as the GPT-2 it
is exactly, any other model as it is) and its tokenizer. Each suite file (tasks/eval/suites.py
format) becomes a harness task config pointing the `json` dataset builder at the local file, so
the harness reads nothing from the network (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE are set too).
An int8 model (torch's dynamic quantization) is not a transformers model: the harness skips it,
the project's own suite scorer (tasks/eval/suites.py) scores it like every other.

Per item too: the harness's own per-sample scores (its `log_samples`) become per-item results
in the form the gate pairs (tasks.eval.suites.item_results: the items' digest, one character per
item), keyed `harness.<suite>.<metric>`, with the positions in the suite of the items that fit
the context (for the contamination audit's mask, tasks/evaluate.py).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from tasks.eval.suites import item_id, item_results, load_suite

log = logging.getLogger(__name__)

INSTALL_HINT = ("EvalConfig.lm_eval needs EleutherAI's harness: pip install lm_eval==0.4.13 "
                "(pinned in docker/requirements-job.txt), or set lm_eval to false.")


def available() -> bool:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return False
    return True


def task_config(suite_path: str | Path) -> dict[str, Any]:
    """A harness task for one local suite file: multiple choice or generation by its items."""
    suite = load_suite(suite_path)
    base = {"task": f"llmops_{suite.name}", "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(Path(suite_path).resolve())}},
            "test_split": "test", "target_delimiter": "",  # our choices carry their own space
            "metadata": {"version": 1}}
    if suite.choice_items and not suite.generation_items:
        return {**base, "output_type": "multiple_choice", "doc_to_text": "query",
                "doc_to_choice": "choices", "doc_to_target": "gold",
                "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}
    if suite.generation_items and not suite.choice_items:
        return {**base, "output_type": "generate_until", "doc_to_text": "prompt",
                "doc_to_target": "answer",
                "generation_kwargs": {"until": ["\n"], "max_gen_toks": 32, "do_sample": False},
                "metric_list": [{"metric": "exact_match", "regexes_to_ignore": [r"^\s+", r"\s+$"]}]}
    raise ValueError(f"suite {suite_path} mixes multiple-choice and generation items; the harness "
                     "needs one kind per task. Split it into two files.")


def fit_to_context(path: str | Path, tokenizer, context: int, out_dir: Path,
                   limit: int | None) -> tuple[Path | None, int]:
    """The suite's first `limit` items whose every choice fits the model's context with a token
    of context before it (the harness refuses a longer continuation; our own scorer keeps its
    end), written to out_dir under the same name; and how many were left out."""
    import json

    from tasks.train.prepared_data import read_jsonl

    items = read_jsonl(path)[:limit]
    fits = [item for item in items if "choices" not in item or all(
        len(tokenizer.encode(c, add_special_tokens=False)) < context for c in item["choices"])]
    if len(fits) < len(items):
        log.warning("harness: %d of %d items of %s have a choice longer than the model's %d-token "
                    "context; they are left out", len(items) - len(fits), len(items),
                    Path(path).name, context)
    if not fits:
        return None, len(items)
    out = out_dir / Path(path).name
    out.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in fits))
    return out, len(items) - len(fits)


def hf_tokenizer(model_dir: str | Path, eos_id: int):
    """The model directory's tokenizer as transformers loads it (a directory of the format
    before Hugging Face directories has tokenizer.json alone: wrapped with its EOS)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    if (model_dir / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    eos = fast.convert_ids_to_tokens(eos_id)
    fast.eos_token = fast.bos_token = fast.pad_token = eos
    return fast


PAIRED_METRICS = ("acc", "acc_norm", "exact_match")   # right or wrong per item


def run_harness(model, model_dir: str | Path, eos_id: int, suite_paths: list[Path],
                device: torch.device, limit: int | None = None, batch_size: int = 32
                ) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """The harness's scores for each suite, {"harness.<suite>.<metric>": value}, and its
    per-item results of each right-or-wrong metric under the same keys (see the docstring)."""
    if not available():
        raise ImportError(INSTALL_HINT)
    # local files only: never let datasets or the hub client reach for the network
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from tasks.model.causal_lm import to_transformers

    hf = to_transformers(model).to(device).eval()
    tokenizer = hf_tokenizer(model_dir, eos_id)
    lm = HFLM(pretrained=hf, tokenizer=tokenizer, backend="causal", batch_size=batch_size,
              max_length=model.config.block_size)
    scores: dict[str, float] = {}
    fitted: dict[str, tuple[list[dict[str, Any]], list[int]]] = {}   # suite -> (items, positions)
    with tempfile.TemporaryDirectory(prefix="harness-suites-") as scratch:
        configs = []
        for path in suite_paths:
            fitting, left_out = fit_to_context(path, tokenizer, model.config.block_size,
                                               Path(scratch), limit)
            if fitting is not None:
                fitted[Path(path).stem] = _positions(path, fitting, limit)
                config = task_config(fitting)
                # the json builder's cache goes with the scratch files, not ~/.cache/huggingface
                config["dataset_kwargs"]["cache_dir"] = str(Path(scratch) / "datasets")
                if "generation_kwargs" in config:  # an answer must leave room for its prompt
                    config["generation_kwargs"]["max_gen_toks"] = min(
                        32, max(1, model.config.block_size // 4))
                configs.append(config)
            scores[f"harness.{Path(path).stem}.left_out"] = float(left_out)
        # only our task configs: indexing the harness's thousands of built-in tasks takes ~7 s
        results = simple_evaluate(model=lm, tasks=configs, limit=limit, log_samples=True,
                                  bootstrap_iters=0, verbosity="WARNING",
                                  task_manager=TaskManager(include_defaults=False)
                                  ) if configs else {}
    for name, metrics in (results or {}).get("results", {}).items():
        suite = name.removeprefix("llmops_")
        for key, value in metrics.items():
            metric = key.split(",")[0]  # "acc,none" -> "acc"
            if (isinstance(value, (int, float)) and not metric.endswith("_stderr")
                    and metric not in ("alias", "sample_len")):
                scores[f"harness.{suite}.{metric}"] = float(value)
    per_item: dict[str, dict[str, Any]] = {}
    for name, samples in (results or {}).get("samples", {}).items():
        suite = name.removeprefix("llmops_")
        items, positions = fitted[suite]
        samples = sorted(samples, key=lambda x: int(x["doc_id"]))
        if [int(x["doc_id"]) for x in samples] != list(range(len(items))):
            log.warning("harness: %s's samples are not one per item; no per-item results", suite)
            continue
        ids = [item_id(json.dumps(item, sort_keys=True, ensure_ascii=False)) for item in items]
        for metric in PAIRED_METRICS:
            if all(isinstance(x.get(metric), (int, float)) for x in samples):
                per_item[f"harness.{suite}.{metric}"] = {
                    **item_results(ids, [float(x[metric]) == 1.0 for x in samples]), "positions": positions}
    log.info("lm-evaluation-harness: %s", scores)
    return scores, per_item


def _positions(path: str | Path, fitting: Path, limit: int | None) -> tuple[list[dict[str, Any]], list[int]]:
    """The items of the fitted file, and their positions in the suite (fit_to_context keeps the
    order and drops some)."""
    from tasks.train.prepared_data import read_jsonl

    items, kept = read_jsonl(path)[:limit], read_jsonl(fitting)
    positions, at = [], 0
    for item in kept:
        while items[at] != item:
            at += 1
        positions.append(at)
        at += 1
    return kept, positions
