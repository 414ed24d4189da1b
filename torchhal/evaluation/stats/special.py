"""Regularized incomplete beta and gamma functions, written here so the engine needs no scipy.

Both follow Numerical Recipes (Press et al., §6.2 and §6.4): a series or a continued
fraction evaluated by the modified Lentz method, each used on the side of its argument where it
converges fast. Each function returns the value and its complement computed without cancellation,
so tail probabilities as small as 1e-300 keep their relative accuracy.
"""

from __future__ import annotations

import math

from torchhal.hal_core.errors import InvalidArgumentError

_EPS = 1e-16  # relative change at which a series or continued fraction has converged
_TINY = 1e-300  # Lentz's guard against division by zero
_MAX_ITER = 1_000_000  # continued fractions need O(sqrt(max(a, b))) terms; this covers a, b < 1e11


def _positive(value: float, name: str) -> float:
    v = float(value)
    if not (v > 0 and math.isfinite(v)):
        raise InvalidArgumentError(f"{name} must be a finite number > 0, got {value!r}")
    return v


_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
_STIRLING_FROM = 10.0  # above this the Stirling series below is exact to double precision
# Coefficients of the Stirling series ω(x) = log Γ(x) − (x − ½) log x + x − ½ log 2π in powers 1/x^(2k+1).
_STIRLING = (1 / 12, -1 / 360, 1 / 1260, -1 / 1680, 1 / 1188, -691 / 360360, 1 / 156, -3617 / 122400)


def _stirling_remainder(x: float) -> float:
    inv, inv2 = 1.0 / x, 1.0 / (x * x)
    total, power = 0.0, inv
    for coefficient in _STIRLING:
        total += coefficient * power
        power *= inv2
    return total


def log_gamma_excess(a: float) -> float:
    """a·log(a) − a − log Γ(a): by Stirling's series at large a, where the three terms cancel
    (lgamma(5e11) ≈ 1.3e13 leaves 1e-3 of absolute error in the difference)."""
    if a < _STIRLING_FROM:
        return a * math.log(a) - a - math.lgamma(a)
    return 0.5 * math.log(a) - _HALF_LOG_2PI - _stirling_remainder(a)


def log_beta(a: float, b: float) -> float:
    """log B(a, b) without the cancellation of lgamma(a) + lgamma(b) − lgamma(a + b) at large a or b.

    Large arguments use Stirling's series with the log terms combined through log1p, as
    TOMS 708 (Didonato & Morris 1992) does, so B(5e5, 0.5) keeps 15 digits rather than 9.
    """
    small, large = min(a, b), max(a, b)
    if large < _STIRLING_FROM:
        return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    ratio = small / large
    correction = _stirling_remainder(large) - _stirling_remainder(large + small)
    if small < _STIRLING_FROM:
        # lgamma(large) − lgamma(large + small) by Stirling, then add lgamma(small) exactly.
        difference = -(large - 0.5) * math.log1p(ratio) - small * math.log(large + small) + small
        return math.lgamma(small) + difference + correction
    return (
        _HALF_LOG_2PI
        - (large - 0.5) * math.log1p(ratio)
        + (small - 0.5) * math.log(small / (large + small))
        - 0.5 * math.log(large + small)
        + _stirling_remainder(small)
        + correction
    )


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b), converging for x < (a + 1) / (a + b + 2)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = 1.0
    d = 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, _MAX_ITER):
        m2 = 2 * m
        for aa in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + aa / c
            c = c if abs(c) > _TINY else _TINY
            step = d * c
            h *= step
        if abs(step - 1.0) < _EPS:
            return h
    raise ArithmeticError(f"incomplete beta continued fraction did not converge for a={a}, b={b}, x={x}")


def betainc(a: float, b: float, x: float, complement_x: float | None = None) -> tuple[float, float]:
    """(I_x(a, b), 1 - I_x(a, b)): the regularized incomplete beta function and its complement.

    Pass `complement_x` (= 1 - x) when the caller knows it more accurately than `1 - x` rounds.
    """
    a, b = _positive(a, "a"), _positive(b, "b")
    x = float(x)
    y = 1.0 - x if complement_x is None else float(complement_x)
    if not (0.0 <= x <= 1.0 and 0.0 <= y <= 1.0):
        raise InvalidArgumentError(f"x must lie in [0, 1], got x={x!r} (1 - x = {y!r})")
    if x == 0.0:
        return 0.0, 1.0
    if y == 0.0:
        return 1.0, 0.0
    # log of whichever of x, y is near 1 goes through log1p of the other, which is known exactly.
    log_x = math.log(x) if x <= 0.5 else math.log1p(-y)
    log_y = math.log(y) if y <= 0.5 else math.log1p(-x)
    log_front = a * log_x + b * log_y - log_beta(a, b)
    if x < (a + 1.0) / (a + b + 2.0):
        value = math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
        return value, 1.0 - value
    complement = math.exp(log_front) * _beta_continued_fraction(b, a, y) / b
    return 1.0 - complement, complement


def _log_ratio_excess(x: float, a: float) -> float:
    """log(x/a) − (x/a − 1). Near x = a, log1p(r) − r with r = (x − a)/a keeps the digits the
    difference leaves; below a/2, log(x/a) directly: r rounded to −1 there (x/a below 1e-16:
    log1p(−1), a math domain error) and lost x/a's digits before (gammainc(11, 1e-15) was 9
    times too large). An x/a below the smallest float gives −inf: e^(a·that) underflows anyway."""
    r = (x - a) / a
    if x < 0.5 * a:
        ratio = x / a
        return (math.log(ratio) if ratio > 0.0 else -math.inf) - r
    return math.log1p(r) - r


def gammainc(a: float, x: float) -> tuple[float, float]:
    """(P(a, x), Q(a, x)): the regularized lower and upper incomplete gamma functions."""
    a = _positive(a, "a")
    x = float(x)
    if not (x >= 0.0):
        raise InvalidArgumentError(f"x must be >= 0, got {x!r}")
    if x == 0.0:
        return 0.0, 1.0
    if math.isinf(x):
        return 1.0, 0.0
    if a < _STIRLING_FROM:
        log_front = -x + a * math.log(x) - math.lgamma(a)
    else:  # the same through Stirling's series, free of the cancellation between x and lgamma(a)
        log_front = a * _log_ratio_excess(x, a) + 0.5 * math.log(a) - _HALF_LOG_2PI
        log_front -= _stirling_remainder(a)
    if x < a + 1.0:
        # Series: P(a, x) = e^-x x^a / Γ(a) · Σ x^n / (a (a+1) ... (a+n)).
        term = total = 1.0 / a
        ap = a
        for _ in range(_MAX_ITER):
            ap += 1.0
            term *= x / ap
            total += term
            if abs(term) < abs(total) * _EPS:
                lower = math.exp(log_front) * total
                return lower, 1.0 - lower
        raise ArithmeticError(f"incomplete gamma series did not converge for a={a}, x={x}")
    # Continued fraction for Q, by the modified Lentz method.
    bb = x + 1.0 - a
    c = 1.0 / _TINY
    d = 1.0 / bb
    h = d
    for i in range(1, _MAX_ITER):
        an = -i * (i - a)
        bb += 2.0
        d = an * d + bb
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = bb + an / c
        c = c if abs(c) > _TINY else _TINY
        step = d * c
        h *= step
        if abs(step - 1.0) < _EPS:
            upper = math.exp(log_front) * h
            return 1.0 - upper, upper
    raise ArithmeticError(f"incomplete gamma continued fraction did not converge for a={a}, x={x}")
