"""Bootstrap ratio-of-medians intervals: internals against brute force, endpoints against scipy's
bootstrap, and reproducibility. Error rates by simulation live in test_stats_simulation.py."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats as st

from torchhal.evaluation.stats import bootstrap_ratio_of_medians
from torchhal.evaluation.stats.bootstrap import _leave_one_out_medians, _row_medians
from torchhal.hal_core.errors import InvalidArgumentError


@pytest.mark.parametrize("n", [2, 3, 8, 31])
def test_leave_one_out_medians_match_brute_force(n: int) -> None:
    rng = np.random.default_rng(n)
    x = np.round(rng.lognormal(size=n), 1)  # rounding makes ties
    expected = [np.median(np.delete(x, i)) for i in range(n)]
    np.testing.assert_allclose(_leave_one_out_medians(x), expected, rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 2, 7, 40])
def test_row_medians_match_numpy(n: int) -> None:
    values = np.random.default_rng(n).normal(size=(50, n))
    np.testing.assert_array_equal(_row_medians(values), np.median(values, axis=1))


def _ratio_of_medians(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.median(x, axis=axis) / np.median(y, axis=axis)


@pytest.mark.parametrize("paired", [False, True])
def test_intervals_agree_with_scipy_bootstrap(paired: bool) -> None:
    """Different random streams, so endpoints agree to Monte Carlo error, not to the bit."""
    rng = np.random.default_rng(1993)
    n = 60
    a = rng.lognormal(0.1, 0.4, n)
    b = a * rng.lognormal(0.0, 0.1, n) if paired else rng.lognormal(0.0, 0.4, n + 7)
    mine = bootstrap_ratio_of_medians(a, b, paired=paired, n_resamples=40_000, seed=7)
    for method, interval in (("percentile", mine.percentile), ("BCa", mine.bca)):
        ref = st.bootstrap(
            (a, b), _ratio_of_medians, paired=paired, n_resamples=40_000, method=method, rng=11
        ).confidence_interval
        width = ref.high - ref.low
        assert interval[0] == pytest.approx(ref.low, abs=0.05 * width), method
        assert interval[1] == pytest.approx(ref.high, abs=0.05 * width), method
    assert mine.ratio == pytest.approx(np.median(a) / np.median(b))


def test_same_seed_same_interval_other_seed_other_interval() -> None:
    rng = np.random.default_rng(4)
    a, b = rng.lognormal(size=33), rng.lognormal(size=35)
    first = bootstrap_ratio_of_medians(a, b, n_resamples=2000, seed=1)
    assert bootstrap_ratio_of_medians(a, b, n_resamples=2000, seed=1) == first
    assert bootstrap_ratio_of_medians(a, b, n_resamples=2000, seed=2).percentile != first.percentile


def test_paired_bootstrap_is_narrower_when_runs_share_noise() -> None:
    rng = np.random.default_rng(5)
    machine_state = rng.lognormal(0.0, 0.5, 80)  # shared by both runs of a pair
    a = machine_state * rng.lognormal(0.05, 0.02, 80)
    b = machine_state * rng.lognormal(0.0, 0.02, 80)
    paired = bootstrap_ratio_of_medians(a, b, paired=True, n_resamples=4000, seed=3)
    unpaired = bootstrap_ratio_of_medians(a, b, n_resamples=4000, seed=3)
    assert paired.percentile[1] - paired.percentile[0] < 0.5 * (
        unpaired.percentile[1] - unpaired.percentile[0]
    )
    assert paired.percentile[0] > 1.0  # the 5 % speed difference is resolved only when paired


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"a": [1.0, 2.0, -1.0], "b": [1.0, 2.0]}, "sample 'a' must be > 0 everywhere; index 2 is -1.0"),
        ({"a": [1.0, 2.0], "b": [1.0]}, "sample 'b' needs at least 2 values, got 1"),
        ({"a": [1.0, 2.0, 3.0], "b": [1.0, 2.0], "paired": True}, "equal length, got 3 and 2"),
        ({"a": [1.0, 2.0], "b": [1.0, 2.0], "n_resamples": 10}, "n_resamples must be an integer >= 100"),
    ],
)
def test_bad_input_is_named(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        bootstrap_ratio_of_medians(seed=0, **kwargs)
