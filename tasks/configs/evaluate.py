"""The evaluation stage's config (`python -m tasks.evaluate`): which models are scored, on how
many held-out batches and task examples, and which task suites (local, and through
lm-evaluation-harness)."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.configs.fields import bounded, check, check_bounds


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
    suites: list = bounded([], help="Task suite JSONL files or directories (multiple choice "
                                    "{query, choices, gold}; generation {prompt, answer}).")
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
