"""Welch's t, Mann–Whitney U and TOST against scipy/statsmodels on many seeded random cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats as st

from torchhal.evaluation.stats import mann_whitney_u, tost, welch_t_test
from torchhal.hal_core.errors import InvalidArgumentError

ALTERNATIVES = ("two-sided", "less", "greater")


def _random_pair(rng: np.random.Generator, max_size: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Two samples of odd-or-even random sizes, shifted and scaled differently, some heavy-tailed."""
    n_a, n_b = (int(v) for v in rng.integers(2, max_size, size=2))
    a = rng.normal(rng.normal(), rng.uniform(0.1, 3.0), n_a)
    b = rng.standard_t(3, n_b) * rng.uniform(0.1, 3.0) + rng.normal()
    return a, b


def test_welch_matches_scipy() -> None:
    rng = np.random.default_rng(1947)
    for case in range(300):
        a, b = _random_pair(rng)
        alternative = ALTERNATIVES[case % 3]
        mine = welch_t_test(a, b, alternative, confidence=0.9)
        ref = st.ttest_ind(a, b, equal_var=False, alternative=alternative)
        assert mine.statistic == pytest.approx(ref.statistic, rel=1e-9, abs=1e-12)
        assert mine.df == pytest.approx(ref.df, rel=1e-9)
        assert mine.p_value == pytest.approx(ref.pvalue, abs=1e-10, rel=1e-6)
        ci = ref.confidence_interval(0.9)
        assert mine.interval[0] == pytest.approx(ci.low, rel=1e-9, abs=1e-9)
        assert mine.interval[1] == pytest.approx(ci.high, rel=1e-9, abs=1e-9)
        assert (mine.n_a, mine.n_b) == (a.size, b.size)


def test_welch_with_one_constant_sample_uses_the_other_variance() -> None:
    rng = np.random.default_rng(11)
    a, b = rng.normal(1.0, 1.0, 9), np.full(6, 0.25)
    mine = welch_t_test(a, b)
    t = (a.mean() - 0.25) / (a.std(ddof=1) / math.sqrt(a.size))  # a one-sample t-test against 0.25
    assert mine.df == pytest.approx(a.size - 1)
    assert mine.statistic == pytest.approx(t, rel=1e-12)
    assert mine.p_value == pytest.approx(2 * st.t.sf(abs(t), a.size - 1), rel=1e-9)


def test_welch_refuses_two_constant_samples() -> None:
    with pytest.raises(InvalidArgumentError, match="both samples are constant"):
        welch_t_test([2.0, 2.0, 2.0], [3.0, 3.0])


@pytest.mark.parametrize("method", ["asymptotic", "exact", "auto"])
def test_mann_whitney_matches_scipy_without_ties(method: str) -> None:
    rng = np.random.default_rng(1945 + len(method))
    for case in range(200):
        max_size = 12 if method == "exact" else 60
        a, b = (rng.normal(size=int(n)) for n in rng.integers(1, max_size, size=2))
        b = b + rng.normal(0.0, 0.7)
        alternative = ALTERNATIVES[case % 3]
        mine = mann_whitney_u(a, b, alternative, method=method)
        ref = st.mannwhitneyu(a, b, alternative=alternative, method=method)
        assert mine.statistic == ref.statistic
        assert mine.p_value == pytest.approx(ref.pvalue, abs=1e-12, rel=1e-9)
        assert mine.prob_superiority == pytest.approx(ref.statistic / (a.size * b.size))


def test_mann_whitney_auto_picks_like_scipy() -> None:
    small_no_ties = mann_whitney_u([1.0, 2.5, 3.0], np.arange(20.0) + 0.1)
    small_with_ties = mann_whitney_u([1.0, 2.0, 3.0], np.arange(20.0))
    both_large = mann_whitney_u(np.arange(9.0), np.arange(9.0) + 0.5)
    assert (small_no_ties.method, small_with_ties.method, both_large.method) == (
        "exact",
        "asymptotic",
        "asymptotic",
    )


def test_mann_whitney_matches_scipy_with_ties() -> None:
    rng = np.random.default_rng(1947)
    for case in range(200):
        a = rng.integers(0, 6, size=int(rng.integers(3, 50))).astype(float)
        b = rng.integers(0, 7, size=int(rng.integers(3, 50))).astype(float)
        alternative = ALTERNATIVES[case % 3]
        mine = mann_whitney_u(a, b, alternative, method="asymptotic")
        ref = st.mannwhitneyu(a, b, alternative=alternative, method="asymptotic")
        assert mine.statistic == ref.statistic
        assert mine.p_value == pytest.approx(ref.pvalue, abs=1e-12, rel=1e-9)


def test_mann_whitney_exact_refuses_ties() -> None:
    with pytest.raises(InvalidArgumentError, match="no ties"):
        mann_whitney_u([1.0, 2.0, 2.0], [2.0, 3.0], method="exact")


def test_mann_whitney_all_equal_is_p_one() -> None:
    result = mann_whitney_u([4.0] * 5, [4.0] * 7, method="asymptotic")
    assert result.p_value == 1.0
    assert result.p_value == st.mannwhitneyu([4.0] * 5, [4.0] * 7, method="asymptotic").pvalue


def test_tost_matches_statsmodels() -> None:
    weightstats = pytest.importorskip(
        "statsmodels.stats.weightstats", reason="statsmodels is the TOST reference (dev dependency)"
    )
    rng = np.random.default_rng(1987)
    for _ in range(200):
        a, b = _random_pair(rng)
        low = -abs(float(rng.normal(0.5, 0.5)))
        high = abs(float(rng.normal(0.5, 0.5))) + 1e-3
        mine = tost(a, b, low, high)
        p, lower, upper = weightstats.ttost_ind(a, b, low, high, usevar="unequal")
        assert mine.p_value == pytest.approx(p, abs=1e-10, rel=1e-7)
        assert mine.p_lower == pytest.approx(lower[1], abs=1e-10, rel=1e-7)
        assert mine.p_upper == pytest.approx(upper[1], abs=1e-10, rel=1e-7)


def test_tost_decision_agrees_with_the_1_minus_2alpha_interval() -> None:
    rng = np.random.default_rng(5)
    decisions = set()
    for _ in range(300):
        a, b = _random_pair(rng, max_size=40)
        result = tost(a, b, -0.8, 0.9, alpha=0.05)
        inside = -0.8 < result.interval[0] and result.interval[1] < 0.9
        assert result.equivalent == inside
        ref = st.ttest_ind(a, b, equal_var=False).confidence_interval(0.9)
        assert result.interval == pytest.approx((ref.low, ref.high), rel=1e-9, abs=1e-9)
        decisions.add(result.equivalent)
    assert decisions == {True, False}  # the cases exercised both outcomes


def test_tost_relative_bounds_scale_by_baseline_mean() -> None:
    rng = np.random.default_rng(8)
    a, b = rng.normal(100.5, 1.0, 31), rng.normal(100.0, 1.0, 29)
    relative = tost(a, b, -0.02, 0.02, relative=True)
    absolute = tost(a, b, -0.02 * b.mean(), 0.02 * b.mean())
    assert relative.bounds == pytest.approx(absolute.bounds)
    assert relative.p_value == pytest.approx(absolute.p_value)
    with pytest.raises(InvalidArgumentError, match="mean\\(b\\) > 0"):
        tost(a, -b, -0.02, 0.02, relative=True)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: welch_t_test([1.0], [1.0, 2.0]), "sample 'a' needs at least 2 values, got 1"),
        (lambda: welch_t_test([1.0, 2.0], []), "sample 'b' needs at least 2 values, got 0"),
        (lambda: welch_t_test([1.0, math.nan, 3.0], [1.0, 2.0]), "sample 'a' must be finite; index 1 is nan"),
        (
            lambda: mann_whitney_u([1.0, 2.0], [0.0, 1.0, math.inf]),
            "sample 'b' must be finite; index 2 is inf",
        ),
        (lambda: welch_t_test([1.0, 2.0], [1.0, 3.0], "bigger"), "alternative must be one of"),
        (lambda: welch_t_test(np.ones((2, 2)), [1.0, 3.0]), "must be 1-D"),
        (lambda: welch_t_test(["fast", "slow"], [1.0, 3.0]), "sample 'a' must be numbers"),
        (lambda: mann_whitney_u([1.0], [2.0], method="magic"), "method must be one of"),
        (lambda: tost([1.0, 2.0], [1.0, 3.0], 1.0, -1.0), "low < high"),
        (lambda: welch_t_test([1.0, 2.0], [1.0, 3.0], confidence=1.5), "confidence must lie strictly"),
    ],
)
def test_bad_input_is_named(call, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message.replace("(", "\\(").replace(")", "\\)")):
        call()
