"""The always-valid sequential test: error rates with a peek after every batch, time-uniform
coverage, power, and the object's bookkeeping.

The simulations push thousands of experiments at once through `mixture_look`, the formula the
`SequentialTest` object itself evaluates at every look; `test_object_matches_the_vectorised_formula`
ties the two together on whole experiments.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from torchhal.evaluation.stats import Decision, SequentialTest
from torchhal.evaluation.stats.sequential import mixture_look
from torchhal.hal_core import telemetry
from torchhal.hal_core.errors import InvalidArgumentError

ALPHA = 0.05


def _looks(values: np.ndarray, per_look: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Running (n, mean, variance) of each row after every batch of `per_look` values."""
    n = np.arange(per_look, values.shape[1] + 1, per_look)
    sums = np.cumsum(values, axis=1)[:, n - 1]
    squares = np.cumsum(values**2, axis=1)[:, n - 1]
    mean = sums / n
    with np.errstate(invalid="ignore", divide="ignore"):  # n = 1: no variance yet (NaN), never active
        variance = (squares - sums * mean) / (n - 1)
    return n, mean, variance


def _simulate(
    a: np.ndarray,
    b: np.ndarray,
    per_look_a: int,
    per_look_b: int,
    *,
    tuning_n: int = 100,
    min_samples: int = 10,
):
    """For each experiment (row): did any look reject, and did every look's interval hold `truth`?"""
    n_a, mean_a, var_a = _looks(a, per_look_a)
    n_b, mean_b, var_b = _looks(b, per_look_b)
    difference = mean_a - mean_b
    with np.errstate(invalid="ignore"):  # NaN at the inactive n = 1 looks
        log_lr, half = mixture_look(difference, var_a, n_a, var_b, n_b, alpha=ALPHA, tuning_n=tuning_n)
    active = np.broadcast_to(np.minimum(n_a, n_b) >= min_samples, difference.shape)
    rejected = ((log_lr >= math.log(1 / ALPHA)) & active).any(axis=1)
    return rejected, difference, half, active


SE_AT_ALPHA = math.sqrt(ALPHA * (1 - ALPHA) / 10_000)


@pytest.mark.parametrize(
    ("seed", "name", "draw_a", "draw_b", "per_look_a", "per_look_b", "looks"),
    [
        (
            1,
            "normal, 10 per arm per look",
            lambda r, s: r.normal(0, 1, s),
            lambda r, s: r.normal(0, 1, s),
            10,
            10,
            100,
        ),
        (
            2,
            "unequal sds and batch sizes",
            lambda r, s: r.normal(0, 3, s),
            lambda r, s: r.normal(0, 1, s),
            5,
            15,
            100,
        ),
        (
            3,
            "skewed (lognormal σ=1)",
            lambda r, s: r.lognormal(0, 1, s),
            lambda r, s: r.lognormal(0, 1, s),
            10,
            10,
            100,
        ),
        (
            4,
            "a peek after every single value",
            lambda r, s: r.normal(0, 1, s),
            lambda r, s: r.normal(0, 1, s),
            1,
            1,
            1000,
        ),
    ],
)
def test_false_positive_rate_with_a_peek_after_every_batch(
    seed, name, draw_a, draw_b, per_look_a, per_look_b, looks
) -> None:
    rng = np.random.default_rng(seed)
    sims = 10_000
    a = draw_a(rng, (sims, per_look_a * looks))
    b = draw_b(rng, (sims, per_look_b * looks))
    rejected, *_ = _simulate(a, b, per_look_a, per_look_b)
    rate = float(rejected.mean())
    # Ville's inequality bounds the rate by α over an unbounded horizon; over a finite one the
    # always-valid test spends less, so the rate sits below α, but not at zero.
    assert rate <= ALPHA + 3 * SE_AT_ALPHA, (
        f"{name}: false-positive rate {rate:.4f} > α + 3·SE ({SE_AT_ALPHA:.4f})"
    )
    assert rate >= 0.01, f"{name}: false-positive rate {rate:.4f}: the test barely ever rejects"


def test_naive_peeking_with_a_fixed_level_test_inflates_the_error() -> None:
    """A fixed 5 % z-test after every batch of the same kind of stream: the error the mSPRT prevents."""
    rng = np.random.default_rng(2017)
    a, b = rng.normal(size=(3000, 1000)), rng.normal(size=(3000, 1000))
    n, mean_a, var_a = _looks(a, 10)
    _, mean_b, var_b = _looks(b, 10)
    z = np.abs(mean_a - mean_b) / np.sqrt(var_a / n + var_b / n)
    naive = (z[:, n >= 10] > 1.959964).any(axis=1).mean()
    assert naive > 3 * ALPHA, f"naive peeking rejected only {naive:.3f}"


@pytest.mark.parametrize("effect", [0.3, -0.15])
def test_time_uniform_coverage_and_power(effect: float) -> None:
    rng = np.random.default_rng(int(abs(effect) * 100))
    sims, per_look, looks = 4000, 10, 100
    a = rng.normal(effect, 1.0, (sims, per_look * looks))
    b = rng.normal(0.0, 1.0, (sims, per_look * looks))
    rejected, difference, half, active = _simulate(a, b, per_look, per_look)
    covered_always = ((np.abs(difference - effect) < half) | ~active).all(axis=1).mean()
    se = math.sqrt(0.95 * 0.05 / sims)
    assert covered_always >= 0.95 - 3 * se, (
        f"time-uniform coverage {covered_always:.4f} < 0.95 − 3·SE ({se:.4f})"
    )
    # 1000 per arm: the fixed-n Welch test would have power ~1.0 at 0.3 and ~0.74 at 0.15.
    assert rejected.mean() >= (0.99 if abs(effect) > 0.2 else 0.5)


def test_object_matches_the_vectorised_formula() -> None:
    rng = np.random.default_rng(7)
    sims, per_look, looks = 150, 8, 40
    a = rng.normal(0.2, 1.5, (sims, per_look * looks))
    b = rng.normal(0.0, 1.0, (sims, per_look * looks))
    _, difference, half, active = _simulate(a, b, per_look, per_look)
    for row in range(sims):
        test = SequentialTest(higher_is_better=True)
        first_stop = None
        for look in range(looks):
            chunk = slice(look * per_look, (look + 1) * per_look)
            state = test.update(a[row, chunk], b[row, chunk])
            assert state.difference == pytest.approx(difference[row, look], rel=1e-9, abs=1e-12)
            if active[row, look]:
                width = state.interval[1] - state.interval[0]
                assert width <= 2 * half[row, look] * (1 + 1e-9)
            if first_stop is None and state.decision is not Decision.CONTINUE:
                first_stop = look
                assert not (state.interval[0] <= 0.0 <= state.interval[1])
        rejected_at = np.flatnonzero(active[row] & (np.abs(difference[row]) >= half[row]))
        assert first_stop == (rejected_at[0] if rejected_at.size else None)


def test_decision_direction_follows_higher_is_better() -> None:
    rng = np.random.default_rng(3)
    faster = [rng.normal(9.0, 1.0, 50) for _ in range(20)]  # a: lower latency
    slower = [rng.normal(10.0, 1.0, 50) for _ in range(20)]
    latency = SequentialTest(higher_is_better=False)
    throughput = SequentialTest(higher_is_better=True)
    for a, b in zip(faster, slower, strict=True):
        latency.update(a, b)
        throughput.update(a, b)
    assert latency.decision is Decision.IMPROVED
    assert throughput.decision is Decision.REGRESSED
    assert latency.p_value <= ALPHA and latency.interval[1] < 0.0


def test_waits_for_min_samples_and_for_variance() -> None:
    test = SequentialTest(higher_is_better=True, min_samples=12)
    state = test.update(np.arange(11.0), np.arange(12.0))
    assert state.interval == (-math.inf, math.inf) and state.p_value == 1.0
    constant = SequentialTest(higher_is_better=True, min_samples=10)
    assert constant.update([3.0] * 10, [2.0] * 10).decision is Decision.CONTINUE
    assert constant.interval == (-math.inf, math.inf)
    state = constant.update([3.5], [])  # a's variance arrives: looking starts
    assert math.isfinite(state.interval[0]) and state.n_a == 11 and state.n_b == 10


def test_drift_that_empties_the_interval_is_logged_and_counted() -> None:
    before = telemetry.counts().get("torchhal.stats.sequential_interval_restarts", 0)
    test = SequentialTest(higher_is_better=True, min_samples=10, tuning_n=10)
    rng = np.random.default_rng(0)
    test.update(rng.normal(0.0, 0.01, 400), rng.normal(0.0, 0.01, 400))
    state = test.update(rng.normal(5.0, 0.01, 4000), rng.normal(0.0, 0.01, 4000))  # the effect jumps
    assert telemetry.counts().get("torchhal.stats.sequential_interval_restarts", 0) == before + 1
    assert state.interval[0] <= state.difference <= state.interval[1]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda t: t.update([], []), "both are empty"),
        (lambda t: t.update([1.0, math.nan], [1.0]), "sample 'a_batch' must be finite; index 1 is nan"),
        (lambda t: SequentialTest(higher_is_better=True, alpha=0.0), "alpha must lie strictly"),
        (
            lambda t: SequentialTest(higher_is_better=True, min_samples=1),
            "min_samples must be an integer >= 10, got 1",
        ),
    ],
)
def test_bad_input_is_named(call, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        call(SequentialTest(higher_is_better=True))
