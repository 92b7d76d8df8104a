"""Is a challenger better than the champion, or not distinguishably worse? Paired comparisons on
the items both were scored on.

A point estimate cannot tell: 0.812 against 0.809 on a few hundred items is noise, and a student
0.3 points worse may be no worse at all. Evaluation keeps, per model and item-level metric, whether
each item was right (tasks/evaluate.py `per_item`: the items' digest and one character per item).
For two models scored on the same items (equal digests) this module gives the difference of
their accuracies with a paired bootstrap confidence interval (percentile; resampling items, so
the pairing is kept), the exact McNemar test on the discordant items, and a decision by policy:

  superior       the interval lies above zero: the challenger is better, with that confidence
  non_inferior   the interval lies above -margin: at worst `margin` worse, with that confidence

Standard library only (it runs on the Airflow side, MWAA included). The seed and the number of
resamples are part of the result, so a decision can be recomputed exactly.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import asdict, dataclass
from typing import Any

POLICIES = ("superior", "non_inferior")


@dataclass(frozen=True)
class Comparison:
    metric: str
    policy: str
    margin: float
    n: int                   # items both were scored on
    challenger: float        # accuracies on those items
    champion: float
    diff: float              # challenger - champion
    low: float               # the interval of diff at `confidence`
    high: float
    confidence: float
    p_value: float           # exact McNemar, two-sided
    better: int              # items only the challenger got right
    worse: int               # items only the champion got right
    passed: bool
    resamples: int
    seed: int

    def reason(self) -> str:
        """Why it failed, in a sentence a reviewer can check; empty when it passed."""
        if self.passed:
            return ""
        bound = "0" if self.policy == "superior" else f"-{self.margin:g}"
        return (f"{self.metric}: challenger {self.challenger:.4g} vs champion {self.champion:.4g}, "
                f"difference {self.diff:+.4g} with {self.confidence:.0%} interval "
                f"[{self.low:+.4g}, {self.high:+.4g}] on {self.n} items does not lie above {bound} "
                f"({self.policy.replace('_', '-')})")

    def summary(self) -> str:
        return (f"{self.diff:+.4f} [{self.low:+.4f}, {self.high:+.4f}] n={self.n} "
                f"p={self.p_value:.3g} {self.policy}{'' if self.policy == 'superior' else f'({self.margin:g})'}: "
                f"{'pass' if self.passed else 'fail'}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bits(result: dict[str, Any]) -> list[int]:
    """The per-item results evaluation wrote ("0"/"1" per item), checked against their count."""
    correct = str(result.get("correct", ""))
    if len(correct) != int(result.get("n", -1)) or set(correct) - {"0", "1"}:
        raise ValueError(f"per-item results are malformed: n={result.get('n')!r}, "
                         f"{len(correct)} results")
    return [int(c) for c in correct]


def same_items(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    return bool(a and b and a.get("items") and a.get("items") == b.get("items")
                and a.get("n") == b.get("n"))


def seen(result: dict[str, Any] | None) -> set[int]:
    """The items the contamination audit found in the training data (evaluation's `seen`)."""
    return {i for i, c in enumerate(str((result or {}).get("seen", ""))) if c == "1"}


def without(result: dict[str, Any], drop: set[int]) -> dict[str, Any]:
    """`result` without the items in `drop`; the digest says which were dropped, so two results
    stay comparable exactly when both dropped the same items."""
    if not drop:
        return result
    bits(result)   # refuses malformed results before they are cut
    kept = "".join(c for i, c in enumerate(result["correct"]) if i not in drop)
    tag = ",".join(map(str, sorted(drop)))
    return {"n": len(kept), "correct": kept,
            "items": f"{result.get('items')}-{hashlib.sha256(tag.encode()).hexdigest()[:8]}"}


def accuracy(result: dict[str, Any]) -> float | None:
    values = bits(result)
    return sum(values) / len(values) if values else None


def bootstrap_interval(diffs: list[float], confidence: float, resamples: int, seed: int
                       ) -> tuple[float, float]:
    """Percentile interval of the mean of `diffs`, resampling items with replacement."""
    n = len(diffs)
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(resamples))
    tail = (1.0 - confidence) / 2
    low = means[max(0, math.floor(tail * resamples))]
    high = means[min(resamples - 1, math.ceil((1 - tail) * resamples) - 1)]
    return low, high


def mcnemar_p(better: int, worse: int) -> float:
    """Exact two-sided McNemar test: under "no difference" each discordant item is a fair coin."""
    total = better + worse
    if total == 0:
        return 1.0
    tail = sum(math.comb(total, k) for k in range(min(better, worse) + 1)) / 2 ** total
    return min(1.0, 2 * tail)


def compare(metric: str, challenger: dict[str, Any], champion: dict[str, Any], *, policy: str,
            margin: float = 0.0, confidence: float = 0.95, resamples: int = 2000, seed: int = 0
            ) -> Comparison:
    """Compare two models' per-item results of one metric (see the module docstring)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not same_items(challenger, champion):
        raise ValueError(f"{metric}: the two models were not scored on the same items")
    a, b = bits(challenger), bits(champion)
    n = len(a)
    if n == 0:
        raise ValueError(f"{metric}: no items to compare")
    diffs = [float(x - y) for x, y in zip(a, b)]
    low, high = bootstrap_interval(diffs, confidence, resamples, seed)
    better = sum(1 for d in diffs if d > 0)
    worse = sum(1 for d in diffs if d < 0)
    bound = 0.0 if policy == "superior" else -margin
    return Comparison(metric=metric, policy=policy, margin=margin, n=n, challenger=sum(a) / n,
                      champion=sum(b) / n, diff=sum(diffs) / n, low=low, high=high,
                      confidence=confidence, p_value=mcnemar_p(better, worse), better=better,
                      worse=worse, passed=low > bound, resamples=resamples, seed=seed)
