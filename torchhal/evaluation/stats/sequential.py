"""Always-valid sequential testing for live monitoring: look after every batch, stop when it is clear.

`SequentialTest` is the mixture sequential probability ratio test (mSPRT; Robbins 1970; Johari,
Pekelis & Walsh 2017/2022) for the difference of two means, with a normal mixture N(0, τ²) over the
difference. Its likelihood ratio Λ_t is a nonnegative martingale under the null, so by Ville's
inequality P(Λ_t >= 1/α for some t) <= α: the p-value min_s 1/Λ_s is valid at any stopping time,
and {θ : Λ_t(θ) < 1/α} is a confidence sequence (Howard, Ramdas, McAuliffe & Sekhon 2021),
covering θ at all times at once with probability >= 1 − α. The variance of the difference is the
running plug-in estimate (the Gaussian approximation of Waudby-Smith et al. 2021's asymptotic
confidence sequences), so decisions wait until that approximation holds: each arm has
`min_samples` values, the variance estimate as many degrees of freedom as two arms of
`min_samples` give, and the difference of the means is nearly symmetric (`SKEWNESS_LIMIT`).
The last two matter for unequal arms (a canary's 1:9 split): with equal arms the skew of the two
means cancels, with unequal ones the smaller arm's skew is left in the difference.

Because Ville's inequality must hold over an unbounded horizon and between looks, the test spends
less than α over any finite experiment: its false-positive rate is <= α, not equal to it.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchhal.evaluation.stats import _checks
from torchhal.hal_core import telemetry
from torchhal.hal_core.errors import InvalidArgumentError

log = telemetry.get_logger("torchhal.evaluation.stats")

# The fewest values per arm before a look. The plug-in variance makes each look's statistic
# heavier-tailed than normal at small n: in A/A Monte Carlo (20,000 runs, a look after every value
# up to 300 per arm) min_samples = 2, 3, 5 gave false-positive rates 0.136, 0.085, 0.054 at
# α = 0.05 with tuning_n = 10 (0.061 at 2 with tuning_n = 100); at 10 they stay below α for
# α = 0.01 .. 0.1 and tuning_n = 1 .. 1000 (0.035 at α = 0.05, 0.009 at α = 0.01, tuning_n = 10).
# A smaller α wants more: at α = 0.001, tuning_n = 10 the rate is 0.0018 at 10, 0.0010 at 15.
MIN_SAMPLES_FLOOR = 10

# The largest skewness of mean(a) − mean(b) at which a look counts (`difference_skewness`). The
# floor above was set on equal arms, whose skews cancel; with a 1:9 split the smaller arm's skew
# makes the plug-in statistic one-tailed at small n. A/A Monte Carlo at 1:9 (units assigned at
# random, a look after every unit, α = 0.05, tuning_n = 100), min_samples alone -> with this
# limit and the degrees-of-freedom floor (`variance_df`): exponential 0.124 -> 0.035 and
# lognormal(0, 1) 0.173 -> 0.015 (4,000 values in the smaller arm), Bernoulli(0.05) 0.39 -> 0.012
# (1,000), normal 0.057 -> 0.048 (500). A limit of 0.2 (Cochran's 1977 n > 25·skewness² rule for
# one mean) left exponential at 0.049. The cost, at 1:9, is values in the smaller arm before the
# first look (median over runs): normal 16 rather than 10 (the degrees of freedom), exponential
# (skewness 2) 118, Bernoulli(0.05) 540, lognormal(0, 1) 780; equal arms wait for nothing more.
# A smaller α wants more (see above): normal data at 1:9 and α = 0.01 gave 0.013 at
# min_samples = 10 and 0.0097 at 15.
SKEWNESS_LIMIT = 0.15


class Decision(str, enum.Enum):
    """After a look: keep collecting, or stop because a is shown better or worse than b."""

    CONTINUE = "continue"
    IMPROVED = "stop-improved"
    REGRESSED = "stop-regressed"


@dataclass(frozen=True, slots=True)
class SequentialState:
    """What one look shows: the difference mean(a) − mean(b), its confidence sequence, p and
    decision; `waiting` says why the test has not looked yet (None once it has)."""

    difference: float
    interval: tuple[float, float]
    p_value: float
    decision: Decision
    n_a: int
    n_b: int
    waiting: str | None = None


class _RunningMoments:
    """Count, mean and sum of squared deviations, merged batch by batch (Chan, Golub & LeVeque 1983).

    While every value so far is the same (up to rounding, `_checks.constant`), the mean is the
    lowest value and m2 is 0, exactly: computed, they held rounding (the mean of 300 copies of 43.1
    is not 43.1), which read as a variance of 1e-29 gave two constant arms p = 0 and an interval
    1e-14 wide, while arms of integers waited."""

    def __init__(self) -> None:
        self.n, self.mean, self.m2, self.m3 = 0, 0.0, 0.0, 0.0  # m3: sum of cubed deviations
        self.low, self.high = math.inf, -math.inf

    def add(self, batch: np.ndarray) -> None:
        if batch.size == 0:
            return
        self.low, self.high = min(self.low, float(batch.min())), max(self.high, float(batch.max()))
        n_b, mean_b = batch.size, float(batch.mean())
        deviations = batch - mean_b
        m2_b, m3_b = float(np.sum(deviations**2)), float(np.sum(deviations**3))
        n_a, total = self.n, self.n + n_b
        delta = mean_b - self.mean
        # Pébay (2008): the merged third moment uses m2 of both parts before they merge
        self.m3 += (
            m3_b
            + delta**3 * n_a * n_b * (n_a - n_b) / total**2
            + 3.0 * delta * (n_a * m2_b - n_b * self.m2) / total
        )
        self.mean += delta * n_b / total
        self.m2 += m2_b + delta * delta * n_a * n_b / total
        self.n = total
        if _checks.constant(np.array([self.low, self.high])):  # the range so far is rounding
            self.mean, self.m2, self.m3 = self.low, 0.0, 0.0

    @property
    def variance(self) -> float:
        return self.m2 / (self.n - 1)


@functools.lru_cache(maxsize=16)
def optimal_mixture_ratio(alpha: float) -> float:
    """x = τ²/V at which the confidence sequence is narrowest, V the variance of the difference.

    The half-width is sqrt(V·(1 + x)/x·(2 log(1/α) + log(1 + x))); setting its derivative in x
    to zero gives x = 2 log(1/α) + log(1 + x), solved by fixed-point iteration (a contraction).
    """
    x = 2.0 * math.log(1.0 / alpha)
    for _ in range(100):
        x = 2.0 * math.log(1.0 / alpha) + math.log1p(x)
    return x


def mixture_look(
    difference: Any, var_a: Any, n_a: Any, var_b: Any, n_b: Any, *, alpha: float, tuning_n: int
) -> tuple[Any, Any]:
    """One look of the mSPRT: (log Λ at θ = 0, half-width of the confidence sequence).

    With V = var_a/n_a + var_b/n_b and τ² = x·(var_a + var_b)/tuning_n (x from
    `optimal_mixture_ratio`): log Λ = −½ log(1 + τ²/V) + τ²·d² / (2V(V + τ²)), and Λ(θ) < 1/α
    for |d − θ| < sqrt(V(V + τ²)/τ² · (2 log(1/α) + log(1 + τ²/V))). Works elementwise on
    numpy arrays, so simulations can run many experiments at once through the same formula.
    """
    variance = var_a / n_a + var_b / n_b
    tau2 = optimal_mixture_ratio(alpha) * (var_a + var_b) / tuning_n
    ratio = tau2 / variance
    log_lr = -0.5 * np.log1p(ratio) + ratio * difference**2 / (2.0 * (variance + tau2))
    half = np.sqrt((variance + tau2) / ratio * (2.0 * math.log(1.0 / alpha) + np.log1p(ratio)))
    return log_lr, half


def variance_df(n_a: Any, n_b: Any) -> Any:
    """Welch–Satterthwaite degrees of freedom of var_a/n_a + var_b/n_b for arms of equal variance:
    2(n − 1) for equal arms, falling to n_a − 1 as the other arm grows. The plug-in variance is
    as noisy as that few values make it, however many the larger arm holds. Elementwise."""
    share_a, share_b = 1.0 / n_a, 1.0 / n_b
    df = (share_a + share_b) ** 2 / (share_a**2 / (n_a - 1) + share_b**2 / (n_b - 1))
    return np.where(n_a == n_b, 2.0 * (n_a - 1), df)  # exact where the floor was set: 1 ulp low at 50


def difference_skewness(m2: Any, m3: Any, n_a: Any, n_b: Any) -> Any:
    """Skewness of mean(a) − mean(b) when both arms have the shape of the pooled data.

    The third cumulant of the difference is κ₃(1/n_a² − 1/n_b²) and its variance σ²(1/n_a + 1/n_b),
    so its skewness is g·(1/n_a − 1/n_b)/sqrt(1/n_a + 1/n_b), g the skewness of the values: 0 for
    equal arms, ≈ 0.84·g/sqrt(n_a) at 1:9. g comes from m2 and m3, both arms' sums of squared and
    cubed deviations from their own means: the smaller arm's own g is too noisy at the sizes that
    matter, and low exactly when it is dangerous (no large value yet). Under the A/A null the
    arms share their shape. Elementwise.
    """
    total = n_a + n_b
    skewness = (m3 / total) / (m2 / total) ** 1.5
    return skewness * (1.0 / n_a - 1.0 / n_b) / np.sqrt(1.0 / n_a + 1.0 / n_b)


class SequentialTest:
    """Feed batches with `update(a_batch, b_batch)`; read `interval`, `p_value` and `decision`.

    `interval` is the running intersection of the per-look intervals, so it only narrows, and
    it excludes 0 from the look at which the decision is taken.

    `higher_is_better` says which sign of mean(a) − mean(b) is an improvement (False for latency).
    `tuning_n` is the per-arm sample size at which the interval is narrowest: τ² is set so the
    boundary is tightest when each arm holds `tuning_n` values, as Howard et al. (2021) tune it. Once
    the always-valid p-value falls to alpha the decision is final; later batches still update
    the estimate and the interval. `min_samples` is at least `MIN_SAMPLES_FLOOR` (see there).
    Unequal arms may wait longer: for the degrees of freedom of two arms of `min_samples`
    (`variance_df`), and while the difference's skewness exceeds `SKEWNESS_LIMIT` (see there for
    what that costs); `state.waiting` says which, and about how many values it wants.
    """

    def __init__(
        self, *, higher_is_better: bool, alpha: float = 0.05, tuning_n: int = 100, min_samples: int = 10
    ) -> None:
        self.alpha = _checks.probability(alpha, "alpha")
        self.tuning_n = _checks.positive_int(tuning_n, "tuning_n", minimum=1)
        self.min_samples = _checks.positive_int(min_samples, "min_samples", minimum=MIN_SAMPLES_FLOOR)
        self.higher_is_better = bool(higher_is_better)
        self._a, self._b = _RunningMoments(), _RunningMoments()
        self._state = self._waiting(math.nan, self._too_few())

    @property
    def state(self) -> SequentialState:
        return self._state

    @property
    def interval(self) -> tuple[float, float]:
        return self._state.interval

    @property
    def p_value(self) -> float:
        return self._state.p_value

    @property
    def decision(self) -> Decision:
        return self._state.decision

    def update(self, a_batch: Any, b_batch: Any) -> SequentialState:
        """Add a batch of each arm (either may be empty, not both) and look once."""
        a = _checks.sample(a_batch, "a_batch", min_size=0)
        b = _checks.sample(b_batch, "b_batch", min_size=0)
        if a.size == 0 and b.size == 0:
            raise InvalidArgumentError(
                "update needs at least one value in a_batch or b_batch; both are empty"
            )
        self._a.add(a)
        self._b.add(b)
        self._state = self._look()
        return self._state

    def _look(self) -> SequentialState:
        a, b, previous = self._a, self._b, self._state
        difference = a.mean - b.mean if a.n and b.n else math.nan
        if min(a.n, b.n) < self.min_samples:
            return self._waiting(difference, self._too_few())
        if a.m2 + b.m2 == 0.0:  # constant arms, even of different values: the test has no scale
            why = (
                "both arms constant so far: the test has no variance to test on, and looks once either varies"
            )
            return self._waiting(difference, why)
        not_normal = self._not_normal_yet()
        if not_normal is not None:
            return self._waiting(difference, not_normal)
        log_lr, half = mixture_look(
            difference, a.variance, a.n, b.variance, b.n, alpha=self.alpha, tuning_n=self.tuning_n
        )
        p_value = min(previous.p_value, math.exp(min(0.0, -float(log_lr))))
        half = float(half)
        decision = previous.decision
        if decision is Decision.CONTINUE and p_value <= self.alpha:
            better = (difference > 0) == self.higher_is_better
            decision = Decision.IMPROVED if better else Decision.REGRESSED
        return SequentialState(
            difference, self._intersect(difference - half, difference + half), p_value, decision, a.n, b.n
        )

    def _too_few(self) -> str:
        return f"fewer than min_samples = {self.min_samples} values in an arm so far"

    def _not_normal_yet(self) -> str | None:
        """Why the difference's normal approximation does not hold yet at unequal arms, or None."""
        a, b = self._a, self._b
        smaller = min(a.n, b.n)
        df, wanted = float(variance_df(a.n, b.n)), 2 * (self.min_samples - 1)
        if df < wanted:
            return (
                f"the variance has {df:.1f} degrees of freedom at {a.n}:{b.n} values, fewer than two "
                f"arms of min_samples = {self.min_samples} give ({wanted}): the smaller arm needs more"
            )
        skew = abs(float(difference_skewness(a.m2 + b.m2, a.m3 + b.m3, a.n, b.n)))
        if skew > SKEWNESS_LIMIT:
            # the skewness falls as 1/sqrt(n) at a fixed split
            needed = math.ceil(smaller * (skew / SKEWNESS_LIMIT) ** 2)
            return (
                f"skewed data at unequal arms: mean(a) − mean(b) has skewness {skew:.3g} > "
                f"{SKEWNESS_LIMIT} at {a.n}:{b.n} values; at this split the smaller arm needs "
                f"about {needed} (it has {smaller})"
            )
        return None

    def _waiting(self, difference: float, why: str) -> SequentialState:
        """No look yet: the whole real line, p = 1, and why."""
        return SequentialState(
            difference, (-math.inf, math.inf), 1.0, Decision.CONTINUE, self._a.n, self._b.n, why
        )

    def _intersect(self, low: float, high: float) -> tuple[float, float]:
        """The running intersection of the intervals so far, itself a confidence sequence.

        An empty intersection cannot happen when one fixed difference underlies every batch
        (unless the sequence already missed it); it signals drift. It is logged and counted, and
        the intersection restarts from the current interval.
        """
        previous_low, previous_high = self._state.interval
        low_kept, high_kept = max(low, previous_low), min(high, previous_high)
        if low_kept <= high_kept:
            return low_kept, high_kept
        log.warning(
            "sequential.interval_empty",
            current=(low, high),
            previous=(previous_low, previous_high),
            n_a=self._a.n,
            n_b=self._b.n,
        )
        telemetry.count("torchhal.stats.sequential_interval_restarts")
        return low, high
