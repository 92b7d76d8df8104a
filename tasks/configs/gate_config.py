"""The promotion gate's config (`GateConfig`, read by plugins/llmops/policy/promotion.py): absolute
thresholds, the paired comparison with the champion that decides (which item-level metrics, the
policy and its margin, the confidence), the margin of the guards, and how contaminated items are
treated. The statistics are plugins/llmops/policy/paired.py's."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tasks.configs.fields import bounded, check, check_bounds


# Metrics evaluation scores item by item (tasks/evaluate.py `per_item`): the held-out text per
# document, exact-match task accuracy, local task suites, lm-evaluation-harness's per-item results.
ITEM_METRIC = re.compile(r"^(heldout\.bits_per_byte|task_accuracy|suite\.[^.]+\.accuracy"
                         r"|harness\.[^.]+\.(acc|acc_norm|exact_match))$")
ITEM_METRIC_HELP = ("heldout.bits_per_byte (the held-out text, document by document), "
                    "task_accuracy, suite.<name>.accuracy, harness.<name>.acc (acc_norm, exact_match)")


@dataclass(kw_only=True)
class GateConfig:
    """What a model must reach to be registered and made `champion`
    (plugins/llmops/policy/promotion.py): absolute thresholds, then, against the current champion
    scored on the same items, the policy shown on every metric in `metrics` (a paired interval, not
    a point estimate), and no guard metric shown worse beyond guard_margin."""

    min_task_accuracy: float = bounded(0.0, minimum=0.0, maximum=1.0,
                                       help="Lowest exact-match accuracy that may ship.")
    max_perplexity: float = bounded(1e9, minimum=1.0, maximum=1e9,
                                    help="Highest held-out perplexity that may ship.")
    prefer: str = bounded("student", choices=("student", "teacher"),
                          help="Which model is the challenger when both meet the thresholds.")
    require_approval: bool = bounded(False, help="Retraining: a human approves (Airflow's "
                                                 "ApprovalOperator) before `champion` moves.")
    metrics: list = bounded(["heldout.bits_per_byte"],
                            help="The item-level metrics on which the challenger must show the "
                                 f"policy against the champion: {ITEM_METRIC_HELP}. Every other "
                                 "item-level metric both were scored on is a guard.")
    policy: str = bounded("superior", choices=("superior", "non_inferior"),
                          help="superior: the challenger is better by at least the margin, with "
                               "the confidence; non_inferior: worse by less than the margin (a "
                               "cheaper model that may replace the champion).")
    # Two models that differ only in their seeds differ by a few tenths of a percent on the
    # held-out text; a margin of 1% keeps such a challenger out however many documents show it.
    margin: float = bounded(0.01, minimum=0.0, maximum=0.5,
                            help="superior: the smallest improvement worth a new champion; "
                                 "non_inferior: the largest loss tolerated. Relative for "
                                 "heldout.bits_per_byte (0.01 = 1%), accuracy points for the "
                                 "item accuracies.")
    guard_margin: float = bounded(0.0, minimum=0.0, maximum=0.5,
                                  help="A guard metric fails only when the challenger is shown "
                                       "worse than the champion by more than this (same units "
                                       "as margin).")
    confidence: float = bounded(0.95, minimum=0.5, maximum=0.999,
                                help="Confidence of the paired intervals (two-sided).")
    power: float = bounded(0.8, minimum=0.5, maximum=0.99,
                           help="Power at which each comparison's minimum detectable effect is "
                                "stated.")
    exclude_contaminated: bool = bounded(True, help="Leave evaluation items found in the training "
                                                    "data out of every score the gate reads.")
    # Seen items are already left out of the scores; refusing is for a suite whose clean part is
    # too small to stand for it. 0.25, not GPT-3's "any overlap": the demo corpus (Python
    # docstrings) holds held-out cloze items in training text for real (bytes and bytearray
    # document the same methods in the same words), and those are excluded, not fatal.
    max_contaminated_share: float = bounded(0.25, minimum=0.0, maximum=1.0,
                                            help="Refuse when a larger share of any metric's items "
                                                 "appears in the training data.")

    def __post_init__(self) -> None:
        check_bounds(self)
        check(isinstance(self.metrics, list) and bool(self.metrics),
              "GateConfig.metrics must name at least one item-level metric, e.g. "
              "['heldout.bits_per_byte'].")
        for metric in self.metrics:
            check(isinstance(metric, str) and bool(ITEM_METRIC.match(metric)),
                  f"GateConfig.metrics: {metric!r} is not compared item by item; name one of "
                  f"{ITEM_METRIC_HELP}.")
        check(len(set(self.metrics)) == len(self.metrics),
              f"GateConfig.metrics names a metric twice: {self.metrics}.")
        check(self.policy == "superior" or self.margin > 0,
              "GateConfig.margin must be above 0 for policy non_inferior: it is how much worse "
              "than the champion the challenger may be, e.g. 0.02.")
