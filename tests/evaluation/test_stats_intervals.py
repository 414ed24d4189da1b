"""Hodges–Lehmann and order-statistic quantile intervals: definitions, duality with the
Mann–Whitney test, scipy's `quantile_test` intervals, and coverage by simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats as st

from torchhal.evaluation.stats import hodges_lehmann_shift, quantile_ci
from torchhal.evaluation.stats.intervals import minimum_size_for_quantile_ci
from torchhal.hal_core.errors import InvalidArgumentError


def test_hodges_lehmann_shift_is_the_median_of_pairwise_differences() -> None:
    rng = np.random.default_rng(1963)
    for _ in range(50):
        a = rng.exponential(2.0, int(rng.integers(5, 40)))
        b = rng.exponential(1.0, int(rng.integers(5, 40)))
        differences = [x - y for x in a for y in b]
        assert hodges_lehmann_shift(a, b).shift == pytest.approx(float(np.median(differences)), rel=1e-12)


@pytest.mark.parametrize(("m", "n"), [(4, 5), (6, 8), (8, 11), (3, 25)])
def test_exact_interval_is_dual_to_the_exact_mann_whitney_test(m: int, n: int) -> None:
    """Δ lies outside the interval exactly when the exact U test of (a − Δ, b) rejects at 1 − confidence."""
    rng = np.random.default_rng(m * 100 + n)
    a, b = rng.normal(0.7, 1.0, m), rng.normal(0.0, 1.0, n)
    result = hodges_lehmann_shift(a, b, confidence=0.9)
    assert result.method == "exact"
    low, high = result.interval
    alpha = 1.0 - result.coverage
    for delta, inside in [(low - 1e-9, False), (low + 1e-9, True), (high - 1e-9, True), (high + 1e-9, False)]:
        p = st.mannwhitneyu(a - delta, b, method="exact").pvalue
        assert (p > alpha + 1e-12) == inside, (delta, p, alpha)
    assert result.coverage >= 0.9


def test_asymptotic_interval_uses_the_normal_critical_count() -> None:
    rng = np.random.default_rng(3)
    a, b = rng.normal(0.4, 1.0, 40), rng.normal(0.0, 1.0, 35)
    result = hodges_lehmann_shift(a, b, confidence=0.95)
    assert result.method == "asymptotic"
    differences = np.sort(np.subtract.outer(a, b).ravel())
    k = math.floor(40 * 35 / 2 + 0.5 - 1.959963984540054 * math.sqrt(40 * 35 * 76 / 12))
    assert result.interval == (differences[k - 1], differences[40 * 35 - k])
    assert result.coverage == pytest.approx(0.95, abs=0.002)


def test_hodges_lehmann_interval_coverage_by_simulation() -> None:
    rng = np.random.default_rng(1975)
    sims, true_shift, hits = 2000, 0.3, 0
    for _ in range(sims):
        a = rng.exponential(1.0, 15) + true_shift
        b = rng.exponential(1.0, 12)
        low, high = hodges_lehmann_shift(a, b, confidence=0.9).interval
        hits += low <= true_shift <= high
    coverage, se = hits / sims, math.sqrt(0.9 * 0.1 / sims)
    assert coverage >= 0.9 - 3 * se, f"coverage {coverage:.4f} below 0.9 by more than 3 SE ({se:.4f})"


def test_hodges_lehmann_too_small_or_degenerate() -> None:
    with pytest.raises(InvalidArgumentError, match="too small"):
        hodges_lehmann_shift([1.0, 2.0], [0.5, 0.7, 0.9])  # C(5, 2) = 10 orderings < 40
    with pytest.raises(InvalidArgumentError, match="every value"):
        hodges_lehmann_shift([2.0] * 12, [2.0] * 10)


def test_quantile_interval_matches_scipy_quantile_test() -> None:
    rng = np.random.default_rng(1936)
    for q in (0.5, 0.9, 0.99):
        for _ in range(40):
            n = int(rng.integers(minimum_size_for_quantile_ci(q, 0.95), 3000))
            x = rng.lognormal(0.0, 1.0, n)
            mine = quantile_ci(x, q, 0.95)
            ref = st.quantile_test(x, p=q).confidence_interval(0.95)
            assert mine.interval == (ref.low, ref.high), (q, n)
            assert mine.estimate == np.quantile(x, q)
            lower, upper = mine.ranks
            exact = st.binom.cdf(upper - 1, n, q) - st.binom.cdf(lower - 1, n, q)
            assert mine.coverage == pytest.approx(exact, abs=1e-10)
            assert mine.coverage >= 0.95


@pytest.mark.parametrize(("q", "needed"), [(0.5, 6), (0.9, 36), (0.99, 368)])
def test_quantile_interval_minimum_size(q: float, needed: int) -> None:
    assert minimum_size_for_quantile_ci(q, 0.95) == needed
    rng = np.random.default_rng(needed)
    quantile_ci(rng.normal(size=needed), q)
    with pytest.raises(InvalidArgumentError, match=f"at least {needed} values, got {needed - 1}"):
        quantile_ci(rng.normal(size=needed - 1), q)


@pytest.mark.parametrize("q", [0.5, 0.9, 0.99])
def test_quantile_interval_coverage_by_simulation(q: float) -> None:
    rng = np.random.default_rng(int(q * 1000))
    sims, n = 2000, 400
    samples = rng.exponential(1.0, size=(sims, n))
    truth = -math.log1p(-q)  # the exponential's q-quantile
    template = quantile_ci(samples[0], q)
    lower, upper = template.ranks  # ranks depend on n and q only
    ordered = np.sort(samples, axis=1)
    coverage = float(np.mean((ordered[:, lower - 1] <= truth) & (truth <= ordered[:, upper - 1])))
    se = math.sqrt(0.95 * 0.05 / sims)
    assert coverage >= 0.95 - 3 * se, f"coverage {coverage:.4f} < 0.95 − 3·SE ({se:.4f}) for q={q}"
    assert coverage == pytest.approx(
        template.coverage, abs=4 * math.sqrt(template.coverage * (1 - template.coverage) / sims)
    )
