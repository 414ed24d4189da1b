"""Power, sample size and minimum detectable effect: against scipy's noncentral t and statsmodels,
and by simulating experiments at the designed effect."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats as st

from torchhal.evaluation.stats import minimum_detectable_effect, power_welch, sample_size
from torchhal.evaluation.stats.distributions import t_sf
from torchhal.hal_core.errors import InvalidArgumentError


def _reference_power(effect, sd_a, sd_b, n_a, n_b, alpha, alternative):
    va, vb = sd_a**2 / n_a, sd_b**2 / n_b
    df = (va + vb) ** 2 / (va**2 / (n_a - 1) + vb**2 / (n_b - 1))
    nc = effect / math.sqrt(va + vb)
    if alternative == "two-sided":
        crit = st.t.ppf(1 - alpha / 2, df)
        return st.nct.sf(crit, df, nc) + st.nct.cdf(-crit, df, nc)
    crit = st.t.ppf(1 - alpha, df)
    return st.nct.sf(crit, df, nc) if alternative == "greater" else st.nct.cdf(-crit, df, nc)


def test_power_matches_scipy_noncentral_t() -> None:
    rng = np.random.default_rng(31)
    for case in range(150):
        alternative = ("two-sided", "greater", "less")[case % 3]
        sd_a, sd_b = (float(v) for v in rng.uniform(0.2, 3.0, 2))
        n_a, n_b = (int(v) for v in rng.integers(2, 300, 2))
        # Noncentralities within ±6, where scipy's own nct is finite.
        effect = float(rng.uniform(-6, 6)) * math.sqrt(sd_a**2 / n_a + sd_b**2 / n_b)
        mine = power_welch(effect, sd_a, sd_b, n_a, n_b, 0.05, alternative=alternative)
        assert mine.power == pytest.approx(
            _reference_power(effect, sd_a, sd_b, n_a, n_b, 0.05, alternative), abs=1e-8
        )


def test_power_matches_statsmodels_for_equal_groups() -> None:
    power_module = pytest.importorskip("statsmodels.stats.power", reason="statsmodels is the power reference")
    # Equal sizes and sds: Welch's df equals the pooled 2n − 2, so the two must agree.
    for d, n in [(0.2, 50), (0.5, 64), (0.8, 26), (1.3, 7)]:
        mine = power_welch(d, 1.0, 1.0, n, n, 0.05).power
        assert mine == pytest.approx(power_module.TTestIndPower().power(d, n, 0.05), abs=1e-8)


def test_sample_size_is_the_smallest_that_reaches_the_power() -> None:
    for effect, sd_a, sd_b, ratio in [(0.5, 1.0, 1.0, 1.0), (2.0, 3.0, 5.0, 1.0), (-0.3, 0.5, 1.5, 2.0)]:
        plan = sample_size(effect, sd_a, sd_b, ratio=ratio)
        assert plan.power >= 0.8
        smaller = power_welch(effect, sd_a, sd_b, plan.n_a - 1, max(2, math.ceil(ratio * (plan.n_a - 1))))
        assert smaller.power < 0.8
    assert sample_size(0.5, 1.0, 1.0).n_a == 64  # Cohen's (1988) power tables: 64 per group at d = 0.5


def test_minimum_detectable_effect_has_the_target_power() -> None:
    rng = np.random.default_rng(8)
    pilot_a, pilot_b = rng.normal(10.0, 1.0, 25), rng.normal(10.0, 2.0, 31)
    for alternative in ("two-sided", "greater", "less"):
        mde = minimum_detectable_effect(pilot_a, pilot_b, 40, alternative=alternative)
        achieved = power_welch(mde.effect, mde.sd_a, mde.sd_b, 40, 40, alternative=alternative).power
        assert achieved == pytest.approx(0.8, abs=1e-8)
        assert (mde.effect < 0) == (alternative == "less")
        assert mde.relative == pytest.approx(mde.effect / pilot_b.mean())


def _welch_rejections(a: np.ndarray, b: np.ndarray, alpha: float) -> np.ndarray:
    """Two-sided Welch decisions for each row of a and b (vectorised moments, our t tail)."""
    va, vb = a.var(axis=1, ddof=1) / a.shape[1], b.var(axis=1, ddof=1) / b.shape[1]
    t = (a.mean(axis=1) - b.mean(axis=1)) / np.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (a.shape[1] - 1) + vb**2 / (b.shape[1] - 1))
    return np.array([2 * t_sf(abs(ti), di) <= alpha for ti, di in zip(t, df, strict=True)])


@pytest.mark.parametrize(("n", "sd_a", "sd_b"), [(20, 1.0, 1.0), (35, 1.0, 2.5), (12, 3.0, 0.5)])
def test_simulated_power_at_the_minimum_detectable_effect(n: int, sd_a: float, sd_b: float) -> None:
    rng = np.random.default_rng(n)
    # Pilots drawn so that their sample sds equal the simulation's true sds exactly.
    pilot_a = rng.normal(size=15)
    pilot_b = rng.normal(size=15)
    pilot_a = (pilot_a - pilot_a.mean()) / pilot_a.std(ddof=1) * sd_a + 50.0
    pilot_b = (pilot_b - pilot_b.mean()) / pilot_b.std(ddof=1) * sd_b + 50.0
    mde = minimum_detectable_effect(pilot_a, pilot_b, n)
    sims = 4000
    a = rng.normal(50.0 + mde.effect, sd_a, size=(sims, n))
    b = rng.normal(50.0, sd_b, size=(sims, n))
    power = float(_welch_rejections(a, b, 0.05).mean())
    se = math.sqrt(0.8 * 0.2 / sims)
    assert power >= 0.8 - 3 * se, (
        f"simulated power {power:.4f} < 0.8 − 3·SE (SE {se:.4f}), MDE {mde.effect:.4f}"
    )
    assert power <= 0.8 + 3 * se + 0.01, (
        f"simulated power {power:.4f} far above the 0.8 designed (SE {se:.4f})"
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: power_welch(1.0, 0.0, 0.0, 10, 10), "both are 0"),
        (lambda: power_welch(1.0, 1.0, 1.0, 1, 10), "n_a must be an integer >= 2, got 1"),
        (lambda: power_welch(1.0, -1.0, 1.0, 5, 10), "sd_a must be >= 0"),
        (lambda: sample_size(0.0, 1.0, 1.0), "effect must be non-zero"),
        (lambda: sample_size(-1.0, 1.0, 1.0, alternative="greater"), "point the way the alternative does"),
        (lambda: minimum_detectable_effect([1.0, 1.0], [2.0, 2.0], 10), "both pilots are constant"),
        (lambda: minimum_detectable_effect([1.0, 2.0], [2.0, 3.0], 10, power=1.0), "power must lie strictly"),
    ],
)
def test_bad_input_is_named(call, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        call()
