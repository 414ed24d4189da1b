"""Samples constant up to floating-point rounding are constant: every statistic that refuses (or
waits on) constant samples does so when the values differ only in their last bits, as simulated
times (differences of clock readings) and means of repeated values do."""

from __future__ import annotations

import numpy as np
import pytest

from torchhal.evaluation.stats import (
    Decision,
    GroupSequentialTest,
    SequentialTest,
    minimum_detectable_effect,
    tost,
    welch_t_test,
)
from torchhal.hal_core.errors import InvalidArgumentError


def _rounded(rng: np.random.Generator, value: float, n: int) -> np.ndarray:
    """n copies of `value` that differ in their last bits (relative 1e-15), as rounding leaves them."""
    return value * (1.0 + rng.uniform(-1e-15, 1e-15, n))


def test_welch_refuses_samples_that_are_constant_but_for_rounding() -> None:
    """10 × 43.1 against 10 × 43.2 gave t = −4e13, p = 1e-119 (np.var of 10 × 43.1 is 1e-29)."""
    with pytest.raises(InvalidArgumentError, match="both samples are constant"):
        welch_t_test(np.full(10, 43.1), np.full(10, 43.2))
    rng = np.random.default_rng(1)
    for _ in range(20):
        value, other = rng.uniform(1.0, 1e3, 2)
        with pytest.raises(InvalidArgumentError, match="both samples are constant"):
            welch_t_test(_rounded(rng, value, 12), _rounded(rng, other, 9))
    varying = rng.normal(43.2, 0.1, 10)  # one arm constant, the other not: tested as before
    result = welch_t_test(_rounded(rng, 43.1, 10), varying)
    assert result.df == pytest.approx(9.0, rel=1e-6)


def test_tost_does_not_call_two_constant_samples_equivalent() -> None:
    with pytest.raises(InvalidArgumentError, match="both samples are constant"):
        tost(np.full(300, 43.1), np.full(300, 43.1), -0.01, 0.01)
    rng = np.random.default_rng(2)
    with pytest.raises(InvalidArgumentError, match="both samples are constant"):
        tost(_rounded(rng, 7.3, 50), _rounded(rng, 7.3, 50), -0.01, 0.01, relative=True)


def test_minimum_detectable_effect_refuses_constant_pilots() -> None:
    """Constant pilots planned with an sd of 1e-15 and gave an effect of 1e-14."""
    rng = np.random.default_rng(3)
    with pytest.raises(InvalidArgumentError, match="both pilots are constant"):
        minimum_detectable_effect(np.full(10, 43.1), np.full(10, 43.1), 10)
    with pytest.raises(InvalidArgumentError, match="both pilots are constant"):
        minimum_detectable_effect(_rounded(rng, 0.3, 10), _rounded(rng, 0.7, 10), 10)


@pytest.mark.parametrize(
    "make",
    [
        lambda: SequentialTest(higher_is_better=True),
        lambda: GroupSequentialTest(max_samples=200, higher_is_better=True),
    ],
)
def test_sequential_tests_wait_on_arms_constant_but_for_rounding(make) -> None:
    """Arms of 43.1 and 43.2 with rounding in the last bits: a variance of ~1e-27 made the
    difference of 0.1 look infinitely significant, and the test stopped at its first look."""
    rng = np.random.default_rng(4)
    test = make()
    for _ in range(5):
        state = test.update(_rounded(rng, 43.1, 20), _rounded(rng, 43.2, 20))
        assert state.decision is Decision.CONTINUE
        assert state.waiting is not None and "constant" in state.waiting
    state = test.update(rng.normal(43.1, 0.5, 20), rng.normal(43.1, 0.5, 20))  # variance arrives
    assert state.waiting is None
