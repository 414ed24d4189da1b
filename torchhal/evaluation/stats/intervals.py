"""Distribution-free intervals: the Hodges–Lehmann shift and order-statistic quantile intervals."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchhal.evaluation.stats import _checks
from torchhal.evaluation.stats.distributions import (
    binom_tails,
    lower_critical_count,
    mann_whitney_counts,
    norm_cdf,
    norm_ppf,
)
from torchhal.evaluation.stats.hypothesis_tests import average_ranks, exact_by_default, u_null_sd
from torchhal.hal_core.errors import InvalidArgumentError

MAX_PAIRWISE_DIFFERENCES = 10_000_000  # a·b differences are materialised: 80 MB at this cap


@dataclass(frozen=True, slots=True)
class HodgesLehmannResult:
    """The shift of a relative to b, its interval, and the interval's coverage by the U distribution."""

    shift: float
    interval: tuple[float, float]
    confidence: float
    coverage: float
    method: str
    n_a: int
    n_b: int


@dataclass(frozen=True, slots=True)
class QuantileInterval:
    """The sample quantile (numpy's default, linear) and the order-statistic interval around it."""

    q: float
    estimate: float
    interval: tuple[float, float]
    confidence: float
    coverage: float
    ranks: tuple[int, int]
    n: int


def hodges_lehmann_shift(a: Any, b: Any, *, confidence: float = 0.95) -> HodgesLehmannResult:
    """Median of the pairwise differences a_i − b_j (Hodges & Lehmann 1963) with its interval.

    The interval is [D_(k), D_(mn+1−k)] over the sorted differences, k the largest count with
    P(U <= k − 1) <= (1 − confidence)/2 under the Mann–Whitney null (Lehmann 1963).
    "exact" when the smaller sample has at most 8 values and there are no ties (`coverage` is
    then the exact coverage for continuous data), else "asymptotic": the normal approximation
    with tie-corrected variance and continuity correction (`coverage` approximate too).
    Samples too small for the confidence raise, naming what is needed; so do samples whose
    values are all equal (the interval is then undefined).
    """
    a = _checks.sample(a, "a", min_size=1)
    b = _checks.sample(b, "b", min_size=1)
    confidence = _checks.probability(confidence, "confidence")
    m, n = a.size, b.size
    if m * n > MAX_PAIRWISE_DIFFERENCES:
        raise InvalidArgumentError(
            f"Hodges–Lehmann materialises n_a·n_b pairwise differences, at most "
            f"{MAX_PAIRWISE_DIFFERENCES}; got {m}·{n} = {m * n}: aggregate runs first"
        )
    _, ties = average_ranks(np.concatenate([a, b]))
    if ties.size == 1:  # one tie group: U has no spread
        raise InvalidArgumentError(
            f"every value of a and b equals {a[0]!r}: the rank-based interval is undefined"
        )
    k, coverage, method = critical_count(m, n, confidence, ties)
    if k < 1:
        raise InvalidArgumentError(
            f"samples of sizes {m} and {n} are too small for a {confidence:.0%} Hodges–Lehmann "
            f"interval: even the widest covers less (critical count {k} < 1; tie-free samples "
            f"need C(n_a + n_b, n_a) >= {math.ceil(2.0 / (1.0 - confidence))}, these give "
            f"{math.comb(m + n, m)})"
        )
    differences = np.subtract.outer(a, b).ravel()
    lower_kth, upper_kth = k - 1, m * n - k
    ordered = np.partition(differences, [lower_kth, upper_kth])
    shift = float(np.median(differences))
    return HodgesLehmannResult(
        shift, (float(ordered[lower_kth]), float(ordered[upper_kth])), confidence, coverage, method, m, n
    )


def critical_count(
    m: int, n: int, confidence: float, ties: np.ndarray | None = None
) -> tuple[int, float, str]:
    """(k, coverage, method) of the `confidence` Hodges–Lehmann interval [D_(k), D_(mn+1−k)] for
    samples of sizes m and n whose pooled values form tie groups of sizes `ties` (None: no ties;
    not all one group). k < 1: the samples are too small for that confidence."""
    tail = 0.5 * (1.0 - confidence)
    ties = np.ones(m + n, dtype=np.int64) if ties is None else ties
    if exact_by_default(m, n, bool((ties > 1).any())):
        k = lower_critical_count(m, n, tail)
        below = int(np.sum(mann_whitney_counts(m, n)[:k])) / math.comb(m + n, m) if k else 0.0
        return k, 1.0 - 2.0 * below, "exact"
    sd = u_null_sd(m, n, ties)
    k = math.floor(m * n / 2.0 + 0.5 + norm_ppf(tail) * sd)
    return k, 1.0 - 2.0 * norm_cdf((k - 0.5 - m * n / 2.0) / sd), "asymptotic"


def quantile_ci(x: Any, q: float, confidence: float = 0.95) -> QuantileInterval:
    """Distribution-free interval [x_(l), x_(u)] for the q-quantile from the order statistics.

    The number of values below the true quantile is Binomial(n, q), so P(x_(l) <= ξ_q <= x_(u))
    >= B(u − 1) − B(l − 1) whatever the distribution (Thompson 1936; David & Nagaraja 2003, §7.1);
    l and u put at most (1 − confidence)/2 in each tail, so `coverage` >= confidence exactly. The
    rank search and the size check read the same tails (`binom_tails`): a confidence exactly at
    a tail gets the textbook interval (the median of 5 values at 0.9375: (x_(1), x_(5))). Too few
    values for that raises, naming the minimum sample size and the best confidence n allows.
    """
    q = _checks.probability(q, "q")
    confidence = _checks.probability(confidence, "confidence")
    tail = 0.5 * (1.0 - confidence)
    needed = minimum_size_for_quantile_ci(q, confidence)
    x = _checks.sample(x, "x", min_size=1)
    n = x.size
    if n < needed:
        worst = _widest_tail(n, q)
        raise InvalidArgumentError(
            f"a confidence of {confidence!r} for the {q!r} quantile needs at least {needed} values, "
            f"got {n}: even the widest interval, (x_(1), x_(n)), leaves {worst:.6g} in a tail, more "
            f"than (1 − confidence)/2 = {tail:.6g}; the best confidence at n = {n} is "
            f"{_best_confidence(worst)!r}"
        )
    # l: the largest rank with P(B <= l − 1) <= tail; u: the smallest with P(B > u − 1) <= tail.
    lower = _first_rank(n, lambda r: binom_tails(r - 1, n, q)[0] > tail) - 1
    upper = _first_rank(n, lambda r: binom_tails(r - 1, n, q)[1] <= tail)
    assert 1 <= lower <= upper <= n, (lower, upper, n)  # n >= needed puts both extremes in the tails
    coverage = 1.0 - binom_tails(lower - 1, n, q)[0] - binom_tails(upper - 1, n, q)[1]
    ordered = np.sort(x)
    return QuantileInterval(
        q,
        float(np.quantile(x, q)),
        (float(ordered[lower - 1]), float(ordered[upper - 1])),
        confidence,
        coverage,
        (lower, upper),
        n,
    )


def _widest_tail(n: int, q: float) -> float:
    """The larger tail the widest interval (x_(1), x_(n)) leaves out: max((1 − q)^n, q^n)."""
    return max(binom_tails(0, n, q)[0], binom_tails(n - 1, n, q)[1])


def _best_confidence(worst: float) -> float:
    """The largest float confidence whose tail (1 − c)/2, computed as `quantile_ci` computes it,
    holds `worst`: 1 − 2·worst can round up past it near 1 (the error would name a level that fails)."""
    best = max(0.0, 1.0 - 2.0 * worst)
    while best > 0.0 and 0.5 * (1.0 - best) < worst:
        best = math.nextafter(best, 0.0)
    return best


def _first_rank(n: int, holds: Any) -> int:
    """The smallest rank r in 1..n + 1 for which the monotone predicate `holds(r)` is true."""
    lo, hi = 1, n + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def minimum_size_for_quantile_ci(q: float, confidence: float) -> int:
    """The fewest values for which the order statistics bracket the q-quantile at `confidence`.

    Both tails must fit: P(B <= 0) = (1 − q)^n <= tail (some value below ξ_q) and P(B > n − 1) =
    q^n <= tail (some above), read from `binom_tails` as `quantile_ci`'s rank search reads them.
    """
    tail = 0.5 * (1.0 - confidence)

    def enough(n: int) -> bool:
        return _widest_tail(n, q) <= tail

    n = max(math.ceil(math.log(tail) / math.log1p(-q)), math.ceil(math.log(tail) / math.log(q)), 1)
    while not enough(n):  # guard the ceiling against rounding
        n += 1
    while n > 1 and enough(n - 1):
        n -= 1
    return n
