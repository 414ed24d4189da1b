"""Simulated A/A experiments: with no true difference, each test rejects at about α = 0.05.

Seeded and vectorised where the statistic allows; every rate is checked against [3.5 %, 6.5 %],
which is α ± 3 simulation standard errors at 2000 simulations (SE ≈ 0.49 %) and wider still at 4000.
"""

from __future__ import annotations

import math

import numpy as np

from torchhal.evaluation.stats import bootstrap_ratio_of_medians, mann_whitney_u, welch_t_test

ALPHA = 0.05
WINDOW = (0.035, 0.065)


def _check_rate(name: str, rejections: int, sims: int) -> None:
    rate = rejections / sims
    se = math.sqrt(ALPHA * (1 - ALPHA) / sims)
    assert WINDOW[0] <= rate <= WINDOW[1], (
        f"{name}: A/A false-positive rate {rate:.4f} (SE {se:.4f}, {sims} sims)"
    )


def test_welch_aa_false_positive_rate() -> None:
    rng = np.random.default_rng(101)
    sims = 4000
    # Unequal variances and sizes: where Welch's df matters and the pooled test would fail.
    a = rng.normal(10.0, 3.0, size=(sims, 13))
    b = rng.normal(10.0, 1.0, size=(sims, 41))
    rejections = sum(welch_t_test(a[i], b[i]).p_value <= ALPHA for i in range(sims))
    _check_rate("Welch", rejections, sims)


def test_mann_whitney_aa_false_positive_rate_continuous_and_tied() -> None:
    rng = np.random.default_rng(102)
    sims = 4000
    continuous_a, continuous_b = rng.exponential(size=(sims, 23)), rng.exponential(size=(sims, 31))
    tied_a, tied_b = rng.poisson(3.0, size=(sims, 25)), rng.poisson(3.0, size=(sims, 30))  # many ties
    for name, a, b in (("Mann–Whitney", continuous_a, continuous_b), ("Mann–Whitney, ties", tied_a, tied_b)):
        rejections = sum(mann_whitney_u(a[i], b[i]).p_value <= ALPHA for i in range(sims))
        _check_rate(name, rejections, sims)


def test_mann_whitney_exact_small_samples_never_exceed_alpha() -> None:
    """Exact p-values are discrete: the rate is at most α (up to simulation error), usually below."""
    rng = np.random.default_rng(103)
    sims = 4000
    a, b = rng.normal(size=(sims, 6)), rng.normal(size=(sims, 8))
    rate = sum(mann_whitney_u(a[i], b[i], method="exact").p_value <= ALPHA for i in range(sims)) / sims
    assert rate <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / sims), (
        f"exact Mann–Whitney A/A rate {rate:.4f}"
    )


def test_bootstrap_aa_false_positive_rate() -> None:
    """2000 experiments of 500 resamples each (fewer than the default 10000, to fit the time budget).

    BCa is held to the window. The percentile interval of a ratio of medians is conservative at
    these sizes (about 3.6 % in a 4000-experiment run), so it is held to the upper bound only.
    """
    rng = np.random.default_rng(104)
    sims = 2000
    a = rng.lognormal(0.0, 0.5, size=(sims, 51))
    b = rng.lognormal(0.0, 0.5, size=(sims, 49))
    bca = percentile = 0
    for i in range(sims):
        result = bootstrap_ratio_of_medians(a[i], b[i], n_resamples=500, seed=i)
        bca += not (result.bca[0] <= 1.0 <= result.bca[1])
        percentile += not (result.percentile[0] <= 1.0 <= result.percentile[1])
    _check_rate("bootstrap BCa", bca, sims)
    assert percentile / sims <= WINDOW[1], f"bootstrap percentile A/A rate {percentile / sims:.4f}"
