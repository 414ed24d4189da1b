"""Eighteenth-session sweep of the statistics engine: Benjamini–Hochberg at exact ties with its
threshold, group-sequential looks closer together than the grid resolves, and Student's t (and
the noncentral t under power) at huge degrees of freedom and in the far tails."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from torchhal.evaluation.stats import (
    Decision,
    GroupSequentialTest,
    benjamini_hochberg,
    group_boundaries,
    power_welch,
)
from torchhal.evaluation.stats import distributions as D
from torchhal.evaluation.stats.group_sequential import spent_alpha

# --- Benjamini–Hochberg -----------------------------------------------------------------------


def _bh_by_hand(p: list[float], alpha: float) -> tuple[list[Fraction], list[bool]]:
    """BH in exact rational arithmetic on the p-values' binary values: adjusted_(i) =
    min_{j>=i} m·p_(j)/j; reject the k smallest, k the largest j with p_(j) <= j·alpha/m."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    exact = [Fraction(p[i]) * m / j for j, i in enumerate(order, start=1)]
    for j in range(m - 2, -1, -1):
        exact[j] = min(exact[j], exact[j + 1])
    k = max((j for j in range(1, m + 1) if Fraction(p[order[j - 1]]) * m <= Fraction(alpha) * j), default=0)
    adjusted, reject = [Fraction(0)] * m, [False] * m
    for rank, i in enumerate(order):
        adjusted[i], reject[i] = min(exact[rank], Fraction(1)), rank < k
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
        assert result.adjusted == tuple(float(v) for v in adjusted), p
        assert result.reject == tuple(reject), (p, alpha)


# --- group-sequential looks closer than the grid resolves ------------------------------------


def test_a_look_right_after_another_is_deferred_not_a_collapsed_boundary() -> None:
    """A look 1e-7 of the information after the previous one: the old code sampled a kernel far
    narrower than its grid and returned a boundary of 0.047 (nearly every path rejects there)."""
    close = group_boundaries([0.5, 0.5000001, 1.0])
    apart = group_boundaries([0.5, 1.0])
    assert close[1] == math.inf
    assert close[0] == apart[0] and close[2] == pytest.approx(apart[1], abs=1e-12)
    assert group_boundaries([0.999999, 1.0])[1] == math.inf


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
    deferred (infinite boundary, nothing spent, no decision), and the next real step looks."""
    rng = np.random.default_rng()
    test = GroupSequentialTest(max_samples=100_000, higher_is_better=True)
    first = test.update(rng.normal(size=50_000), rng.normal(size=50_000))
    for _ in range(3):
        state = test.update(rng.normal(size=1), rng.normal(size=1))
        assert state.boundary == math.inf and state.spent_alpha == first.spent_alpha
        assert state.decision is Decision.CONTINUE
    later = test.update(rng.normal(size=4_997), rng.normal(size=4_997))
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
