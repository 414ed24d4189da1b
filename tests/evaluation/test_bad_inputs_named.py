"""Inputs that crashed deep inside or were accepted silently: each now gets an error that names the
argument, the constraint and the value, or (Welch's t at extreme magnitudes) the right answer."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import scipy.stats as st

from torchhal.evaluation.metrics import Threshold
from torchhal.evaluation.monitor import LiveMonitor
from torchhal.evaluation.stats import assign, minimum_detectable_effect, tost, welch_t_test
from torchhal.hal_core.errors import InvalidArgumentError


@pytest.mark.parametrize("alpha", [2.0, 0.0, math.nan, -0.1])
def test_minimum_detectable_effect_names_a_bad_alpha(alpha: float) -> None:
    """It read "normal quantile needs 0 < p < 1, got 0.0", naming neither alpha nor its value."""
    with pytest.raises(
        InvalidArgumentError, match=rf"^alpha must lie strictly between 0 and 1, got {alpha}$"
    ):
        minimum_detectable_effect([1.0, 2.0, 3.0], [2.0, 3.0, 5.0], 20, alpha)


@pytest.mark.parametrize("exponent", [-300, -200, 200, 300])
def test_welch_at_extreme_magnitudes_is_scipy_s_answer_at_ordinary_ones(exponent: int) -> None:
    """Values ~1e-300 squared to variances of 0 (ZeroDivisionError); ~1e300 overflowed into a df
    of NaN. Welch's t and its df do not depend on the unit, so scipy on the same values scaled
    to ~1 is the reference; the difference and its interval scale back."""
    rng = np.random.default_rng()
    a, b = (
        rng.lognormal(0.0, 1.0, int(rng.integers(2, 12))),
        rng.lognormal(0.3, 1.0, int(rng.integers(2, 12))),
    )
    unit = 10.0**exponent
    result = welch_t_test(a * unit, b * unit)
    reference = st.ttest_ind(a, b, equal_var=False)
    assert result.statistic == pytest.approx(reference.statistic, rel=1e-12)
    assert result.df == pytest.approx(reference.df, rel=1e-12)
    assert result.p_value == pytest.approx(reference.pvalue, rel=1e-9)
    low, high = reference.confidence_interval(0.95)
    assert result.interval == pytest.approx((low * unit, high * unit), rel=1e-9)
    equivalence = tost(a * unit, b * unit, -unit, unit)  # the same parts: no ZeroDivisionError
    assert equivalence.p_value == pytest.approx(tost(a, b, -1.0, 1.0).p_value, rel=1e-9)


def test_welch_with_a_spread_too_small_to_square_says_so() -> None:
    """A constant sample at 1e300 against one varying at 1e-300: no float holds the ratio of
    their variances; it raised a bare ZeroDivisionError (both variances underflowed to 0)."""
    with pytest.raises(
        InvalidArgumentError, match=r"spread is below 1e-154 of the other's magnitude \(1e\+300\)"
    ):
        welch_t_test([1e300] * 3, [1e-300, 2e-300, 4e-300])


def _monitor(**kwargs):
    args = dict(control="old", candidate="new", higher_is_better=False, threshold=Threshold(relative=0.05))
    return LiveMonitor(**{**args, **kwargs})


@pytest.mark.parametrize("max_samples", [math.nan, 25.5, "x", 40.0, True])
def test_the_monitor_refuses_a_max_samples_that_is_no_count(max_samples: object) -> None:
    """NaN was accepted and never stopped (every comparison with it is false); 25.5 was taken."""
    message = f"max_samples must be an integer (a count of observations) or None, got {max_samples!r}"
    with pytest.raises(InvalidArgumentError, match=f"^{re.escape(message)}$"):
        _monitor(max_samples=max_samples)


def test_the_monitor_takes_an_integer_max_samples_and_refuses_a_small_or_negative_one() -> None:
    assert _monitor(max_samples=np.int64(40)).max_samples == 40
    with pytest.raises(InvalidArgumentError, match=r"at least 2 × min_samples = 20, got -5"):
        _monitor(max_samples=-5)


@pytest.mark.parametrize("threshold", [0.05, "5%", {"relative": 0.05}, None])
def test_the_monitor_refuses_a_threshold_that_is_no_threshold(threshold: object) -> None:
    """A bare 0.05 was accepted and raised AttributeError at the first status()."""
    message = (
        "threshold must be a Threshold (Threshold(relative=x) or Threshold(absolute=x)), "
        f"got {threshold!r} ({type(threshold).__name__})"
    )
    with pytest.raises(InvalidArgumentError, match=f"^{re.escape(message)}$"):
        _monitor(threshold=threshold)


@pytest.mark.parametrize("weights", [["1", "2"], [1.0, "2"], [1 + 0j, 2.0]])
def test_assign_refuses_weights_that_are_no_numbers(weights: list[object]) -> None:
    """Numeric strings were converted silently ('1', '2' split 1:2), as nowhere else."""
    with pytest.raises(InvalidArgumentError, match=r"^weights must be numbers, got \["):
        assign("unit-1", ["a", "b"], weights)
