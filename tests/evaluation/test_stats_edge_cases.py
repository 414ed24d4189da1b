"""The statistics engine at its edges: Benjamini–Hochberg at exact ties with its
threshold, group-sequential looks closer together than the grid resolves, and Student's t (and
the noncentral t under power) at huge degrees of freedom and in the far tails."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from torchhal.evaluation.stats import (
    Decision,
    GroupSequentialTest,
    benjamini_hochberg,
    group_boundaries,
    holm,
    power_welch,
)
from torchhal.evaluation.stats import distributions as D
from torchhal.evaluation.stats.group_sequential import spent_alpha

# --- Benjamini–Hochberg -----------------------------------------------------------------------


def _bh_by_hand(p: list[float], alpha: float) -> tuple[list[float], list[bool]]:
    """BH in exact rational arithmetic on the binary values p = a/b and alpha = c/d: adjusted_(i)
    = min_{j>=i} m·p_(j)/j rounded once (int / int is correctly rounded, and rounding is monotone,
    so the minimum of the rounded values is the rounded minimum); reject the k smallest, k the
    largest j with p_(j) <= j·alpha/m."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    c, d = alpha.as_integer_ratio()
    scaled, within = [], []
    for j, i in enumerate(order, start=1):
        a, b = p[i].as_integer_ratio()
        scaled.append(a * m / (b * j))
        within.append(a * m * d <= c * j * b)
    for j in range(m - 2, -1, -1):
        scaled[j] = min(scaled[j], scaled[j + 1])
    k = max((j for j in range(1, m + 1) if within[j - 1]), default=0)
    adjusted, reject = [0.0] * m, [False] * m
    for rank, i in enumerate(order):
        adjusted[i], reject[i] = min(scaled[rank], 1.0), rank < k
    return adjusted, reject


def _holm_by_hand(p: list[float], alpha: float) -> tuple[list[float], list[bool]]:
    """Holm the same way: adjusted_(i) = max_{j<=i} (m − j + 1)·p_(j) rounded once; reject
    H_(i) when p_(j) <= alpha/(m − j + 1) for every j <= i."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    c, d = alpha.as_integer_ratio()
    adjusted, reject = [0.0] * m, [False] * m
    running, rejecting = 0.0, True
    for j, i in enumerate(order, start=1):
        a, b = p[i].as_integer_ratio()
        running = max(running, a * (m - j + 1) / b)
        rejecting = rejecting and a * (m - j + 1) * d <= c * b
        adjusted[i], reject[i] = min(running, 1.0), rejecting
    return adjusted, reject


def test_benjamini_hochberg_rejects_a_p_value_equal_to_its_threshold() -> None:
    """p = (0.05, 0.025, 0.01) at alpha = 0.05: p_(3) = 0.05 <= 3·0.05/3, so BH (1995, step-up)
    rejects all three, and the adjusted value of 0.05 is 0.05 (statsmodels' multipletests agrees).
    The old code computed 0.05·3/3 = 0.05000000000000001 and kept the hypothesis."""
    result = benjamini_hochberg([0.05, 0.025, 0.01], alpha=0.05)
    assert result.adjusted[0] == 0.05
    assert result.reject == (True, True, True)


def test_benjamini_hochberg_matches_exact_rational_arithmetic_with_ties_zeros_and_ones() -> None:
    rng = np.random.default_rng()
    grid = [0.0, 0.001, 0.01, 0.0125, 0.02, 0.025, 0.04, 0.05, 0.1, 0.2, 0.5, 1.0]
    for _ in range(300):
        m = int(rng.integers(1, 12))
        p = [float(v) for v in rng.choice(grid, size=m)]
        alpha = float(rng.choice([0.05, 0.1, 0.2]))
        adjusted, reject = _bh_by_hand(p, alpha)
        result = benjamini_hochberg(p, alpha=alpha)
        assert result.adjusted == tuple(adjusted), p
        assert result.reject == tuple(reject), (p, alpha)


def _near_thresholds(rng: np.random.Generator, m: int, alpha: float) -> list[float]:
    """m p-values, most within two ulps of a BH threshold j·alpha/m or a Holm one alpha/k."""
    j = rng.integers(1, m + 1, size=m)
    thresholds = np.where(rng.uniform(size=m) < 0.5, j * alpha / m, alpha / j)
    p = thresholds
    for _ in range(2):
        nudge = rng.integers(-1, 2, size=m)
        p = np.where(nudge == 0, p, np.nextafter(p, np.where(nudge > 0, 1.0, 0.0)))
    p = np.where(rng.uniform(size=m) < 0.2, rng.uniform(size=m), p)
    return [float(v) for v in p]


@pytest.mark.parametrize(("correct", "by_hand"), [(benjamini_hochberg, _bh_by_hand), (holm, _holm_by_hand)])
def test_rejections_follow_the_exact_rule_within_an_ulp_of_the_threshold(correct, by_hand) -> None:
    """m·p/j (or k·p) can exceed alpha by less than half an ulp and round to alpha: the old code
    compared the rounded value and rejected (p = 0.0071428571428571435 with six p-values of 1 at
    alpha = 0.05: 7·p = 0.05 + 3.5e-19, rejected by both methods). The rule is exact."""
    assert correct([0.0071428571428571435] + [1.0] * 6, alpha=0.05).reject[0] is False
    rng = np.random.default_rng()
    for _ in range(400):
        m = int(rng.integers(2, 40))
        alpha = float(rng.choice([0.05, 0.1, 0.01, rng.uniform(0.001, 0.3)]))
        p = _near_thresholds(rng, m, alpha)
        adjusted, reject = by_hand(p, alpha)
        result = correct(p, alpha=alpha)
        assert result.adjusted == tuple(adjusted), (p, alpha)
        assert result.reject == tuple(reject), (p, alpha)


def test_benjamini_hochberg_of_200_000_p_values_is_fast_and_exact() -> None:
    """A Fraction per p-value took 1.5 s at m = 200,000 on the 2-core test machine (9 s at 1e6,
    against 0.02 s for plain floats); the float path with exact fall-backs takes ~0.08 s, most of
    it the sort. The 1 s bound leaves ten times that for a loaded machine and still fails the
    per-value loop. Strong signals, ties, nulls, and 98,000 p-values within two ulps of their own
    rank's threshold j·alpha/m, so the exact fall-backs run too; every entry is checked."""
    rng = np.random.default_rng()
    m, alpha = 200_000, 0.05
    p = np.arange(1, m + 1) * alpha / m  # each on its own rank's threshold ...
    for _ in range(2):  # ... or an ulp or two off it
        nudge = rng.integers(-1, 2, size=m)
        p = np.where(nudge == 0, p, np.nextafter(p, np.where(nudge > 0, 1.0, 0.0)))
    p[:2000] = np.sort(rng.uniform(size=2000) ** 12) * p[2000]  # strong signals
    p[m // 2 :] = np.sort(rng.uniform(p[m // 2 - 1], 1.0, size=m - m // 2))  # nulls
    ties = rng.integers(1, m, size=2000)
    p[ties] = p[ties - 1]
    rng.shuffle(p)
    start = time.perf_counter()
    result = benjamini_hochberg(p, alpha=alpha)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"benjamini_hochberg took {elapsed:.2f} s for m = {m}"
    adjusted, reject = _bh_by_hand(p.tolist(), alpha)
    assert result.adjusted == tuple(adjusted)
    assert result.reject == tuple(reject)


# --- group-sequential looks closer than the grid resolves ------------------------------------


def test_a_look_right_after_another_is_deferred_not_a_collapsed_boundary() -> None:
    """A look 1e-7 of the information after the previous one: the old code sampled a kernel far
    narrower than its grid and returned a boundary of 0.047 (nearly every path rejects there)."""
    close = group_boundaries([0.5, 0.5000001, 1.0])
    apart = group_boundaries([0.5, 1.0])
    assert close[1] == math.inf
    assert close[0] == apart[0] and close[2] == pytest.approx(apart[1], abs=1e-12)


_ERFC = np.frompyfunc(math.erfc, 1, 1)


def _normal_sf(z: np.ndarray) -> np.ndarray:
    return 0.5 * np.asarray(_ERFC(z / math.sqrt(2.0)), dtype=np.float64)


@pytest.mark.parametrize("spending", ["obrien-fleming", "pocock"])
@pytest.mark.parametrize("fractions", [[0.5, 0.9995, 1.0], [0.9995, 1.0], [0.3, 0.99999, 1.0]])
def test_a_final_look_right_after_another_spends_what_is_left(spending: str, fractions: list[float]) -> None:
    """The planned end, closer to the last look than the grid resolves, was deferred too: an
    infinite boundary, so the final analysis could not reject and α(1) − α(t) was never spent
    ([0.9995, 1.0] gave [1.96, inf]). Monte Carlo of the score process: each look's crossing
    probability is the spending function's increment; the last one, 1e-4 to 1e-7, is averaged
    over the paths still running as its exact conditional probability given B at the look before."""
    bounds = np.array(group_boundaries(fractions, spending=spending))
    assert math.isfinite(bounds[-1])
    rng = np.random.default_rng()
    paths = 1_000_000
    steps = np.diff([0.0, *fractions])
    score = np.cumsum(rng.normal(size=(paths, len(fractions))) * np.sqrt(steps), axis=1)
    edges = bounds * np.sqrt(fractions)
    crossed = np.maximum.accumulate(np.abs(score) >= edges, axis=1).mean(axis=0)
    planned = np.array([spent_alpha(f, 0.05, spending) for f in fractions])
    se = np.sqrt(planned * (1 - planned) / paths)
    assert np.all(np.abs(crossed[:-1] - planned[:-1]) <= 4 * se[:-1] + 1e-6), (crossed, planned)
    running = score[~(np.abs(score[:, :-1]) >= edges[:-1]).any(axis=1), -2]
    sd = math.sqrt(steps[-1])
    last = _normal_sf((edges[-1] - running) / sd) + _normal_sf((edges[-1] + running) / sd)
    increment, increment_se = last.sum() / paths, last.std() * math.sqrt(running.size) / paths
    assert abs(increment - (planned[-1] - planned[-2])) <= 4 * increment_se, (increment, planned)


def test_the_object_looking_after_every_value_ends_with_a_finite_boundary() -> None:
    """max_samples = 3000, a look after every value near the end: the look at 3000 came 2/3000 of
    the information after the last one taken and was deferred, so the design ended with an
    infinite boundary, never rejecting there, having spent 0.0499 of its 0.05."""
    rng = np.random.default_rng()
    test = GroupSequentialTest(max_samples=3000, higher_is_better=True)
    state = test.update(rng.normal(size=2900), rng.normal(size=2900))
    looks, bounds = [2900 / 3000], [state.boundary]
    for n in range(2901, 3001):
        state = test.update(rng.normal(size=1), rng.normal(size=1))
        if math.isfinite(state.boundary):
            looks.append(n / 3000)
            bounds.append(state.boundary)
    assert state.n_a == state.n_b == 3000 and looks[-1] == 1.0
    assert math.isfinite(state.boundary)
    assert state.spent_alpha == pytest.approx(0.05, rel=1e-12)
    assert bounds == pytest.approx(group_boundaries(looks), abs=1e-12)


@pytest.mark.parametrize("spending", ["obrien-fleming", "pocock"])
def test_a_cluster_of_close_looks_keeps_the_false_positive_rate(spending: str) -> None:
    """Monte Carlo of the score process: nine spaced looks, then 40 looks 2e-5 apart, then the
    end. The probability of any crossing stays at the spending function's α (the old code: ~1)."""
    fractions = [0.1 * k for k in range(1, 10)] + [0.95 + 2e-5 * i for i in range(40)] + [1.0]
    bounds = np.array(group_boundaries(fractions, spending=spending))
    rng = np.random.default_rng()
    paths = 200_000
    steps = rng.normal(size=(paths, len(fractions))) * np.sqrt(np.diff([0.0, *fractions]))
    z = np.cumsum(steps, axis=1) / np.sqrt(fractions)
    rate = float((np.abs(z) >= bounds).any(axis=1).mean())
    alpha = spent_alpha(1.0, 0.05, spending)
    se = math.sqrt(alpha * (1 - alpha) / paths)
    assert abs(rate - alpha) <= 4 * se, (spending, rate)


def test_the_object_defers_a_one_value_look_in_a_large_design() -> None:
    """max_samples = 100 000: a look after one more value is 1e-5 of the information; it is
    deferred (infinite boundary, nothing spent, no decision), and the next real step looks. The
    arms get the same values (z = 0), so no look can cross: independent arms crossed the first
    look's boundary in about 0.3% of runs, which then carried its decision (a CI run failed so)."""
    rng = np.random.default_rng()

    def same(n: int) -> tuple[np.ndarray, np.ndarray]:
        values = rng.normal(size=n)
        return values, values.copy()

    test = GroupSequentialTest(max_samples=100_000, higher_is_better=True)
    first = test.update(*same(50_000))
    assert first.decision is Decision.CONTINUE
    for _ in range(3):
        state = test.update(*same(1))
        assert state.boundary == math.inf and state.spent_alpha == first.spent_alpha
        assert state.decision is Decision.CONTINUE
    later = test.update(*same(4_997))
    assert later.boundary == pytest.approx(group_boundaries([0.5, 0.55])[1], abs=1e-9)
    assert later.spent_alpha == pytest.approx(spent_alpha(0.55, 0.05, "obrien-fleming"), rel=1e-12)


# --- Student's t at huge df, far tails --------------------------------------------------------


def _t_sf_mpmath(t: float, df: float) -> float:
    mp = pytest.importorskip("mpmath", reason="mpmath (torch's sympy needs it) is the 50-digit reference")
    mp.mp.dps = 50
    x = mp.mpf(df) / (mp.mpf(df) + mp.mpf(t) ** 2)
    tail = mp.betainc(mp.mpf(df) / 2, mp.mpf(1) / 2, 0, x, regularized=True) / 2
    return float(tail if t > 0 else 1 - tail)


@pytest.mark.parametrize("df", [1e10, 1e12, 1e15, 1e20])
def test_student_t_at_huge_df_against_mpmath(df: float) -> None:
    """The old code lost ~6e-17·df relatively (6e-5 at 1e12, 93% at 1e15: t_ppf(0.975, 1e15)
    was 1.9712) and divided by zero at 1e20."""
    rng = np.random.default_rng()
    for t in [*rng.uniform(-5.0, 5.0, size=4), 8.0, 20.0]:
        assert D.t_sf(t, df) == pytest.approx(_t_sf_mpmath(t, df), rel=1e-9)
    assert D.nct_sf(1.5, df, 0.0) == pytest.approx(_t_sf_mpmath(1.5, df), rel=1e-7)


@pytest.mark.parametrize("df", [1e10, 1e15, 1e20, 1e300])
def test_student_t_quantile_at_huge_df_is_the_normal_one(df: float) -> None:
    """The t quantile at huge df differs from z by z(z² + 1)/(4·df): below 1e-9 here."""
    assert D.t_ppf(0.975, df) == pytest.approx(1.959963984540054, abs=1e-9)  # z_0.975
    for p in (1e-12, 0.3):
        assert D.t_cdf(D.t_ppf(p, df), df) == pytest.approx(p, rel=1e-10)


def test_student_t_density_at_huge_df_is_the_normal_density() -> None:
    """lgamma((df+1)/2) − lgamma(df/2) cancelled every digit at df = 1e20; the density there
    equals φ(t) (1 − O(1/df))."""
    for t in (0.0, 1.0, 3.0):
        assert D.t_pdf(t, 1e20) == pytest.approx(math.exp(-0.5 * t * t) / math.sqrt(2 * math.pi), rel=1e-12)


@pytest.mark.parametrize("df", [2.0, 3.0, 10.0])
def test_t_quantile_where_the_density_underflows(df: float) -> None:
    """p = 1e-300 at df = 2: the old Newton step divided by a density that had underflowed to 0
    (ZeroDivisionError). For df = 2 the quantile has a closed form: t = (2p − 1)/sqrt(2p(1 − p))."""
    t = D.t_ppf(1e-300, df)
    assert t < 0 and math.isfinite(t)
    assert D.t_cdf(t, df) == pytest.approx(1e-300, rel=1e-9)
    if df == 2.0:
        p = 1e-300
        assert t == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-12)


def test_power_at_huge_sample_sizes() -> None:
    """The noncentral t's normalising constant cancelled (lgamma(df/2) ≈ 1.3e13 at df = 1e12),
    so power at 5e11 per arm was off by 1e-3. With sd 1 and n per arm the noncentrality is
    effect·sqrt(n/2); at df this large power equals the normal one to 1e-9."""
    n = 5 * 10**11
    effect = 2.8 / math.sqrt(n / 2)
    result = power_welch(effect, 1.0, 1.0, n, n)
    z = 1.959963984540054
    normal = 0.5 * math.erfc((z - 2.8) / math.sqrt(2)) + 0.5 * math.erfc((z + 2.8) / math.sqrt(2))
    assert result.power == pytest.approx(normal, rel=1e-9)
