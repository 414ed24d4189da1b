"""The always-valid test at unequal arms (a canary's 1:9 split) of skewed data: with equal arms the
skew of the two means cancels, at 1:9 the smaller arm's skew is left in the difference, and with
looks from 10 values per arm the A/A false-positive rate was 2-3 times α. Looks now wait for the
variance's degrees of freedom and a nearly symmetric difference (sequential.SKEWNESS_LIMIT).

The simulations push whole experiments through the functions the object evaluates at each look;
`test_the_object_waits_and_decides_where_the_vectorised_gate_says` ties the two together.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from torchhal.evaluation.metrics import Threshold
from torchhal.evaluation.monitor import LiveMonitor, MonitorDecision
from torchhal.evaluation.stats import Decision, SequentialTest
from torchhal.evaluation.stats.sequential import (
    MIN_SAMPLES_FLOOR,
    SKEWNESS_LIMIT,
    _RunningMoments,
    difference_skewness,
    mixture_look,
    variance_df,
)

ALPHA = 0.05
RATIO = 9  # values of b per value of a at every look: the candidate gets 10 % of the traffic


def _moments(values: np.ndarray, per_look: int) -> tuple[np.ndarray, ...]:
    """Running n, mean, sum of squared and of cubed deviations of each row after every look."""
    n = np.arange(per_look, values.shape[1] + 1, per_look)
    s1, s2, s3 = (np.cumsum(values**k, axis=1)[:, n - 1] for k in (1, 2, 3))
    mean = s1 / n
    return n, mean, s2 - n * mean**2, s3 - 3 * mean * s2 + 2 * n * mean**3


def _gates(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per experiment and look: log Λ, the old gate (min_samples per arm) and the new one."""
    n_a, mean_a, m2_a, m3_a = _moments(a, 1)
    n_b, mean_b, m2_b, m3_b = _moments(b, RATIO)
    with np.errstate(invalid="ignore", divide="ignore"):  # n = 1: no variance yet, never a look
        log_lr, _ = mixture_look(
            mean_a - mean_b, m2_a / (n_a - 1), n_a, m2_b / (n_b - 1), n_b, alpha=ALPHA, tuning_n=100
        )
        skew = difference_skewness(m2_a + m2_b, m3_a + m3_b, n_a, n_b)
        df = variance_df(n_a, n_b)
    old = np.broadcast_to(np.minimum(n_a, n_b) >= MIN_SAMPLES_FLOOR, log_lr.shape)
    new = old & (df >= 2 * (MIN_SAMPLES_FLOOR - 1)) & (np.abs(skew) <= SKEWNESS_LIMIT)
    return log_lr, old, new


def _rates(draw, seed: int, runs: int, looks: int) -> tuple[float, float, np.ndarray]:
    """A/A false-positive rates with the old and the new gate, and each run's first open look."""
    rng = np.random.default_rng(seed)
    old_hits = new_hits = 0
    first_look = []
    for rows in np.array_split(np.arange(runs), runs * looks // 200_000):  # arrays of ~15 MB
        log_lr, old, new = _gates(draw(rng, (rows.size, looks)), draw(rng, (rows.size, RATIO * looks)))
        crossed = log_lr >= math.log(1 / ALPHA)
        old_hits += int((crossed & old).any(axis=1).sum())
        new_hits += int((crossed & new).any(axis=1).sum())
        first_look.append(np.where(new.any(axis=1), new.argmax(axis=1) + 1, 0))  # n_a is look + 1
    return old_hits / runs, new_hits / runs, np.concatenate(first_look)


@pytest.mark.parametrize(
    ("seed", "name", "draw", "looks"),
    [
        (11, "exponential", lambda r, s: r.exponential(1.0, s), 400),
        (12, "lognormal(0, 1)", lambda r, s: r.lognormal(0.0, 1.0, s), 2000),
    ],
)
def test_skewed_a_a_at_one_to_nine_keeps_the_false_positive_rate_at_alpha(seed, name, draw, looks) -> None:
    """A look after every 1 + 9 values. With looks from 10 values per arm the rate was ~0.11
    (exponential) and ~0.16 (lognormal); the gate brings it to ~0.02 and ~0.01. With 4,000 runs
    α + 3·SE is 0.060: the old rates lie ~16 and ~33 SE above α. The horizon lets the test look in
    nearly every run (lognormal's first look comes at ~800 values in the smaller arm)."""
    runs = 4000
    old, new, first_look = _rates(draw, seed, runs, looks)
    bound = ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / runs)
    assert old > bound, f"{name}: looks from min_samples alone gave only {old:.4f} (the defect is gone?)"
    assert new <= bound, f"{name}: false-positive rate {new:.4f} > α + 3·SE = {bound:.4f}"
    assert np.mean(first_look > 0) >= 0.9, f"{name}: the gate never opened in most runs"


def test_normal_data_at_one_to_nine_look_early_and_stay_below_alpha() -> None:
    """Normal data pay only the degrees of freedom: 16 values in the smaller arm rather than 10
    (variance_df(15, 135) = 17.3 < 18 = 2·(10 − 1) <= variance_df(16, 144) = 18.5), and the
    pooled skewness of normal data stays far below the limit."""
    runs = 4000
    _, new, first_look = _rates(lambda r, s: r.normal(0.0, 1.0, s), 13, runs, looks=300)
    assert np.mean(first_look == 16) >= 0.99, np.unique(first_look, return_counts=True)
    assert new <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / runs), new


def test_the_object_waits_and_decides_where_the_vectorised_gate_says() -> None:
    """Exponential arms at 1:9, half of them with a real difference: the object's first look and
    first decision fall on the looks the vectorised gate and formula give. Looking from 10 values
    per arm, the object took its first look at look 10 in every run."""
    rng = np.random.default_rng(5)
    runs, looks = 40, 150
    a = rng.exponential(1.0, (runs, looks)) + np.repeat([0.0, 0.6], runs // 2)[:, None]
    b = rng.exponential(1.0, (runs, RATIO * looks))
    log_lr, _, gate = _gates(a, b)
    decided = gate & (log_lr >= math.log(1 / ALPHA))
    reasons = set()
    for row in range(runs):
        test = SequentialTest(higher_is_better=True)
        first_look = first_stop = None
        for look in range(looks):
            state = test.update(a[row, look : look + 1], b[row, RATIO * look : RATIO * (look + 1)])
            if first_look is None and state.waiting is None:
                first_look = look
            if state.waiting is not None and look >= MIN_SAMPLES_FLOOR:
                reasons.add(state.waiting.split(":")[0])
            if first_stop is None and state.decision is not Decision.CONTINUE:
                first_stop = look
        expected_look = int(gate[row].argmax()) if gate[row].any() else None
        expected_stop = int(decided[row].argmax()) if decided[row].any() else None
        assert (first_look, first_stop) == (expected_look, expected_stop), row
    assert "skewed data at unequal arms" in reasons, reasons
    assert any(decided[runs // 2 :].any(axis=1)), "no run with a real difference decided: no power"


def test_the_monitor_says_a_canary_of_skewed_values_waits_for_the_normal_approximation() -> None:
    rng = np.random.default_rng(3)
    monitor = LiveMonitor(
        control="old",
        candidate="new",
        higher_is_better=False,
        threshold=Threshold(relative=0.05),
        weights=(0.9, 0.1),
    )
    monitor.observe_many("old", rng.exponential(10.0, 180))
    monitor.observe_many("new", rng.exponential(10.0, 20))
    status = monitor.status()
    assert status.decision is MonitorDecision.CONTINUE
    assert status.reason.startswith("no decision yet: skewed data at unequal arms"), status.reason
    assert "the smaller arm needs about" in status.reason


def test_running_third_moments_merge_batch_by_batch() -> None:
    """The merged sum of cubed deviations equals the direct one, whatever the batches."""
    rng = np.random.default_rng(17)
    for _ in range(20):
        values = rng.lognormal(2.0, 1.0, rng.integers(2, 200))
        cuts = np.sort(rng.choice(np.arange(1, values.size), size=min(5, values.size - 1), replace=False))
        moments = _RunningMoments()
        for batch in np.split(values, cuts):
            moments.add(batch)
        deviations = values - values.mean()
        assert moments.m3 == pytest.approx(float(np.sum(deviations**3)), rel=1e-9)
        assert moments.m2 == pytest.approx(float(np.sum(deviations**2)), rel=1e-9)
