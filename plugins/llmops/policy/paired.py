"""Is a challenger better than the champion, or not distinguishably worse? Paired comparisons on
the items both were scored on, one documented test per kind of metric.

A point estimate cannot tell: two models that differ only in their seeds differ by a few tenths
of a percent on any held-out set, and a 20-item suite cannot show a 10-point gain. Evaluation keeps,
per model and item-level metric, each item's result (tasks/evaluate.py `per_item`), so two models
scored on the same items are compared item by item:

  continuous   the held-out text, document by document (`heldout.bits_per_byte`: each whole
               held-out document's bits and bytes). The difference is relative: the challenger's
               bits per byte over the champion's, minus 1, over the documents both scored (a
               ratio of sums weighted by bytes, so it is the change of the pooled figure). Its
               interval is Student's t with the cluster-robust (CR1) standard error of that ratio,
               documents as clusters, G - 1 degrees of freedom: the tokens of one document are
               not independent of each other, the documents are.
  binary       right/wrong per item (task accuracy, task suites, lm-evaluation-harness's per-item
               results). Without shared passages: the exact McNemar test on the discordant items
               (those only one model got right), with the matching interval of the difference
               in accuracy (Clopper-Pearson for the share of discordant items the challenger won,
               conditional on their number), so the interval excludes 0 exactly when the test
               rejects: no second test that can disagree. Items that share a passage (a `passage`
               key in the suite file; the demo's prose cloze takes several items from one
               document) are not independent: the same t interval as above, absolute, with the
               passages as clusters.

Each comparison states its minimum detectable effect (MDE): the smallest true difference it finds
with `power` (80%) at its confidence and sample size, (t[conf] + t[power]) x its standard error,
so a reader knows what "no difference shown" is worth. And each metric has a role:

  decides  (GateConfig.metrics) the policy must be shown: `superior` (better by at least
           `margin`, the smallest improvement worth a new champion) or `non_inferior` (worse by
           less than `margin`). An interval that straddles the bound keeps the champion with the
           reason "not enough evidence", never a decision on the point estimate.
  guard    every other item-level metric both were scored on: fails only when the challenger is
           shown worse beyond GateConfig.guard_margin (its whole interval below), so a 20-item
           suite that can show nothing blocks nothing, and a real regression is caught.

Margins are relative for continuous metrics (0.01 = 1% of the champion's bits per byte) and in
accuracy points for binary ones. Standard library only (it runs on the Airflow side, MWAA
included); every figure is a pure function of the per-item results.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any

POLICIES = ("superior", "non_inferior")
ROLES = ("decides", "guard")
POWER = 0.8
# continuous metrics whose value is lower-is-better (held-out bits per byte)
LOWER_IS_BETTER = ("loss", "perplexity", "bits_per_byte")


# -- distributions (stdlib: no scipy on MWAA) --------------------------------------------------------


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def beta_cdf(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _invert(cdf, p: float, lo: float, hi: float) -> float:
    for _ in range(200):   # bisection: monotone, and exact to double precision in 200 halvings
        mid = (lo + hi) / 2
        if cdf(mid) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def beta_ppf(p: float, a: float, b: float) -> float:
    return _invert(lambda x: beta_cdf(x, a, b), p, 0.0, 1.0)


def t_cdf(t: float, df: float) -> float:
    tail = 0.5 * beta_cdf(df / (df + t * t), df / 2.0, 0.5)
    return 1.0 - tail if t > 0 else tail


def t_ppf(p: float, df: float) -> float:
    """Student's t quantile (the normal's for df = inf)."""
    if math.isinf(df):
        return NormalDist().inv_cdf(p)
    if df <= 0:
        return float("nan")
    bound = 10.0
    while t_cdf(bound, df) < max(p, 1 - p):   # heavy tails at small df: widen until it holds p
        bound *= 2
    return _invert(lambda t: t_cdf(t, df), p, -bound, bound)


def mcnemar_p(better: int, worse: int) -> float:
    """Exact two-sided McNemar test: under "no difference" each discordant item is a fair coin."""
    total = better + worse
    if total == 0:
        return 1.0
    tail = sum(math.comb(total, k) for k in range(min(better, worse) + 1)) / 2 ** total
    return min(1.0, 2 * tail)


def clopper_pearson(k: int, n: int, confidence: float) -> tuple[float, float]:
    """Exact interval of a binomial share: inverting the two one-sided exact tests."""
    alpha = 1.0 - confidence
    low = 0.0 if k == 0 else beta_ppf(alpha / 2, k, n - k + 1)
    high = 1.0 if k == n else beta_ppf(1 - alpha / 2, k + 1, n - k)
    return low, high


# -- per-item results -------------------------------------------------------------------------------


def kind_of(result: dict[str, Any]) -> str:
    return "continuous" if result.get("kind") == "continuous" else "binary"


def bits(result: dict[str, Any]) -> list[int]:
    """The per-item results evaluation wrote ("0"/"1" per item), checked against their count."""
    correct = str(result.get("correct", ""))
    if len(correct) != int(result.get("n", -1)) or set(correct) - {"0", "1"}:
        raise ValueError(f"per-item results are malformed: n={result.get('n')!r}, "
                         f"{len(correct)} results")
    return [int(c) for c in correct]


def same_items(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Can the two results be paired: binary ones on the same items in the same order (equal
    digests), continuous ones on at least two documents both scored."""
    if not (a and b) or kind_of(a) != kind_of(b):
        return False
    if kind_of(a) == "continuous":
        return len(set(a.get("keys") or ()) & set(b.get("keys") or ())) >= 2
    return bool(a.get("items") and a.get("items") == b.get("items") and a.get("n") == b.get("n"))


def seen(result: dict[str, Any] | None) -> set[int]:
    """The items the contamination audit found in the training data (evaluation's `seen`)."""
    return {i for i, c in enumerate(str((result or {}).get("seen", ""))) if c == "1"}


def without(result: dict[str, Any], drop: set[int]) -> dict[str, Any]:
    """A binary `result` without the items in `drop`; the digest says which were dropped, so two
    results stay comparable exactly when both dropped the same items."""
    if not drop:
        return result
    bits(result)   # refuses malformed results before they are cut
    keep = [i for i in range(int(result["n"])) if i not in drop]
    tag = ",".join(map(str, sorted(drop)))
    out = {"n": len(keep), "correct": "".join(result["correct"][i] for i in keep),
           "items": f"{result.get('items')}-{hashlib.sha256(tag.encode()).hexdigest()[:8]}"}
    if result.get("clusters"):
        out["clusters"] = [result["clusters"][i] for i in keep]
    return out


def accuracy(result: dict[str, Any]) -> float | None:
    values = bits(result)
    return sum(values) / len(values) if values else None


# -- the comparison -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    metric: str
    kind: str                # continuous | binary
    test: str                # which test gave the interval (see the module docstring)
    unit: str                # relative (continuous: a share of the champion's value) | points
    lower_is_better: bool
    role: str                # decides | guard
    policy: str              # superior | non_inferior (decides); guard
    margin: float
    n: int                   # items, or documents (continuous)
    clusters: int            # independent units: documents, passages, or n
    tokens: int              # continuous: the tokens scored in those documents; else 0
    challenger: float        # each model's value on those items
    champion: float
    diff: float              # challenger vs champion, in `unit`
    low: float               # diff's interval at `confidence`
    high: float
    confidence: float
    p_value: float           # of "no difference", from the same test
    mde: float               # the smallest |diff| found with `power`, in `unit`
    power: float
    verdict: str             # pass | fail | not enough evidence

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @property
    def decides(self) -> bool:
        return self.role == "decides"

    def _fmt(self, value: float) -> str:
        return f"{value:+.2%}" if self.unit == "relative" else f"{value:+.3f}"

    def _size(self) -> str:
        if self.kind == "continuous":
            return f"{self.clusters} documents ({self.tokens:,} tokens)"
        return f"{self.n} items" + (f" in {self.clusters} passages" if self.clusters < self.n else "")

    def bound(self) -> float:
        """The diff the interval must clear (superior, non_inferior) or not fall beyond (guard)."""
        better = -1.0 if self.lower_is_better else 1.0
        if self.policy == "superior":
            return better * self.margin
        return -better * self.margin   # non_inferior and guard: worse by at most margin

    def reason(self) -> str:
        """Why it did not pass, in a sentence a reviewer can check; empty when it passed."""
        if self.passed:
            return ""
        interval = (f"{self._fmt(self.diff)} [{self._fmt(self.low)}, {self._fmt(self.high)}] "
                    f"({self.confidence:.0%}, {self.test}) over {self._size()}")
        size = self._fmt(abs(self.margin))[1:]
        better = f"better by at least {size}" if self.margin else "better"
        not_worse = f"worse by less than {size}" if self.margin else "not worse"
        if self.verdict == "not enough evidence":
            need = better if self.policy == "superior" else not_worse
            return (f"{self.metric}: not enough evidence that the challenger is {need}: the change "
                    f"{interval} includes {self._fmt(self.bound())}; the smallest change this "
                    f"comparison can detect is {self._fmt(self.mde)[1:]} ({self.power:.0%} power)")
        if self.policy == "superior":
            return f"{self.metric}: the challenger is not {better}: the change {interval}"
        worse = f"worse by more than {size}" if self.margin else "worse"
        return f"{self.metric}: the challenger is {worse}: the change {interval}"

    def summary(self) -> str:
        """One line: change [interval] size p policy: verdict (MDE)."""
        policy = self.policy.replace("_", "-") + (f"({self._fmt(self.margin)[1:]})" if self.margin else "")
        return (f"{self._fmt(self.diff)} [{self._fmt(self.low)}, {self._fmt(self.high)}] "
                f"{self._size()} p={self.p_value:.3g} {policy}: {self.verdict} "
                f"(MDE {self._fmt(self.mde)[1:]})")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "decides": self.decides,
                "reason": self.reason()}


def _verdict(role: str, policy: str, low: float, high: float, bound: float,
             lower_is_better: bool) -> str:
    """pass / fail / not enough evidence, from where the interval lies against the bound."""
    # Orient so that larger is better: the interval must lie above the bound to pass.
    if lower_is_better:
        low, high, bound = -high, -low, -bound
    if role == "guard":
        return "fail" if high < bound else "pass"
    if low > bound:
        return "pass"
    return "fail" if high <= bound else "not enough evidence"


def _cluster_t(diffs: list[float], base: list[float], clusters: list[str], relative: bool,
               confidence: float, power: float) -> tuple[float, float, float, float, float, int]:
    """Difference of means (or, `relative`, of sums over the base's sum) with a CR1
    cluster-robust standard error, t on G - 1 degrees of freedom: (diff, low, high, p, mde, G)."""
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(clusters):
        groups.setdefault(c, []).append(i)
    g = len(groups)
    denominator = sum(base) if relative else float(len(diffs))
    diff = sum(diffs) / denominator
    # residual per cluster: its summed difference less what the estimate predicts for it
    residual = [sum(diffs[i] - diff * (base[i] if relative else 1.0) for i in idx)
                for idx in groups.values()]
    se = math.sqrt(g / (g - 1) * sum(r * r for r in residual)) / abs(denominator) if g > 1 else math.inf
    df = max(g - 1, 1)
    half = t_ppf(1 - (1 - confidence) / 2, df) * se
    p = 1.0 if se == 0 and diff == 0 else (0.0 if se == 0 else 2 * (1 - t_cdf(abs(diff) / se, df)))
    mde = (t_ppf(1 - (1 - confidence) / 2, df) + t_ppf(power, df)) * se
    return diff, diff - half, diff + half, p, mde, g


def compare(metric: str, challenger: dict[str, Any], champion: dict[str, Any], *,
            policy: str = "superior", margin: float = 0.0, role: str = "decides",
            confidence: float = 0.95, power: float = POWER) -> Comparison:
    """Compare two models' per-item results of one metric (see the module docstring). `policy`
    is the decision of a deciding metric; a guard's is "guard"."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if role == "decides" and policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    policy = policy if role == "decides" else "guard"
    if not same_items(challenger, champion):
        raise ValueError(f"{metric}: the two models were not scored on the same items")
    common: dict[str, Any]
    if kind_of(challenger) == "continuous":
        lower = metric.endswith(LOWER_IS_BETTER)
        ours = dict(zip(challenger["keys"], zip(challenger["bits"], challenger["bytes"])))
        theirs = dict(zip(champion["keys"], zip(champion["bits"], champion["bytes"])))
        keys = [k for k in champion["keys"] if k in ours]
        # each document's bits per byte, weighted by its bytes (the two models' mean: equal when
        # they share a tokenizer), so the ratio is that of the pooled bits per byte
        weight = [(ours[k][1] + theirs[k][1]) / 2 for k in keys]
        x = [w * ours[k][0] / ours[k][1] for k, w in zip(keys, weight)]
        y = [w * theirs[k][0] / theirs[k][1] for k, w in zip(keys, weight)]
        diff, low, high, p, mde, g = _cluster_t([a - b for a, b in zip(x, y)], y, keys,
                                                relative=True, confidence=confidence, power=power)
        total = sum(weight)
        common = dict(kind="continuous", unit="relative", lower_is_better=lower, n=len(keys),
                      clusters=g, tokens=int(min(challenger.get("tokens", 0), champion.get("tokens", 0))),
                      challenger=sum(x) / total, champion=sum(y) / total,
                      test="cluster-robust t over documents")
    else:
        a, b = bits(challenger), bits(champion)
        n = len(a)
        if n == 0:
            raise ValueError(f"{metric}: no items to compare")
        clusters = challenger.get("clusters") or [str(i) for i in range(n)]
        if len(set(clusters)) < n:   # items share passages: not independent
            diff, low, high, p, mde, g = _cluster_t([float(x - y) for x, y in zip(a, b)], [1.0] * n,
                                                    list(map(str, clusters)), relative=False,
                                                    confidence=confidence, power=power)
            test = "cluster-robust t over passages"
        else:
            better = sum(1 for x, y in zip(a, b) if x > y)
            worse = sum(1 for x, y in zip(a, b) if x < y)
            m = better + worse
            diff = (better - worse) / n
            if m:
                share_low, share_high = clopper_pearson(better, m, confidence)
                low, high = m / n * (2 * share_low - 1), m / n * (2 * share_high - 1)
            else:
                low = high = 0.0
            p, g = mcnemar_p(better, worse), n
            # planning value: the discordant share seen (at least one item), normal approximation
            z = NormalDist().inv_cdf
            mde = (z(1 - (1 - confidence) / 2) + z(power)) * math.sqrt(max(m, 1) / n) / math.sqrt(n)
            test = "exact McNemar"
        common = dict(kind="binary", unit="points", lower_is_better=False, n=n, clusters=g, tokens=0,
                      challenger=sum(a) / n, champion=sum(b) / n, test=test)
    lower = common["lower_is_better"]
    probe = Comparison(metric=metric, role=role, policy=policy, margin=margin, diff=diff, low=low,
                       high=high, confidence=confidence, p_value=p, mde=mde, power=power,
                       verdict="pass", **common)
    verdict = _verdict(role, policy, low, high, probe.bound(), lower)
    return Comparison(**{**asdict(probe), "verdict": verdict})
