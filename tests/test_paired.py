"""The gate's paired comparisons (plugins/llmops/paired.py): the difference of two models'
accuracies on the same items, its bootstrap interval, the exact McNemar test and the decision."""

from __future__ import annotations

import hashlib
import math
import random

import pytest

from llmops import paired


def results(correct: list[int], items: str = "suite-a") -> dict:
    return {"n": len(correct), "items": hashlib.sha256(items.encode()).hexdigest()[:16],
            "correct": "".join(map(str, correct))}


def pair(n: int, both: int, only_a: int, only_b: int) -> tuple[dict, dict]:
    """Two models on n items: `both` right for both, `only_a`/`only_b` discordant, the rest wrong."""
    a = [1] * both + [1] * only_a + [0] * only_b
    b = [1] * both + [0] * only_a + [1] * only_b
    a += [0] * (n - len(a))
    b += [0] * (n - len(b))
    order = random.Random(1).sample(range(n), n)   # items in no particular order
    return results([a[i] for i in order]), results([b[i] for i in order])


def test_a_few_tenths_on_hundreds_of_items_is_not_a_win():
    """0.812 against 0.809 on 1000 items (discordant items 20 vs 17): not superior; and a student
    0.3 points worse is not distinguishably worse than the champion within 2 points."""
    challenger, champion = pair(1000, both=792, only_a=20, only_b=17)
    win = paired.compare("task_accuracy", challenger, champion, policy="superior")
    assert (win.challenger, win.champion, win.n) == (0.812, 0.809, 1000)
    assert win.low < 0 < win.high and not win.passed
    assert "does not lie above 0" in win.reason() and "[" in win.reason()
    student, teacher = pair(1000, both=792, only_a=17, only_b=20)      # 0.809 vs 0.812
    kept = paired.compare("task_accuracy", student, teacher, policy="non_inferior", margin=0.02)
    assert kept.diff == pytest.approx(-0.003) and kept.low > -0.02 and kept.passed


def test_a_clear_win_passes_and_a_clear_loss_fails_non_inferiority():
    better, base = pair(300, both=170, only_a=100, only_b=10)           # 0.9 vs 0.6
    win = paired.compare("suite.mmlu.accuracy", better, base, policy="superior")
    assert win.passed and win.low > 0.2 and win.p_value < 1e-15
    loss = paired.compare("suite.mmlu.accuracy", base, better, policy="non_inferior", margin=0.05)
    assert not loss.passed and loss.high < -0.2


def test_the_decision_is_reproducible_from_its_seed_and_resamples():
    a, b = pair(200, both=100, only_a=12, only_b=8)
    first = paired.compare("task_accuracy", a, b, policy="superior", seed=7, resamples=500)
    assert first == paired.compare("task_accuracy", a, b, policy="superior", seed=7, resamples=500)
    assert (first.seed, first.resamples) == (7, 500)


def test_mcnemar_exact_p_value():
    # 9 discordant items for the challenger, 2 against: 2 * P(X <= 2), X ~ Binomial(11, 1/2)
    assert paired.mcnemar_p(9, 2) == pytest.approx(2 * (1 + 11 + 55) / 2 ** 11)
    assert paired.mcnemar_p(0, 0) == 1.0 and paired.mcnemar_p(5, 5) == 1.0


def test_the_interval_has_its_coverage_when_the_models_are_equal():
    """Two models that are right on each item with the same probability: a 90% interval excludes
    zero in about 10% of experiments (here between 3% and 20% of 150), not far more."""
    rng = random.Random(0)
    excluded = 0
    for trial in range(150):
        truth = [rng.random() < 0.7 for _ in range(120)]
        a = [int(t if rng.random() < 0.8 else not t) for t in truth]
        b = [int(t if rng.random() < 0.8 else not t) for t in truth]
        c = paired.compare("task_accuracy", results(a), results(b), policy="superior",
                           confidence=0.9, resamples=400, seed=trial)
        excluded += not (c.low <= 0 <= c.high)
    assert 0.03 * 150 <= excluded <= 0.20 * 150


def test_models_scored_on_different_items_are_not_compared():
    a = results([1, 0, 1], items="suite-a")
    with pytest.raises(ValueError, match="not scored on the same items"):
        paired.compare("task_accuracy", a, results([1, 1, 1], items="suite-b"), policy="superior")
    with pytest.raises(ValueError, match="malformed"):
        paired.bits({"n": 3, "items": "x", "correct": "10"})
    assert math.isfinite(paired.compare("task_accuracy", a, a, policy="non_inferior",
                                        margin=0.1).low)
