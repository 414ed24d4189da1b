"""The special functions and distributions written for the statistics engine, against scipy/mpmath."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.special as sc
import scipy.stats as st

from torchhal.evaluation.stats import distributions as dist
from torchhal.evaluation.stats import special
from torchhal.hal_core.errors import InvalidArgumentError


def _log_uniform(rng: np.random.Generator, low_exp: float, high_exp: float) -> float:
    return float(10 ** rng.uniform(low_exp, high_exp))


def test_betainc_matches_scipy_to_1e10() -> None:
    rng = np.random.default_rng(20240611)
    for _ in range(2000):
        a, b = _log_uniform(rng, -2, 4), _log_uniform(rng, -2, 4)
        x = float(rng.uniform())
        value, complement = special.betainc(a, b, x)
        assert value == pytest.approx(sc.betainc(a, b, x), abs=1e-10, rel=1e-9), (a, b, x)
        assert complement == pytest.approx(sc.betaincc(a, b, x), abs=1e-10, rel=1e-9), (a, b, x)


def test_betainc_keeps_tiny_tails_relative() -> None:
    # Deep tails: the complement is computed directly, not as 1 − (something near 1).
    for a, b, x in [(0.5, 40.0, 0.9), (30.0, 2.5, 0.2), (200.0, 0.5, 0.5)]:
        value, complement = special.betainc(a, b, x)
        reference = sc.betainc(a, b, x) if value < 0.5 else sc.betaincc(a, b, x)
        mine = value if value < 0.5 else complement
        assert reference < 1e-8
        assert mine == pytest.approx(reference, rel=1e-9)


def test_log_beta_large_arguments_against_mpmath() -> None:
    mpmath = pytest.importorskip("mpmath", reason="mpmath is the high-precision reference for log B(a, b)")
    mpmath.mp.dps = 40
    rng = np.random.default_rng(7)
    for _ in range(300):
        a, b = _log_uniform(rng, -2, 8), _log_uniform(rng, -2, 8)
        reference = float(mpmath.log(mpmath.beta(a, b)))
        assert special.log_beta(a, b) == pytest.approx(reference, rel=1e-13, abs=1e-13), (a, b)


def test_gammainc_matches_scipy_to_1e10() -> None:
    rng = np.random.default_rng(99)
    for _ in range(2000):
        a = _log_uniform(rng, -1, 5)
        x = (
            max(0.0, a * (1 + 3 * rng.standard_normal() / math.sqrt(a)))
            if rng.uniform() < 0.7
            else _log_uniform(rng, -3, 5)
        )
        lower, upper = special.gammainc(a, x)
        assert lower == pytest.approx(sc.gammainc(a, x), abs=1e-10, rel=1e-9), (a, x)
        assert upper == pytest.approx(sc.gammaincc(a, x), abs=1e-10, rel=1e-9), (a, x)


@pytest.mark.parametrize(("a", "x"), [(0.0, 1.0), (-1.0, 1.0), (1.0, -0.5), (math.nan, 1.0)])
def test_gammainc_rejects_bad_arguments(a: float, x: float) -> None:
    with pytest.raises(InvalidArgumentError):
        special.gammainc(a, x)


@pytest.mark.parametrize(("a", "b", "x"), [(0.0, 1.0, 0.5), (1.0, 1.0, 1.5), (1.0, math.inf, 0.5)])
def test_betainc_rejects_bad_arguments(a: float, b: float, x: float) -> None:
    with pytest.raises(InvalidArgumentError):
        special.betainc(a, b, x)


def test_student_t_matches_scipy() -> None:
    rng = np.random.default_rng(3)
    for _ in range(600):
        df = _log_uniform(rng, 0, 6)
        t = float(rng.standard_normal() * 10 ** rng.uniform(-2, 2))
        assert dist.t_sf(t, df) == pytest.approx(st.t.sf(t, df), abs=1e-10, rel=1e-9), (t, df)
        assert dist.t_cdf(t, df) == pytest.approx(st.t.cdf(t, df), abs=1e-10, rel=1e-9), (t, df)
        p = float(rng.uniform(1e-9, 1 - 1e-9) if rng.uniform() < 0.8 else 10 ** -rng.uniform(1, 100))
        assert dist.t_ppf(p, df) == pytest.approx(st.t.ppf(p, df), rel=1e-9, abs=1e-9), (p, df)


def test_normal_and_chi2_and_binomial_match_scipy() -> None:
    rng = np.random.default_rng(4)
    for p in np.concatenate([10.0 ** -rng.uniform(1, 300, 50), rng.uniform(size=50)]):
        assert dist.norm_ppf(float(p)) == pytest.approx(st.norm.ppf(p), rel=1e-12, abs=1e-12)
    for _ in range(500):
        df = float(rng.integers(1, 200))
        x = float(rng.uniform(0, 3 * df + 10))
        assert dist.chi2_sf(x, df) == pytest.approx(st.chi2.sf(x, df), abs=1e-10, rel=1e-9)
        n = int(rng.integers(1, 5000))
        k = int(rng.integers(-1, n + 2))
        q = float(rng.uniform(0.001, 0.999))
        assert dist.binom_cdf(k, n, q) == pytest.approx(st.binom.cdf(k, n, q), abs=1e-10, rel=1e-9)


def test_noncentral_t_matches_scipy() -> None:
    rng = np.random.default_rng(5)
    compared = 0
    for _ in range(200):
        df = _log_uniform(rng, 0, 5)
        t = float(rng.standard_normal() * 4)
        nc = float(rng.standard_normal() * 4)
        reference_cdf, reference_sf = st.nct.cdf(t, df, nc), st.nct.sf(t, df, nc)
        if not (np.isfinite(reference_cdf) and np.isfinite(reference_sf)):
            continue  # scipy's own nct gives NaN in some far tails; nothing to compare against
        compared += 1
        assert dist.nct_cdf(t, df, nc) == pytest.approx(reference_cdf, abs=1e-9), (t, df, nc)
        assert dist.nct_sf(t, df, nc) == pytest.approx(reference_sf, abs=1e-9), (t, df, nc)
    assert compared >= 190


def _brute_force_u_counts(m: int, n: int) -> np.ndarray:
    """U over every placement of the m a-values among m + n tie-free positions."""
    counts = np.zeros(m * n + 1, dtype=np.int64)
    for a_positions in itertools.combinations(range(m + n), m):
        # U = pairs (a, b) with a above b = Σ over a of the b's below it.
        counts[sum(pos - i for i, pos in enumerate(a_positions))] += 1
    return counts


@pytest.mark.parametrize(("m", "n"), [(1, 1), (1, 6), (3, 4), (5, 5), (4, 9), (7, 6)])
def test_mann_whitney_counts_match_enumeration(m: int, n: int) -> None:
    np.testing.assert_array_equal(dist.mann_whitney_counts(m, n), _brute_force_u_counts(m, n))
    np.testing.assert_array_equal(dist.mann_whitney_counts(n, m), _brute_force_u_counts(m, n))


def test_mann_whitney_counts_beyond_int64_stay_exact() -> None:
    counts = dist.mann_whitney_counts(40, 45)  # C(85, 40) > 2^62: Python integers
    assert counts.dtype == object
    assert int(counts.sum()) == math.comb(85, 40)
    assert list(counts[:6]) == [1, 1, 2, 3, 5, 7]  # partitions of k, for k below both sizes
    np.testing.assert_array_equal(counts, counts[::-1])  # U and mn − U are equally likely
