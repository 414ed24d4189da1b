"""Power of Welch's test, the sample size it needs, and the smallest effect a plan can detect.

The power is the noncentral-t approximation: under a true difference δ, Welch's statistic is
taken as noncentral t with noncentrality δ / sqrt(sd_a²/n_a + sd_b²/n_b) and the
Welch–Satterthwaite df of the planning standard deviations (treated as known). The noncentral t
distribution itself is computed by numeric integration (`distributions.nct_cdf`), not approximated.
Simulations in the tests check that designs reach their power.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torchhal.evaluation.stats import _checks
from torchhal.evaluation.stats.distributions import nct_cdf, nct_sf, norm_ppf, t_ppf
from torchhal.hal_core.errors import InvalidArgumentError

_MAX_SAMPLE_SIZE = 10**9


@dataclass(frozen=True, slots=True)
class PowerResult:
    """P(Welch's test rejects) when mean(a) − mean(b) = effect."""

    power: float
    effect: float
    noncentrality: float
    df: float
    alpha: float
    alternative: str
    n_a: int
    n_b: int


@dataclass(frozen=True, slots=True)
class SampleSizeResult:
    """The smallest per-arm sizes (n_b = ceil(ratio·n_a)) whose power reaches the target."""

    n_a: int
    n_b: int
    power: float
    target_power: float
    effect: float
    alpha: float
    alternative: str


@dataclass(frozen=True, slots=True)
class MinimumDetectableEffect:
    """The smallest difference mean(a) − mean(b) detected with `power` at n per arm.

    `relative` is effect / mean(pilot_b), or None when that mean is not > 0.
    """

    effect: float
    relative: float | None
    sd_a: float
    sd_b: float
    n_a: int
    n_b: int
    alpha: float
    power: float
    alternative: str
    pilot_sizes: tuple[int, int]


def power_welch(
    effect: float,
    sd_a: float,
    sd_b: float,
    n_a: int,
    n_b: int,
    alpha: float = 0.05,
    *,
    alternative: str = "two-sided",
) -> PowerResult:
    """Power of Welch's t-test at a true difference `effect` (noncentral-t approximation, see module)."""
    effect = _checks.finite_number(effect, "effect")
    sd_a, sd_b = _checks.nonnegative_sd(sd_a, "sd_a"), _checks.nonnegative_sd(sd_b, "sd_b")
    if sd_a == 0.0 and sd_b == 0.0:
        raise InvalidArgumentError("power needs a standard deviation > 0 in at least one arm; both are 0")
    n_a = _checks.positive_int(n_a, "n_a", minimum=2)
    n_b = _checks.positive_int(n_b, "n_b", minimum=2)
    alpha = _checks.probability(alpha, "alpha")
    _checks.alternative(alternative)
    va, vb = sd_a**2 / n_a, sd_b**2 / n_b
    df = (va + vb) ** 2 / (va**2 / (n_a - 1) + vb**2 / (n_b - 1))
    nc = effect / math.sqrt(va + vb)
    if alternative == "two-sided":
        critical = t_ppf(1.0 - alpha / 2.0, df)
        power = nct_sf(critical, df, nc) + nct_cdf(-critical, df, nc)
    elif alternative == "greater":
        power = nct_sf(t_ppf(1.0 - alpha, df), df, nc)
    else:
        power = nct_cdf(-t_ppf(1.0 - alpha, df), df, nc)
    return PowerResult(min(power, 1.0), effect, nc, df, alpha, alternative, n_a, n_b)


def _check_direction(effect: float, alternative: str) -> None:
    if effect == 0.0 or (alternative == "greater" and effect < 0) or (alternative == "less" and effect > 0):
        raise InvalidArgumentError(
            f"no sample size gives power against effect {effect} with alternative {alternative!r}: "
            "the effect must be non-zero and point the way the alternative does"
        )


def sample_size(
    effect: float,
    sd_a: float,
    sd_b: float,
    *,
    alpha: float = 0.05,
    power: float = 0.8,
    ratio: float = 1.0,
    alternative: str = "two-sided",
) -> SampleSizeResult:
    """The smallest n_a (with n_b = ceil(ratio·n_a)) at which `power_welch` reaches `power`."""
    effect = _checks.finite_number(effect, "effect")
    _checks.alternative(alternative)
    _check_direction(effect, alternative)
    target = _checks.probability(power, "power")
    ratio = _checks.finite_number(ratio, "ratio")
    if ratio <= 0:
        raise InvalidArgumentError(f"ratio n_b/n_a must be > 0, got {ratio}")

    def achieved(n: int) -> PowerResult:
        return power_welch(
            effect, sd_a, sd_b, n, max(2, math.ceil(ratio * n)), alpha, alternative=alternative
        )

    if achieved(2).power >= target:
        found = achieved(2)
    else:
        z = norm_ppf(1.0 - alpha / (2.0 if alternative == "two-sided" else 1.0)) + norm_ppf(target)
        guess = math.ceil(z**2 * (sd_a**2 + sd_b**2 / ratio) / effect**2)
        lo, hi = 2, max(4, guess)
        while achieved(hi).power < target:
            lo, hi = hi, 2 * hi
            if hi > _MAX_SAMPLE_SIZE:
                raise InvalidArgumentError(
                    f"effect {effect} needs more than {_MAX_SAMPLE_SIZE} samples per arm for power {target}"
                )
        while hi - lo > 1:  # invariant: power(lo) < target <= power(hi)
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if achieved(mid).power >= target else (mid, hi)
        found = achieved(hi)
    return SampleSizeResult(found.n_a, found.n_b, found.power, target, effect, found.alpha, alternative)


def minimum_detectable_effect(
    pilot_a: Any,
    pilot_b: Any,
    n: int,
    alpha: float = 0.05,
    power: float = 0.8,
    *,
    alternative: str = "two-sided",
) -> MinimumDetectableEffect:
    """The effect Welch's test detects with `power` at n per arm, standard deviations from pilots.

    Positive for "two-sided" and "greater" (the magnitude), negative for "less". Solved by
    bisection on `power_welch`, which increases with the effect's magnitude. Both pilots
    constant (up to rounding, `_checks.ROUNDING_RTOL`) raise InvalidArgumentError.
    """
    a = _checks.sample(pilot_a, "pilot_a", min_size=2)
    b = _checks.sample(pilot_b, "pilot_b", min_size=2)
    n = _checks.positive_int(n, "n", minimum=2)
    alpha = _checks.probability(alpha, "alpha")  # before the bracket's normal quantile of it
    target = _checks.probability(power, "power")
    _checks.alternative(alternative)
    if _checks.constant(a) and _checks.constant(b):  # up to rounding: its sd of 1e-15 is no spread
        raise InvalidArgumentError(
            f"both pilots are constant (a = {a[0]!r} × {a.size}, b = {b[0]!r} × {b.size}): "
            "no variance to plan with"
        )
    sd_a, sd_b = float(a.std(ddof=1)), float(b.std(ddof=1))
    sign = -1.0 if alternative == "less" else 1.0

    def power_at(magnitude: float) -> float:
        return power_welch(sign * magnitude, sd_a, sd_b, n, n, alpha, alternative=alternative).power

    hi = 2.0 * math.sqrt(sd_a**2 / n + sd_b**2 / n) * (norm_ppf(1.0 - alpha / 2.0) + norm_ppf(target))
    lo = 0.0
    while power_at(hi) < target:
        lo, hi = hi, 2.0 * hi
    while hi - lo > 1e-10 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if power_at(mid) >= target else (mid, hi)
    reference = float(b.mean())
    effect = sign * hi
    return MinimumDetectableEffect(
        effect,
        effect / reference if reference > 0 else None,
        sd_a,
        sd_b,
        n,
        n,
        alpha,
        target,
        alternative,
        (a.size, b.size),
    )
