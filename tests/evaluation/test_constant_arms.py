"""Two arms constant at different values (a latency quantised to one tick per arm, an error rate
of 0 against 1): the mSPRT has no variance to test on, so the sequential test waits. The monitor
said "no decision yet" forever without saying why; the state and the reason now say it."""

from __future__ import annotations

import random

import numpy as np
import pytest

from torchhal.evaluation.metrics import Threshold
from torchhal.evaluation.monitor import LiveMonitor, MonitorDecision
from torchhal.evaluation.stats import Decision, GroupSequentialTest, SequentialTest

CONSTANT = "both arms constant so far: the test has no variance to test on, and looks once either varies"


def _levels(integers=False):
    """Two different constants: integers (exact in floating point) or not (43.1's copies have a
    mean that is not 43.1, and read as a variance that rounding was a decision at p = 0)."""
    if integers:
        control = random.randint(1, 100)
        return control, control + random.choice([-1, 1]) * random.randint(1, 50)
    control = random.uniform(1, 100)
    return control, control + random.choice([-1, 1]) * random.uniform(1, 50)


@pytest.mark.parametrize("integers", [True, False], ids=["integers", "floats"])
def test_the_sequential_state_says_why_it_waits(integers):
    test = SequentialTest(higher_is_better=False, min_samples=10)
    assert test.state.waiting == "fewer than min_samples = 10 values in an arm so far"
    a, b = _levels(integers)
    n = random.randint(10, 500)
    state = test.update(np.full(n, a), np.full(n, b))
    assert state.decision is Decision.CONTINUE and state.p_value == 1.0
    assert state.difference == pytest.approx(a - b) and state.interval == (-np.inf, np.inf)
    assert state.waiting == CONSTANT
    # once an arm varies the test looks, and its state says it has (b grows too: at unequal arms
    # a skewed sample may still wait, see sequential.SKEWNESS_LIMIT)
    state = test.update(a + np.random.default_rng().normal(0, 0.01, n), np.full(n, b))
    assert state.waiting is None and state.p_value < 1.0 and np.isfinite(state.interval).all()


def test_the_monitor_says_why_there_is_no_decision():
    control, candidate = _levels()
    monitor = LiveMonitor(
        control="old", candidate="new", higher_is_better=False, threshold=Threshold(absolute=0.5)
    )
    assert monitor.status().reason == "no decision yet: fewer than min_samples = 10 values in an arm so far"
    n = random.randint(10, 1000)
    monitor.observe_many("old", [control] * n)
    monitor.observe_many("new", [candidate] * n)
    status = monitor.status()
    assert status.decision is MonitorDecision.CONTINUE
    assert status.reason == f"no decision yet: {CONSTANT}"
    assert status.difference == pytest.approx(candidate - control)


def test_max_samples_stops_saying_why_it_was_inconclusive():
    control, candidate = _levels()
    monitor = LiveMonitor(
        control="old",
        candidate="new",
        higher_is_better=True,
        threshold=Threshold(relative=0.1),
        max_samples=40,
    )
    monitor.observe_many("old", [control] * 20)
    monitor.observe_many("new", [candidate] * 20)
    status = monitor.status()
    assert status.decision is MonitorDecision.STOP
    assert (
        status.reason == f"inconclusive: 40 observations reached max_samples without a decision ({CONSTANT})"
    )


def test_a_zero_control_mean_and_constant_arms_both_said():
    """An error rate: no errors in the control, every request failing in the candidate."""
    monitor = LiveMonitor(
        control="old", candidate="new", higher_is_better=False, threshold=Threshold(relative=0.1)
    )
    monitor.observe_many("old", [0.0] * 30)
    monitor.observe_many("new", [1.0] * 30)
    reason = monitor.status().reason
    assert reason.startswith(
        f"no decision yet: {CONSTANT}; the relative effect is undefined while the control's mean is 0"
    )


def test_group_sequential_does_not_decide_on_rounding():
    """It shares the running moments: two constant arms of non-integers gave z ~ 1e15 and a stop."""
    a, b = _levels()
    test = GroupSequentialTest(max_samples=200, higher_is_better=True)
    state = test.update(np.full(100, a), np.full(100, b))
    assert state.decision is Decision.CONTINUE and state.boundary == np.inf
    assert state.difference == a - b  # the constants themselves, not their rounded means


def test_group_sequential_says_why_an_update_was_no_look():
    """As the always-valid test does: too few values, constant arms, or no new information (the
    smaller arm did not grow); a look clears it."""
    rng = np.random.default_rng(7)
    test = GroupSequentialTest(max_samples=200, higher_is_better=True, min_samples=10)
    assert test.state.waiting == "fewer than min_samples = 10 values in an arm so far"
    assert test.update(rng.normal(size=5), rng.normal(size=5)).waiting == test.state.waiting
    constant = test.update(np.full(20, 1.0), np.full(20, 1.0))
    assert constant.waiting is None  # the first 5 values of each arm varied
    fresh = GroupSequentialTest(max_samples=200, higher_is_better=True)
    assert fresh.update(np.full(30, 2.0), np.full(30, 3.0)).waiting.startswith("both arms constant so far")
    looked = fresh.update(rng.normal(size=5), rng.normal(size=5))
    assert looked.waiting is None and np.isfinite(looked.z)
    assert fresh.update(rng.normal(size=4), []).waiting.startswith("no information since the last look")
