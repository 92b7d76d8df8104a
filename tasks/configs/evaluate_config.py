"""The evaluation stage's config (`python -m tasks.evaluate`): which models are scored, on how
many held-out batches and task examples, and which task suites (local, and through
lm-evaluation-harness)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tasks.configs.fields import ConfigError, bounded, check, check_bounds

SUITE_FORMATS = ("multiple choice {\"query\": str, \"choices\": [str, str, ...], \"gold\": int}, "
                 "or generation {\"prompt\": str, \"answer\": str}; either may add a "
                 "\"passage\" shared by items about one text")


def suite_item_kind(item: Any, where: str) -> str:
    """"choice" or "generation" for a valid suite item; a ConfigError naming the line otherwise.
    The one check of the suite format: the job's loader (tasks/eval/suites.py) and start_run's
    check of the Param eval_suites (before any job) both call it."""
    if isinstance(item, dict) and "choices" in item:
        choices = item["choices"]
        if (isinstance(item.get("query"), str) and isinstance(choices, list) and len(choices) >= 2
                and all(isinstance(c, str) and c for c in choices)
                and isinstance(item.get("gold"), int) and not isinstance(item["gold"], bool)
                and 0 <= item["gold"] < len(choices)):
            return "choice"
        raise ConfigError(f"{where}: a multiple-choice item needs a string 'query', two or more "
                          "non-empty string 'choices' and an int 'gold' indexing them.")
    if isinstance(item, dict) and isinstance(item.get("prompt"), str) and isinstance(item.get("answer"), str):
        return "generation"
    keys = sorted(item) if isinstance(item, dict) else type(item).__name__
    raise ConfigError(f"{where}: expected {SUITE_FORMATS}; got {keys}.")


def check_suite_text(text: str, where: str) -> int:
    """Every line of a suite file's text is a valid item (blank lines aside); its item count."""
    count = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{where}:{number}: not JSON ({exc}).") from None
        suite_item_kind(item, f"{where}:{number}")
        count += 1
    if not count:
        raise ConfigError(f"{where}: the suite holds no items.")
    return count


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out perplexity and bits per byte, task exact-match and local task suites (through
    lm-evaluation-harness too, unless lm_eval is off) for each named model."""

    models: dict = bounded({}, help="Name -> Hugging Face model directory, s3:// prefix, "
                                    "checkpoint or MLflow model URI, e.g. {'teacher': ..., "
                                    "'champion': 'models:/llm-lifecycle/3'}.")
    data_dir: str = ""
    output_dir: str = ""
    eval_batches: int = bounded(20, minimum=1, maximum=1_000_000, help="Val batches for perplexity.")
    batch_size: int = bounded(16, minimum=1, maximum=1 << 16)
    max_task_examples: int = bounded(200, minimum=1, maximum=1_000_000,
                                     help="Held-out task examples scored by exact match.")
    max_new_tokens: int = bounded(16, minimum=1, maximum=4096)
    suites: list = bounded([], help="Task suites: JSONL files, directories of them, or s3:// "
                                    "URIs of either (one suite per file, named by its stem), "
                                    "each line multiple choice {query, choices, gold} or "
                                    "generation {prompt, answer}, with an optional passage.")
    demo_suites: bool = bounded(True, help="Also build suites from the data dir's held-out "
                                           "material: SFT multiple choice and a prose cloze.")
    suite_examples: int = bounded(100, minimum=1, maximum=1_000_000, help="Items per suite.")
    lm_eval: bool = bounded(True, help="Also run the suites through EleutherAI's "
                                       "lm-evaluation-harness (its Hugging Face model type, on the "
                                       "local suite files).")

    def __post_init__(self) -> None:
        check_bounds(self)
        check(bool(self.models), "EvalConfig.models must name at least one model directory.")
        check(bool(self.data_dir) and bool(self.output_dir),
               "EvalConfig.data_dir and EvalConfig.output_dir are required.")
