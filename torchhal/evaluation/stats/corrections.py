"""Multiple-comparison corrections: adjusted p-values for a family of tests run together.

Each adjusted value is the exact p·k (Holm) or m·p/j (Benjamini–Hochberg) rounded once to the
nearest float, as `Fraction` arithmetic would give it, and the rejections follow each method's
rule exactly (p_(j) <= α/k, p_(j) <= j·α/m) on the binary values of p and α. Both come from
vectorised float arithmetic with error-free products; only entries whose rounding or whose
comparison with α the floats cannot settle go through `Fraction` (a handful in a million).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from torchhal.evaluation.stats import _checks

_SPLITTER = 2.0**27 + 1.0  # Veltkamp's constant: splits a double into two 26-bit halves
_TINY = 2.0**-900  # below this the error-free product may underflow: such entries go exact
_MIDPOINT_MARGIN = 2.0**-20  # of half an ulp; the float residual is good to ~2^-47 of it


@dataclass(frozen=True, slots=True)
class CorrectedPValues:
    """Adjusted p-values in the input's order, and which hypotheses are rejected at `alpha`."""

    adjusted: tuple[float, ...]
    reject: tuple[bool, ...]
    alpha: float
    method: str


def _split(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = _SPLITTER * a
    high = t - (t - a)
    return high, a - high


def _two_product(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) with hi + lo = a·b exactly (Dekker 1971), for products far above underflow."""
    hi = a * b
    (a1, a2), (b1, b2) = _split(a), _split(b)
    return hi, ((a1 * b1 - hi) + a1 * b2 + a2 * b1) + a2 * b2


def _scaled(p: np.ndarray, numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """x = p·numerator/denominator rounded once (integers below 2^53), as float(Fraction(p)·n/d).

    The product is carried exactly as hi + lo; q = hi/d and the residual of q·d, taken exactly
    too, give x − q to ~2^-100 of x, so x's nearest float is settled unless x lies within
    2^-20 of half an ulp of a rounding midpoint; those few entries (and tiny ones) go exact.
    """
    hi, lo = _two_product(p, numerator)
    q = hi / denominator
    q_hi, q_lo = _two_product(q, denominator)
    gap = (((hi - q_hi) - q_lo) + lo) / denominator  # x − q
    rounded: np.ndarray = q + gap  # numpy's stubs make ndarray / ndarray Any
    off = (q - rounded) + gap  # x − rounded, within half an ulp of rounded
    up = np.nextafter(rounded, np.inf) - rounded
    down = rounded - np.nextafter(rounded, -np.inf)
    limit = 0.5 - _MIDPOINT_MARGIN
    unsure = (off > limit * up) | (-off > limit * down) | ((hi < _TINY) & (p > 0))
    for i in np.flatnonzero(unsure):
        rounded[i] = float(Fraction(float(p[i])) * int(numerator[i]) / int(denominator[i]))
    return rounded


def _at_most_alpha(
    p: np.ndarray, numerator: np.ndarray, denominator: np.ndarray, scaled: np.ndarray, alpha: float
) -> np.ndarray:
    """x = p·n/d <= alpha exactly, given x rounded once (`scaled`).

    The rounding settles it unless x rounded to alpha; there p·n and alpha·d are compared as
    error-free products (hi, lo), lexicographically, which is exact: hi is the rounded product.
    """
    within = scaled < alpha
    tied = np.flatnonzero(scaled == alpha)
    left_hi, left_lo = _two_product(p[tied], numerator[tied])
    right_hi, right_lo = _two_product(np.full(tied.size, alpha), denominator[tied])
    within[tied] = (left_hi < right_hi) | ((left_hi == right_hi) & (left_lo <= right_lo))
    for i in tied[np.minimum(left_hi, right_hi) < _TINY]:  # the products may underflow: exactly
        within[i] = Fraction(float(p[i])) * int(numerator[i]) <= Fraction(alpha) * int(denominator[i])
    return within


def _result(
    order: np.ndarray, adjusted_sorted: np.ndarray, reject_sorted: np.ndarray, alpha: float, method: str
) -> CorrectedPValues:
    adjusted = np.empty_like(adjusted_sorted)
    adjusted[order] = np.minimum(adjusted_sorted, 1.0)
    reject = np.empty_like(reject_sorted)
    reject[order] = reject_sorted
    return CorrectedPValues(tuple(adjusted.tolist()), tuple(reject.tolist()), alpha, method)


def holm(pvalues: Sequence[float] | np.ndarray, alpha: float = 0.05) -> CorrectedPValues:
    """Holm's (1979) step-down adjustment; controls the family-wise error rate.

    For sorted p_(1) <= ... <= p_(m): adj_(i) = max_{j<=i} min(1, (m − j + 1)·p_(j)), as
    statsmodels' `multipletests(method="holm")` defines it; H_(i) is rejected when
    p_(j) <= α/(m − j + 1) for every j <= i.
    """
    p = _checks.pvalues(pvalues)
    alpha = _checks.probability(alpha, "alpha")
    order = np.argsort(p, kind="stable")
    m = p.size
    p_sorted, factor, one = p[order], np.arange(m, 0, -1, dtype=np.float64), np.ones(m)
    stepped = _scaled(p_sorted, factor, one)
    reject = np.logical_and.accumulate(_at_most_alpha(p_sorted, factor, one, stepped, alpha))
    return _result(order, np.maximum.accumulate(stepped), reject, alpha, "holm")


def benjamini_hochberg(pvalues: Sequence[float] | np.ndarray, alpha: float = 0.05) -> CorrectedPValues:
    """Benjamini & Hochberg's (1995) step-up adjustment; controls the false discovery rate.

    For sorted p-values: adj_(i) = min_{j>=i} min(1, m·p_(j)/j), as statsmodels'
    `multipletests(method="fdr_bh")` defines it; the k smallest are rejected, k the largest j
    with p_(j) <= j·α/m. Valid for independent or positively dependent tests.
    """
    p = _checks.pvalues(pvalues)
    alpha = _checks.probability(alpha, "alpha")
    order = np.argsort(p, kind="stable")
    m = p.size
    # m·p/j rounded once: in floats (p·m)/j rounds twice, and p = 0.05 at rank j = m came out
    # 0.05000000000000001, not rejected at alpha = 0.05 although p_(j) <= j·alpha/m holds.
    p_sorted, size, rank = p[order], np.full(m, float(m)), np.arange(1, m + 1, dtype=np.float64)
    scaled = _scaled(p_sorted, size, rank)
    within = _at_most_alpha(p_sorted, size, rank, scaled, alpha)
    reject = np.logical_or.accumulate(within[::-1])[::-1]
    return _result(order, np.minimum.accumulate(scaled[::-1])[::-1], reject, alpha, "benjamini-hochberg")
