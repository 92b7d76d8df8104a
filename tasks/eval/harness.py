"""EleutherAI's lm-evaluation-harness on our models and our local suite files, with no hub.

`HarnessLM` is the custom LM wrapper the harness asks for (loglikelihood, loglikelihood_rolling,
generate_until) around a GPT and its tokenizer. Each suite file (tasks/eval/suites.py format)
becomes a harness task config pointing the `json` dataset builder at the local file, so the
harness reads nothing from the network (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE are set too).

lm_eval is optional (docker/requirements-lm-eval.txt): it pulls datasets, evaluate, nltk and
sacrebleu, which the rest of the stack does not need. Without it, evaluation still scores the
same suites with tasks/eval/suites.py, and `EvalConfig.lm_eval` fails with an install hint.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from tasks.eval.suites import continuation_logprobs, load_suite

log = logging.getLogger(__name__)

INSTALL_HINT = ("EvalConfig.lm_eval needs EleutherAI's harness: "
                "pip install -r docker/requirements-lm-eval.txt (lm_eval==0.4.13).")


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


def _lm_class():
    from lm_eval.api.model import LM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class HarnessLM(LM):
        """A GPT from this repo as an lm-evaluation-harness model (greedy, one device)."""

        def __init__(self, model, tokenizer, eos_id: int, device: torch.device,
                     batch_size: int = 32) -> None:
            super().__init__()
            self.model, self.tokenizer, self.eos_id = model.eval(), tokenizer, eos_id
            self._device, self.batch_size = device, batch_size

        def _encode(self, text: str) -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=False).ids

        def loglikelihood(self, requests) -> list[tuple[float, bool]]:
            # an empty context is conditioned on EOS, the harness's convention
            pairs = [(self._encode(ctx) or [self.eos_id], self._encode(cont))
                     for ctx, cont in (r.args for r in requests)]
            return continuation_logprobs(self.model, pairs, self._device, self.batch_size)

        def loglikelihood_rolling(self, requests) -> list[float]:
            out = []
            block = self.model.config.block_size
            for (text,) in (r.args for r in requests):
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    self._encode(text), prefix_token=self.eos_id, max_seq_len=block,
                    context_len=1)]
                scores = continuation_logprobs(self.model, windows, self._device, self.batch_size)
                out.append(sum(s for s, _ in scores))
            return out

        @torch.no_grad()
        def generate_until(self, requests) -> list[str]:
            out = []
            for context, kwargs in (r.args for r in requests):
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                ids = torch.tensor([self._encode(context) or [self.eos_id]], device=self._device)
                gen = self.model.generate(ids, int(kwargs.get("max_gen_toks", 32)),
                                          eos_id=self.eos_id)[0, ids.shape[1]:].tolist()
                if self.eos_id in gen:
                    gen = gen[: gen.index(self.eos_id)]
                text = self.tokenizer.decode(gen)
                for stop in until:
                    text = text.split(stop)[0]
                out.append(text)
            return out

    return HarnessLM


def run_harness(model, tokenizer, eos_id: int, suite_paths: list[Path], device: torch.device,
                limit: int | None = None) -> dict[str, float]:
    """The harness's scores for each suite: {"harness.<suite>.<metric>": value}."""
    if not available():
        raise ImportError(INSTALL_HINT)
    # local files only: never let datasets or the hub client reach for the network
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate

    configs = [task_config(p) for p in suite_paths]
    lm = _lm_class()(model, tokenizer, eos_id, device)
    results = simple_evaluate(model=lm, tasks=configs, limit=limit, log_samples=False,
                              bootstrap_iters=0, verbosity="WARNING")
    scores: dict[str, float] = {}
    for name, metrics in (results or {}).get("results", {}).items():
        suite = name.removeprefix("llmops_")
        for key, value in metrics.items():
            metric = key.split(",")[0]  # "acc,none" -> "acc"
            if (isinstance(value, (int, float)) and not metric.endswith("_stderr")
                    and metric not in ("alias", "sample_len")):
                scores[f"harness.{suite}.{metric}"] = float(value)
    log.info("lm-evaluation-harness: %s", scores)
    return scores
