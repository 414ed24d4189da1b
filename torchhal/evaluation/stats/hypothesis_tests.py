"""Two-sample tests on per-run aggregates: Welch's t, Mann–Whitney U, and TOST for equivalence.

Every function takes sample `a` (candidate) and sample `b` (baseline); differences are a − b.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchhal.evaluation.stats import _checks
from torchhal.evaluation.stats.distributions import mann_whitney_sf, norm_sf, t_cdf, t_ppf, t_sf
from torchhal.hal_core.errors import InvalidArgumentError

MW_METHODS = ("auto", "exact", "asymptotic")
_EXACT_MAX_SMALLER_SIZE = 8  # scipy's rule: exact when a sample has at most 8 values and no ties


@dataclass(frozen=True, slots=True)
class WelchResult:
    """Welch's t statistic for mean(a) − mean(b), its Welch–Satterthwaite df, p-value and interval."""

    statistic: float
    df: float
    p_value: float
    difference: float
    standard_error: float
    interval: tuple[float, float]
    confidence: float
    alternative: str
    n_a: int
    n_b: int


@dataclass(frozen=True, slots=True)
class MannWhitneyResult:
    """U of sample a (pairs with a > b, ties counting ½), its p-value, and U / (n_a·n_b) = P(A > B)."""

    statistic: float
    p_value: float
    prob_superiority: float
    method: str
    alternative: str
    n_a: int
    n_b: int


@dataclass(frozen=True, slots=True)
class TostResult:
    """Two one-sided Welch tests: a − b lies inside (low, high) when `p_value` < alpha."""

    p_value: float
    p_lower: float
    p_upper: float
    equivalent: bool
    difference: float
    interval: tuple[float, float]
    bounds: tuple[float, float]
    alpha: float
    df: float
    n_a: int
    n_b: int


def _welch_parts(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """(mean(a) − mean(b), its standard error, Welch–Satterthwaite df).

    Computed on both samples divided by a power of two near their largest magnitude (exact), so
    the squares neither underflow (values ~1e-300: variances of 0, and ZeroDivisionError) nor
    overflow (~1e300: a df of NaN); the df is taken from the variances' shares, free of squares.
    """
    # constant up to rounding, not exactly: 10 copies of 43.1 have a variance of ~1e-29, which
    # gave t = −4e13 against 10 copies of 43.2, and TOST called two constant samples equivalent
    if _checks.constant(a) and _checks.constant(b):
        raise InvalidArgumentError(
            f"Welch's t needs variance in at least one sample; both samples are constant "
            f"(a = {float(a[0])!r} × {a.size}, b = {float(b[0])!r} × {b.size})"
        )
    largest = float(max(np.abs(a).max(), np.abs(b).max()))
    scale = math.ldexp(1.0, math.frexp(largest)[1] - 1)  # values within ±2: 2^1024 would overflow
    va, vb = (a / scale).var(ddof=1) / a.size, (b / scale).var(ddof=1) / b.size
    if va + vb == 0.0:
        raise InvalidArgumentError(
            f"Welch's t: the varying sample's spread is below 1e-154 of the other's magnitude "
            f"({largest!r}), too small to square in floating point (a spans {float(np.ptp(a))!r}, "
            f"b spans {float(np.ptp(b))!r}); rescale the values"
        )
    share_a, share_b = va / (va + vb), vb / (va + vb)
    df = 1.0 / (share_a**2 / (a.size - 1) + share_b**2 / (b.size - 1))
    difference = float((a / scale).mean() - (b / scale).mean()) * scale
    return difference, math.sqrt(va + vb) * scale, float(df)


def welch_t_test(a: Any, b: Any, alternative: str = "two-sided", *, confidence: float = 0.95) -> WelchResult:
    """Welch's unequal-variance t-test (Welch 1947) with the Welch–Satterthwaite df.

    'less' tests mean(a) < mean(b), 'greater' mean(a) > mean(b); the interval for the difference
    is one-sided for one-sided alternatives, as scipy's `ttest_ind(...).confidence_interval()`.
    Both samples constant (up to rounding, `_checks.ROUNDING_RTOL`) raises InvalidArgumentError:
    t is 0/0 there.
    """
    a = _checks.sample(a, "a", min_size=2)
    b = _checks.sample(b, "b", min_size=2)
    _checks.alternative(alternative)
    confidence = _checks.probability(confidence, "confidence")
    diff, se, df = _welch_parts(a, b)
    t = diff / se
    if alternative == "two-sided":
        p = min(1.0, 2.0 * t_sf(abs(t), df))
        half = t_ppf(0.5 + 0.5 * confidence, df) * se
        interval = (diff - half, diff + half)
    elif alternative == "less":
        p = t_cdf(t, df)
        interval = (-math.inf, diff + t_ppf(confidence, df) * se)
    else:
        p = t_sf(t, df)
        interval = (diff - t_ppf(confidence, df) * se, math.inf)
    return WelchResult(t, df, p, diff, se, interval, confidence, alternative, a.size, b.size)


def average_ranks(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(1-based ranks with ties averaged, the size of every tie group)."""
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return (ends - 0.5 * (counts - 1))[inverse], counts


def exact_by_default(m: int, n: int, has_ties: bool) -> bool:
    """scipy's "auto" rule: the exact U distribution when a sample has <= 8 values and no ties."""
    return min(m, n) <= _EXACT_MAX_SMALLER_SIZE and not has_ties


def u_null_sd(m: int, n: int, ties: np.ndarray) -> float:
    """The standard deviation of U under the null, corrected for tie groups of sizes `ties`."""
    total = m + n
    tie_term = float((ties**3 - ties).sum()) / (total * (total - 1))
    return math.sqrt(m * n / 12.0 * ((total + 1) - tie_term))


def mann_whitney_u(
    a: Any, b: Any, alternative: str = "two-sided", *, method: str = "auto"
) -> MannWhitneyResult:
    """The Mann–Whitney U test (Mann & Whitney 1947), defined as scipy's `mannwhitneyu`.

    "asymptotic": normal approximation with tie-corrected variance and continuity correction;
    "exact": the exact null distribution, valid only without ties (ties raise);
    "auto": exact when the smaller sample has at most 8 values and there are no ties.
    'greater' means a tends to exceed b. When every value is the same the tie-corrected variance
    is 0 and the documented answer is p = 1 (no evidence of a shift), as scipy gives.
    """
    a = _checks.sample(a, "a", min_size=1)
    b = _checks.sample(b, "b", min_size=1)
    _checks.alternative(alternative)
    if method not in MW_METHODS:
        raise InvalidArgumentError(f"method must be one of {MW_METHODS}, got {method!r}")
    m, n = a.size, b.size
    ranks, ties = average_ranks(np.concatenate([a, b]))
    u_a = float(ranks[:m].sum() - m * (m + 1) / 2.0)
    u_b = m * n - u_a
    has_ties = bool((ties > 1).any())
    if method == "auto":
        method = "exact" if exact_by_default(m, n, has_ties) else "asymptotic"
    if method == "exact" and has_ties:
        raise InvalidArgumentError(
            f"the exact Mann–Whitney distribution assumes no ties; the samples hold "
            f"{int((ties > 1).sum())} tied value(s); use method='asymptotic'"
        )
    u, factor = {"greater": (u_a, 1.0), "less": (u_b, 1.0), "two-sided": (max(u_a, u_b), 2.0)}[alternative]
    if method == "exact":
        p = mann_whitney_sf(round(u), m, n)
    else:
        sd = u_null_sd(m, n, ties)
        numerator = u - m * n / 2.0 - 0.5
        p = 1.0 if sd == 0.0 else norm_sf(numerator / sd)
    return MannWhitneyResult(u_a, min(1.0, factor * p), u_a / (m * n), method, alternative, m, n)


def tost(
    a: Any, b: Any, low: float, high: float, *, relative: bool = False, alpha: float = 0.05
) -> TostResult:
    """Schuirmann's (1987) two one-sided tests: is low < mean(a) − mean(b) < high?

    Each bound is tested with a one-sided Welch test; p = max of the two. `interval` is the
    (1 − 2·alpha) Welch interval, which lies inside (low, high) exactly when `equivalent`.
    With `relative=True` the bounds are fractions of mean(b) (e.g. −0.02, 0.02 for ±2 %), taking
    mean(b) as known, the usual practice for relative margins; mean(b) must then be > 0.
    Both samples constant (up to rounding) raises InvalidArgumentError, as in `welch_t_test`.
    """
    a = _checks.sample(a, "a", min_size=2)
    b = _checks.sample(b, "b", min_size=2)
    alpha = _checks.probability(alpha, "alpha")
    if alpha >= 0.5:
        raise InvalidArgumentError(f"TOST needs alpha < 0.5, got {alpha}")
    low, high = _checks.finite_number(low, "low"), _checks.finite_number(high, "high")
    if not low < high:
        raise InvalidArgumentError(f"TOST needs low < high, got low={low}, high={high}")
    if relative:
        reference = float(b.mean())
        if reference <= 0.0:
            raise InvalidArgumentError(f"relative TOST bounds need mean(b) > 0, got {reference}")
        low, high = low * reference, high * reference
    diff, se, df = _welch_parts(a, b)
    p_lower = t_sf((diff - low) / se, df)  # H0: diff <= low
    p_upper = t_cdf((diff - high) / se, df)  # H0: diff >= high
    half = t_ppf(1.0 - alpha, df) * se
    p = max(p_lower, p_upper)
    return TostResult(
        p,
        p_lower,
        p_upper,
        p < alpha,
        diff,
        (diff - half, diff + half),
        (low, high),
        alpha,
        df,
        a.size,
        b.size,
    )
