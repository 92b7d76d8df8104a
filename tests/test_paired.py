"""The gate's paired comparisons (plugins/llmops/policy/paired.py): one test per kind of metric, its
interval and p-value from the same test, the minimum detectable effect, and the verdict by role.
What a reviewer of a gate decision relies on: a decision can be recomputed, the interval and the
p-value never disagree, and a comparison that cannot decide says so."""

from __future__ import annotations

import hashlib
import random

import pytest
from scipy import stats

from llmops.policy import paired


def results(correct: list[int], items: str = "suite-a", passages: list[int] | None = None) -> dict:
    out = {"n": len(correct), "items": hashlib.sha256(items.encode()).hexdigest()[:16],
           "correct": "".join(map(str, correct))}
    if passages is not None:
        out["clusters"] = [f"p:{p}" for p in passages]
    return out


def pair(n: int, both: int, only_a: int, only_b: int) -> tuple[dict, dict]:
    """Two models on n items: `both` right for both, `only_a`/`only_b` discordant, the rest wrong."""
    a = [1] * both + [1] * only_a + [0] * only_b
    b = [1] * both + [0] * only_a + [1] * only_b
    a += [0] * (n - len(a))
    b += [0] * (n - len(b))
    order = random.Random(1).sample(range(n), n)   # items in no particular order
    return results([a[i] for i in order]), results([b[i] for i in order])


def documents(bits: list[float], keys: list[str] | None = None, nbytes: int = 1000) -> dict:
    """evaluate's per-document held-out result (tasks/evaluate.py held_out_documents)."""
    keys = keys or [f"doc{i}" for i in range(len(bits))]
    return {"kind": "continuous", "n": len(bits), "keys": keys, "bits": bits,
            "bytes": [nbytes] * len(bits), "tokens": 250 * len(bits)}


def test_the_interval_and_the_test_never_disagree_on_binary_items():
    """The issue's case: +0.25 on 20 items. A percentile bootstrap gave [+0.10, +0.45] (a win)
    while exact McNemar gave p = 0.0625 (no win). Now the interval is McNemar's own: it includes
    0, and the verdict says there is not enough evidence, with the smallest change 20 items show."""
    a, b = pair(20, both=10, only_a=5, only_b=0)
    c = paired.compare("suite.sft_choice.accuracy", a, b, policy="superior")
    assert (c.diff, c.p_value, c.test) == (0.25, 0.0625, "exact McNemar")
    assert c.low < 0 < c.high and c.verdict == "not enough evidence" and not c.passed
    assert c.mde > 0.25
    assert "not enough evidence that the challenger is better" in c.reason()
    assert f"can detect is {c.mde:.3f}" in c.reason()
    # every discordant split of up to 30 items, at two confidences: excludes 0 <=> p < alpha
    for confidence in (0.95, 0.9):
        for m in range(1, 31):
            for better in range(m + 1):
                a, b = pair(60, both=10, only_a=better, only_b=m - better)
                c = paired.compare("task_accuracy", a, b, policy="superior", confidence=confidence)
                excludes = c.low > 0 or c.high < 0
                assert excludes == (c.p_value < 1 - confidence), (m, better, c)


def test_the_distributions_match_scipy():
    for df in (1, 3, 8, 21, 200):
        for q in (0.025, 0.8, 0.975, 0.999):
            assert paired.t_ppf(q, df) == pytest.approx(stats.t.ppf(q, df), abs=1e-8)
    for k, n in ((0, 7), (3, 10), (9, 9), (40, 130)):
        low, high = paired.clopper_pearson(k, n, 0.95)
        assert low == pytest.approx(stats.beta.ppf(0.025, k, n - k + 1) if k else 0.0, abs=1e-9)
        assert high == pytest.approx(stats.beta.ppf(0.975, k + 1, n - k) if k < n else 1.0, abs=1e-9)
    assert paired.mcnemar_p(9, 2) == pytest.approx(stats.binomtest(2, 11, 0.5).pvalue)


def test_a_few_tenths_on_hundreds_of_items_is_not_a_win_but_a_clear_one_is():
    """0.812 against 0.809 on 1000 items is not superior; 0.9 against 0.6 is; a student 0.3
    points worse is non-inferior within 2 points, and a loss of 30 points is shown worse."""
    win = paired.compare("task_accuracy", *pair(1000, both=792, only_a=20, only_b=17), policy="superior")
    assert (win.challenger, win.champion, win.n) == (0.812, 0.809, 1000)
    assert win.low < 0 < win.high and win.verdict == "not enough evidence"
    clear = paired.compare("task_accuracy", *pair(300, both=170, only_a=100, only_b=10), policy="superior")
    assert clear.passed and clear.low > 0.2 and clear.p_value < 1e-15
    student = paired.compare("task_accuracy", *pair(1000, both=792, only_a=17, only_b=20),
                             policy="non_inferior", margin=0.02)
    assert student.diff == pytest.approx(-0.003) and student.low > -0.02 and student.passed
    loss = paired.compare("task_accuracy", *pair(300, both=170, only_a=10, only_b=100),
                          policy="non_inferior", margin=0.05)
    assert loss.verdict == "fail" and loss.high < -0.2
    assert loss.reason().startswith("task_accuracy: the challenger is worse by more than 0.050")


def test_held_out_documents_decide_with_power_that_a_small_suite_lacks():
    """Per-document bits per byte on 22 documents: a 3% improvement is superior by 1% with an
    interval far from the bound; a seed-sized change (+-0.2%) is 'not better by 1%', however
    sure the interval is that the two models differ; the interval is relative to the champion."""
    rng = random.Random(5)
    champion = [rng.uniform(500, 3000) for _ in range(22)]
    better = documents([x * (0.97 + rng.gauss(0, 0.005)) for x in champion])
    c = paired.compare("heldout.bits_per_byte", better, documents(champion), policy="superior",
                       margin=0.01)
    assert c.kind == "continuous" and c.unit == "relative" and c.lower_is_better
    assert c.test == "cluster-robust t over documents" and (c.n, c.clusters, c.tokens) == (22, 22, 5500)
    assert c.passed and c.high < -0.02 and c.diff == pytest.approx(-0.03, abs=0.005)
    assert c.challenger / c.champion - 1 == pytest.approx(c.diff)
    noise = documents([x * (0.998 + rng.gauss(0, 0.0005)) for x in champion])
    n = paired.compare("heldout.bits_per_byte", noise, documents(champion), policy="superior",
                       margin=0.01)
    assert n.high < 0 and n.verdict == "fail"   # surely different, surely not 1% better
    assert n.reason().startswith("heldout.bits_per_byte: the challenger is not better by at least "
                                 "1.00%: the change -0.19%")
    assert "22 documents (5,500 tokens)" in n.reason()


def test_the_interval_has_its_coverage_when_the_models_are_equal():
    """Over 400 pairs of equal models (documents of varying difficulty, noise per document), the
    95% interval holds the truth (no change) about 95% of the time."""
    rng = random.Random(11)
    held = 0
    for _ in range(400):
        base = [rng.uniform(200, 4000) for _ in range(25)]
        ours = documents([x * (1 + rng.gauss(0, 0.02)) for x in base])
        theirs = documents([x * (1 + rng.gauss(0, 0.02)) for x in base])
        c = paired.compare("heldout.bits_per_byte", ours, theirs, policy="superior")
        held += c.low <= 0 <= c.high
    assert 0.91 <= held / 400 <= 0.985


def test_the_minimum_detectable_effect_shrinks_with_the_sample():
    rng = random.Random(3)
    mde = []
    for n in (25, 100, 400):
        base = [rng.uniform(200, 4000) for _ in range(n)]
        ours = documents([x * (1 + rng.gauss(0, 0.02)) for x in base])
        mde.append(paired.compare("heldout.bits_per_byte", ours, documents(base)).mde)
    assert mde[0] > 1.7 * mde[1] > 1.7 * 1.7 * mde[2]
    assert [round(paired.compare("task_accuracy", *pair(n, n // 2, n // 10, n // 10)).mde, 3)
            for n in (20, 2000)] == [0.280, 0.028]   # (z(.975) + z(.8)) x sqrt(0.2 / n)


def test_items_that_share_a_passage_count_as_one_cluster():
    """Ten cloze items per document, one document's items all right for the challenger: as
    independent items McNemar would call it a clear win; clustered by passage it is not shown."""
    a = [1] * 10 + [0] * 90
    b = [0] * 100
    passages = [i // 10 for i in range(100)]
    alone = paired.compare("suite.prose_cloze.accuracy", results(a), results(b))
    assert alone.test == "exact McNemar" and alone.passed
    clustered = paired.compare("suite.prose_cloze.accuracy", results(a, passages=passages),
                               results(b, passages=passages))
    assert clustered.test == "cluster-robust t over passages" and (clustered.n, clustered.clusters) == (100, 10)
    assert clustered.verdict == "not enough evidence" and clustered.low < 0
    assert "100 items in 10 passages" in clustered.reason()


def test_a_guard_fails_only_on_a_regression_it_can_show():
    """Every other metric is a guard: a 20-item suite that can show nothing blocks nothing, a
    real drop is caught, and a guard's margin lets a small shown drop through."""
    small = paired.compare("suite.s.accuracy", *pair(20, 8, 1, 3), role="guard")
    assert small.policy == "guard" and small.diff == -0.1 and small.passed
    drop = paired.compare("suite.s.accuracy", *pair(200, 50, 5, 90), role="guard")
    assert drop.verdict == "fail" and drop.high < 0
    assert drop.reason().startswith("suite.s.accuracy: the challenger is worse: the change -0.425")
    allowed = paired.compare("suite.s.accuracy", *pair(2000, 1000, 100, 180), role="guard", margin=0.1)
    assert allowed.high < 0 and allowed.passed


def test_documents_pair_by_name_whatever_the_tokenizer():
    """A champion with another tokenizer scored fewer whole documents (its rows fill sooner): the
    two pair on the documents both scored, named by their content."""
    keys = [f"d{i}" for i in range(30)]
    ours = documents([1000.0 + i for i in range(30)], keys)
    theirs = documents([1010.0 + i for i in range(27)], keys[:27])
    c = paired.compare("heldout.bits_per_byte", ours, theirs)
    assert c.n == 27 and c.diff < 0
    assert not paired.same_items(ours, documents([1.0], ["other"]))
    with pytest.raises(ValueError, match="not scored on the same items"):
        paired.compare("heldout.bits_per_byte", ours, documents([1.0, 2.0], ["x", "y"]))


def test_models_scored_on_different_items_are_not_compared():
    a, _ = pair(50, 20, 5, 5)
    b = results([1] * 50, items="suite-b")
    assert not paired.same_items(a, b)
    with pytest.raises(ValueError, match="not scored on the same items"):
        paired.compare("task_accuracy", a, b)
    with pytest.raises(ValueError, match="policy must be one of"):
        paired.compare("task_accuracy", a, a, policy="better")


def test_the_seen_items_are_cut_from_both_with_their_passages():
    a = results([1, 0, 1, 1], passages=[0, 0, 1, 1])
    a["seen"] = "0100"
    cut = paired.without(a, paired.seen(a))
    assert cut["n"] == 3 and cut["correct"] == "111" and cut["clusters"] == ["p:0", "p:1", "p:1"]
    assert cut["items"] != a["items"]
