"""The distribution functions the tests need: normal, Student t, noncentral t, chi-square, binomial
and the exact null distribution of the Mann–Whitney U statistic. Built on `special`, no scipy.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable

import numpy as np

from torchhal.evaluation.stats.special import betainc, gammainc, log_beta, log_gamma_excess
from torchhal.hal_core.errors import InvalidArgumentError

_SQRT2 = math.sqrt(2.0)
_SQRT_2PI = math.sqrt(2.0 * math.pi)
# Above this df Student's t comes from its expansion in 1/df: the incomplete beta's continued
# fraction runs at x = df/(df + t²) within ~t²/df of 1 and loses ~6e-17·df relatively (2% of
# the 0.975 quantile at df = 1e15), while the expansion's error falls as 1/df² (< 1e-7 here).
_EXPANSION_DF = 1e9
_erfc = np.frompyfunc(math.erfc, 1, 1)
# Beyond |t| = this·sqrt(df) Student's t is its power-law tail: x = df/(df + t²) < 1e-18, so
# P(T > t) = x^(df/2)/(df·B(df/2, ½))·(1 + O(x)) to double precision. It is computed from
# sqrt(df)/|t| by a power: t² overflows past 1.3e154 and x underflows, where at df <= 2 the
# quantiles of p >= 1e-308 still lie, and the incomplete beta's exp(a·log x) lost ~1e-14.
_POWER_LAW_TAIL = 1e9


def norm_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / _SQRT2)


def norm_sf(z: float) -> float:
    return 0.5 * math.erfc(z / _SQRT2)


def norm_ppf(p: float) -> float:
    """Normal quantile: Abramowitz & Stegun 26.2.23 (error < 4.5e-4) polished by Halley's method."""
    if not 0.0 < p < 1.0:
        raise InvalidArgumentError(f"normal quantile needs 0 < p < 1, got {p!r}")
    if p > 0.5:
        return -norm_ppf(1.0 - p)
    t = math.sqrt(-2.0 * math.log(p))
    z = -(
        t
        - (2.515517 + 0.802853 * t + 0.010328 * t * t)
        / (1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308)))
    )
    for _ in range(3):  # Halley: cubic convergence, so three steps reach double precision
        density = math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
        error = (norm_cdf(z) - p) / density
        z -= error / (1.0 + 0.5 * z * error)
    return z


def _check_df(df: float) -> float:
    value = float(df)
    if not (value > 0 and math.isfinite(value)):
        raise InvalidArgumentError(f"degrees of freedom must be a finite number > 0, got {df!r}")
    return value


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom, via I_{df/(df+t²)}(df/2, 1/2)."""
    df = _check_df(df)
    if t == 0.0:
        return 0.5
    if abs(t) > _POWER_LAW_TAIL * math.sqrt(df):
        r = math.sqrt(df) / abs(t)  # 0 only at df < 2e-31, where the tail is near 0.5 anyway
        power = r**df if r > 0.0 else math.exp(df * (0.5 * math.log(df) - math.log(abs(t))))
        tail = power / math.exp(math.log(df) + log_beta(0.5 * df, 0.5))
        return tail if t > 0 else 1.0 - tail
    if df > _EXPANSION_DF:
        return _t_sf_expansion(t, df)
    ratio = t * t / df
    tail = 0.5 * betainc(0.5 * df, 0.5, 1.0 / (1.0 + ratio), 1.0 / (1.0 + 1.0 / ratio))[0]
    return tail if t > 0 else 1.0 - tail


def _t_sf_expansion(t: float, df: float) -> float:
    """P(T > t) = Q(t) + φ(t)·[(t³ + t)/(4 df) + (5t⁷ + 16t⁵ + 3t³ − 3t)/(96 df²)] + O(df⁻³).

    Fisher's (1925) expansion of the t distribution about the normal (Johnson, Kotz &
    Balakrishnan 1995, §28.7); the bracket is odd in t, so it holds for t < 0 as it stands.
    """
    t2 = t * t
    correction = (t2 + 1.0) * t / (4.0 * df) + (((5.0 * t2 + 16.0) * t2 + 3.0) * t2 - 3.0) * t / (
        96.0 * df * df
    )
    return norm_sf(t) + math.exp(-0.5 * t2) / _SQRT_2PI * correction


def t_cdf(t: float, df: float) -> float:
    return t_sf(-t, df)


def t_pdf(t: float, df: float) -> float:
    return math.exp(_t_log_pdf(float(t), _check_df(df)))


def _t_log_pdf(t: float, df: float) -> float:
    """log of Student's t density; finite where the density underflows (the quantile's far tail)."""
    # Γ((df+1)/2) / (Γ(df/2)·sqrt(df·π)) = 1 / (B(df/2, ½)·sqrt(df)); the difference of two
    # lgammas would cancel away every digit at large df (lgamma(5e19) ≈ 2e21).
    log_norm = -log_beta(0.5 * df, 0.5) - 0.5 * math.log(df)
    if abs(t) > _POWER_LAW_TAIL * math.sqrt(df):  # log(1 + t²/df) without t², which overflows
        return log_norm - (df + 1.0) * (math.log(abs(t)) - 0.5 * math.log(df))
    return log_norm - 0.5 * (df + 1.0) * math.log1p(t * t / df)


def t_ppf(p: float, df: float) -> float:
    """Student-t quantile: safeguarded Newton on log P(T > t), bracketed so it always converges."""
    df = _check_df(df)
    if not 0.0 < p < 1.0:
        raise InvalidArgumentError(f"t quantile needs 0 < p < 1, got {p!r}")
    if p == 0.5:
        return 0.0
    return -_t_upper_quantile(p, df) if p < 0.5 else _t_upper_quantile(1.0 - p, df)


def _t_upper_quantile(q: float, df: float) -> float:
    """The t > 0 with P(T > t) = q, for 0 < q < 0.5 (inf where it lies beyond the largest float).

    Starts from the Cornish–Fisher expansion (Abramowitz & Stegun 26.7.5), then Newton steps on
    log P(T > t) against log t inside a bracket that falls back to bisection. In those
    coordinates the power-law tail of small df is a straight line: Newton in t itself crept
    there (p = 1e-300 at df = 1 needed ~1,000 steps and gave up).
    """
    if t_sf(sys.float_info.max, df) > q:  # e.g. df = 1 below p = 1.8e-309, df = 0.5 below 2.4e-155
        return math.inf
    z = -norm_ppf(q)
    z2 = z * z
    guess = z + z * (
        (z2 + 1.0) / (4.0 * df)
        + ((5.0 * z2 + 16.0) * z2 + 3.0) / (96.0 * df * df)  # not df**2: OverflowError
        + (((3.0 * z2 + 19.0) * z2 + 17.0) * z2 - 15.0) / (384.0 * df * df * df)
    )
    lo, hi, t = 0.0, math.inf, guess if guess > 0.0 else z
    for _ in range(400):
        sf = t_sf(t, df)
        if sf == q:
            return t
        lo, hi = (t, hi) if sf > q else (lo, t)
        candidate = math.nan  # where the tail underflows to 0: bisect
        if sf > 0.0:
            elasticity = math.exp(math.log(t) + _t_log_pdf(t, df) - math.log(sf))  # −d log sf / d log t
            # log(sf/q), not log(sf) − log(q): near the root both logs round alike at p = 1e-200
            candidate = t * math.exp(min(math.log(sf / q) / elasticity, 700.0))
        if not lo < candidate < hi:  # bisect, geometrically while the bracket spans decades
            if math.isinf(hi):
                candidate = 2.0 * t
            elif lo > 0.0 and hi > 4.0 * lo:
                candidate = math.sqrt(lo * hi)
            else:
                candidate = 0.5 * (lo + hi)
        if abs(candidate - t) <= 1e-15 * candidate:
            return candidate
        t = candidate
    raise ArithmeticError(f"t quantile did not converge for q={q}, df={df}")


def chi2_sf(x: float, df: float) -> float:
    """P(X > x) for chi-square with `df` degrees of freedom: Q(df/2, x/2)."""
    return gammainc(0.5 * _check_df(df), max(0.5 * float(x), 0.0))[1]


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(B <= k) for B ~ Binomial(n, p)."""
    return binom_tails(k, n, p)[0]


def binom_tails(k: int, n: int, p: float) -> tuple[float, float]:
    """(P(B <= k), P(B > k)) for B ~ Binomial(n, p), each without cancellation: I_{1-p}(n - k, k + 1)
    and its complement, but the extreme tails as the powers (1 − p)^n (k = 0) and p^n (k = n − 1)
    themselves. Through the incomplete beta 0.5^5 came 2 ulp above 0.03125, so a confidence set
    exactly at such a tail (0.9375 for the median of 5 values) missed its textbook interval."""
    if k < 0:
        return 0.0, 1.0
    if k >= n:
        return 1.0, 0.0
    if k == 0:
        return (1.0 - p) ** n, -math.expm1(n * math.log1p(-p))
    if k == n - 1:
        return -math.expm1(n * math.log(p)), p**n
    return betainc(n - k, k + 1, 1.0 - p, p)


def _noncentral_t_expectation(t: float, df: float, nc: float, upper: bool) -> float:
    """E[Φ(±(t·S − nc))] with S = sqrt(χ²_df / df): the noncentral t's cdf (or sf) as one integral.

    T' = (Z + nc) / S, so P(T' <= t) = E[Φ(t·S − nc)]. With S = e^y the density of y is
    ∝ exp(df·(y − (e^{2y} − 1)/2)): smooth, peaked at y = 0 with sd ≈ 1/sqrt(2·df), whatever df.
    It is integrated by 20-point Gauss–Legendre panels of about 0.7 sd over the range where the
    density exceeds e^-50 of its peak, with finer panels where Φ switches from 0 to 1.
    """

    def log_drop(y: float) -> float:  # log density relative to its peak at y = 0
        return df * (y - math.expm1(2.0 * y) / 2.0)

    lo, hi = _edge(log_drop, -1.0), _edge(log_drop, 1.0)
    step = min(0.5, 0.5 / math.sqrt(df))
    edges = [np.linspace(lo, hi, math.ceil((hi - lo) / step) + 1)]
    if t != 0.0 and nc / t > 0.0:
        switch, width = math.log(nc / t), 10.0 / abs(nc)
        if lo < switch < hi:
            edges.append(np.linspace(max(lo, switch - width), min(hi, switch + width), 41))
    grid = np.unique(np.concatenate(edges))
    nodes, weights = _gauss_legendre_20()
    half = 0.5 * np.diff(grid)[:, None]
    y = (grid[:-1, None] + half * (nodes[None, :] + 1.0)).ravel()
    w = (half * weights[None, :]).ravel()
    log_norm = math.log(2.0) + log_gamma_excess(0.5 * df)
    density = np.exp(log_norm + df * (y - np.expm1(2.0 * y) / 2.0))
    s = np.exp(y)
    argument = (nc - t * s) if upper else (t * s - nc)
    phi = 0.5 * np.asarray(_erfc(-argument / _SQRT2), dtype=np.float64)
    return float(np.sum(w * density * phi))


@functools.lru_cache(maxsize=1)
def _gauss_legendre_20() -> tuple[np.ndarray, np.ndarray]:
    return np.polynomial.legendre.leggauss(20)


def _edge(log_drop: Callable[[float], float], direction: float) -> float:
    """The y on the `direction` side of the peak (y = 0) where the log density has dropped by 50."""
    near, far = 0.0, direction
    while log_drop(far) > -50.0:
        near, far = far, 2.0 * far
    while abs(far - near) > 1e-6 * abs(far):  # relative: at df = 1e20 the edge is at 7e-10
        mid = 0.5 * (near + far)
        near, far = (mid, far) if log_drop(mid) > -50.0 else (near, mid)
    return far


def nct_cdf(t: float, df: float, nc: float) -> float:
    """P(T' <= t) for the noncentral t with `df` degrees of freedom and noncentrality `nc`."""
    return _noncentral_t_expectation(float(t), _check_df(df), float(nc), upper=False)


def nct_sf(t: float, df: float, nc: float) -> float:
    """P(T' > t), integrated directly so small upper tails keep their accuracy."""
    return _noncentral_t_expectation(float(t), _check_df(df), float(nc), upper=True)


@functools.lru_cache(maxsize=32)
def mann_whitney_counts(m: int, n: int) -> np.ndarray:
    """How many of the C(m+n, m) orderings of two tie-free samples give U = 0, 1, ..., m·n.

    They are the coefficients of the Gaussian binomial [m+n choose m]_q = Π_{i=1..m} (1 − q^{n+i}) /
    (1 − q^i) (Mann & Whitney 1947), expanded here as power series in exact integer arithmetic:
    int64 while C(m+n, m) fits, Python integers beyond. The returned array is read-only.
    """
    m, n = min(m, n), max(m, n)
    size = m * n + 1
    dtype: type | np.dtype = np.int64 if math.comb(m + n, m) < 2**62 else object
    counts = np.zeros(size, dtype=dtype)
    counts[0] = 1
    for i in range(1, m + 1):
        shift = n + i
        if shift < size:
            counts[shift:] = counts[shift:] - counts[: size - shift]
        for r in range(i):  # dividing by (1 − q^i) is a running sum over every i-th coefficient
            counts[r::i] = np.cumsum(counts[r::i])
    counts.flags.writeable = False
    return counts


def mann_whitney_sf(u: int, m: int, n: int) -> float:
    """P(U >= u) under the null hypothesis, for samples of sizes m and n without ties."""
    counts = mann_whitney_counts(m, n)
    if u <= 0:
        return 1.0
    if u > m * n:
        return 0.0
    return int(counts[u:].sum()) / math.comb(m + n, m)


def lower_critical_count(m: int, n: int, tail: float) -> int:
    """The largest k with P(U <= k - 1) <= tail (0 when even P(U = 0) exceeds it)."""
    cumulative = np.cumsum(mann_whitney_counts(m, n))
    total = math.comb(m + n, m)
    return int(np.searchsorted(cumulative, tail * total, side="right"))
