"""The promotion gate's config (`GateConfig`, read by plugins/llmops/promotion.py): absolute
thresholds, margins against the current champion, paired bootstrap comparisons on the
item-level metrics `ITEM_METRIC` matches, and how contaminated items are treated."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tasks.configs.fields import bounded, check, check_bounds


# Metrics evaluation scores item by item (tasks/evaluate.py `per_item`).
ITEM_METRIC = re.compile(r"^(task_accuracy|suite\.[^.]+\.accuracy|harness\.[^.]+\.(acc|acc_norm|exact_match))$")


@dataclass(kw_only=True)
class GateConfig:
    """What a model must reach to be registered and made `champion` (plugins/llmops/promotion.py):
    absolute thresholds, and no worse than the current champion beyond champion_margins."""

    min_task_accuracy: float = bounded(0.0, minimum=0.0, maximum=1.0,
                                       help="Lowest exact-match accuracy that may ship.")
    max_perplexity: float = bounded(1e9, minimum=1.0, maximum=1e9,
                                    help="Highest held-out perplexity that may ship.")
    prefer: str = bounded("student", choices=("student", "teacher"),
                          help="Which passing model to register when both pass.")
    champion_margins: dict = bounded({"task_accuracy": 0.02, "bits_per_byte": 0.02},
                                     help="Metric -> how much worse than the champion a challenger "
                                          "may be (0 = at least as good; negative = must beat it "
                                          "by that much). *loss, *perplexity, *bits_per_byte are "
                                          "lower-is-better.")
    require_approval: bool = bounded(False, help="Retraining: a human approves (Airflow's "
                                                 "ApprovalOperator) before `champion` moves.")
    paired: dict = bounded({}, help="Item-level metric (task_accuracy, suite.<name>.accuracy, "
                                    "harness.<name>.acc) -> "
                                    "{'policy': 'superior'} (must beat the champion, with "
                                    "confidence) or {'policy': 'non_inferior', 'margin': 0.02} "
                                    "(at worst that much worse, with confidence): a paired "
                                    "bootstrap on the items both were scored on, in place of "
                                    "that metric's champion_margins entry.")
    confidence: float = bounded(0.95, minimum=0.5, maximum=0.999,
                                help="Confidence of the paired comparisons' intervals.")
    bootstrap_resamples: int = bounded(2000, minimum=200, maximum=100000,
                                       help="Bootstrap resamples per paired comparison.")
    bootstrap_seed: int = bounded(0, minimum=0, maximum=2**31 - 1,
                                  help="Seed of the paired bootstrap (a decision can be recomputed).")
    exclude_contaminated: bool = bounded(True, help="Leave evaluation items found in the training "
                                                    "data out of every score the gate reads.")
    # Seen items are already left out of the scores; refusing is for a suite whose clean part is
    # too small to stand for it. 0.25, not GPT-3's "any overlap": the demo corpus (Python
    # docstrings) holds 11% of its held-out cloze items in training text for real (bytes and
    # bytearray document the same methods in the same words), and those are excluded, not fatal.
    max_contaminated_share: float = bounded(0.25, minimum=0.0, maximum=1.0,
                                            help="Refuse when a larger share of any metric's items "
                                                 "appears in the training data.")

    def __post_init__(self) -> None:
        check_bounds(self)
        check(isinstance(self.champion_margins, dict) and all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v) for k, v in self.champion_margins.items()),
            "GateConfig.champion_margins must map metric names to finite numbers, e.g. "
            "{'task_accuracy': 0.02}.")
        check(isinstance(self.paired, dict), "GateConfig.paired must be a dict, e.g. "
               "{'task_accuracy': {'policy': 'superior'}}.")
        for metric, rule in self.paired.items():
            where = f"GateConfig.paired[{metric!r}]"
            check(isinstance(metric, str) and bool(ITEM_METRIC.match(metric)),
                   f"{where}: only item-level metrics can be compared item by item: "
                   "task_accuracy, suite.<name>.accuracy or harness.<name>.acc (acc_norm, exact_match).")
            check(isinstance(rule, dict) and not set(rule) - {"policy", "margin"},
                   f"{where} must be {{'policy': ..., 'margin': ...}}; unknown keys "
                   f"{sorted(set(rule) - {'policy', 'margin'}) if isinstance(rule, dict) else rule!r}.")
            check(rule.get("policy") in ("superior", "non_inferior"),
                   f"{where}.policy must be 'superior' or 'non_inferior', got {rule.get('policy')!r}.")
            margin = rule.get("margin", 0.0)
            check(isinstance(margin, (int, float)) and not isinstance(margin, bool)
                   and 0.0 <= margin < 1.0, f"{where}.margin must be a number in [0, 1), got {margin!r}.")
            check(rule["policy"] == "non_inferior" or margin == 0.0,
                   f"{where}: a margin applies to 'non_inferior' only; 'superior' means above 0.")
