"""The live monitor on simulated streams: A/A, planted regressions and improvements, a broken split."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from torchhal.evaluation.metrics import Threshold
from torchhal.evaluation.monitor import LiveMonitor, MonitorDecision
from torchhal.hal_core import InvalidArgumentError

BATCH = 20


def _monitor(**kwargs):
    args = dict(control="old", candidate="new", higher_is_better=False, threshold=Threshold(relative=0.05))
    return LiveMonitor(**{**args, **kwargs})


def _run(monitor, rng, control_mean, candidate_mean, sd=1.0, looks=60):
    """Feed batches, looking after each; return the first non-continue status and every status."""
    statuses = []
    for _ in range(looks):
        monitor.observe_many("old", rng.normal(control_mean, sd, BATCH))
        monitor.observe_many("new", rng.normal(candidate_mean, sd, BATCH))
        statuses.append(monitor.status())
        if statuses[-1].decision is not MonitorDecision.CONTINUE:
            return statuses[-1], statuses
    return statuses[-1], statuses


@pytest.mark.parametrize("seed", range(8))
def test_a_a_stream_never_rolls_back_or_claims_an_improvement(seed):
    rng = np.random.default_rng(seed)
    _, statuses = _run(_monitor(), rng, 10.0, 10.0)
    for s in statuses:
        assert s.decision in (MonitorDecision.CONTINUE, MonitorDecision.STOP)
        if s.decision is MonitorDecision.STOP:
            assert s.reason.startswith("equivalent"), s.reason
            assert -s.threshold < s.interval[0] and s.interval[1] < s.threshold


@pytest.mark.parametrize("seed", range(4))
def test_planted_regression_rolls_back_and_the_interval_covers_the_truth(seed):
    rng = np.random.default_rng(100 + seed)
    final, statuses = _run(_monitor(), rng, 10.0, 12.0)
    assert final.decision is MonitorDecision.ROLL_BACK, final.reason
    assert final.reason.startswith("regressed")
    assert final.interval[0] > 0 and final.p_value <= 0.05
    assert final.n_candidate < 60 * BATCH
    for s in statuses:  # always valid: the true difference 2.0 is inside every interval
        assert s.interval[0] <= 2.0 <= s.interval[1]


def test_planted_improvement_stops():
    rng = np.random.default_rng(7)
    final, _ = _run(_monitor(), rng, 10.0, 8.0)
    assert final.decision is MonitorDecision.STOP and final.reason.startswith("improved")
    assert final.difference < 0


def test_higher_is_better_metric_reads_the_sign_the_other_way():
    rng = np.random.default_rng(8)
    final, _ = _run(_monitor(higher_is_better=True), rng, 100.0, 120.0, sd=10.0)
    assert final.decision is MonitorDecision.STOP and final.reason.startswith("improved")


def test_sample_ratio_mismatch_rolls_back():
    """2000 : 1700 against 50:50. The anytime-valid check needs more units than a one-look test:
    1000 : 850 (one-look p = 5e-4) gives p = 0.014, and no prior could flag it at 0.001 (the
    likelihood ratio at the best split is 440); the same ratio is flagged from ~2,700 units."""
    monitor = _monitor()
    rng = np.random.default_rng(9)
    monitor.observe_many("old", rng.normal(10.0, 1.0, 1000))
    monitor.observe_many("new", rng.normal(10.0, 1.0, 850))
    assert monitor.status().srm_p_value == pytest.approx(0.0137, abs=1e-4)
    monitor.observe_many("old", rng.normal(10.0, 1.0, 1000))
    monitor.observe_many("new", rng.normal(10.0, 1.0, 850))
    status = monitor.status()
    assert status.decision is MonitorDecision.ROLL_BACK
    assert "sample ratio mismatch" in status.reason and status.srm_p_value < 0.001
    # the same counts fit a 1000 : 850 design
    matched = _monitor(weights=(1000, 850))
    matched.observe_many("old", rng.normal(10.0, 1.0, 2000))
    matched.observe_many("new", rng.normal(10.0, 1.0, 1700))
    assert matched.status().srm_p_value == 1.0


def test_budget_exhausted_stops_as_inconclusive():
    rng = np.random.default_rng(10)
    final, _ = _run(_monitor(max_samples=200), rng, 10.0, 10.3, sd=3.0)
    assert final.decision is MonitorDecision.STOP and final.reason.startswith("inconclusive")
    assert final.n_control + final.n_candidate == 200


def test_assignment_is_deterministic_and_follows_the_weights():
    monitor = _monitor(weights=(0.9, 0.1), salt="exp-42")
    arms = [monitor.assign(f"request-{i}") for i in range(5000)]
    assert arms == [monitor.assign(f"request-{i}") for i in range(5000)]
    share = arms.count("new") / len(arms)
    sd = math.sqrt(0.1 * 0.9 / len(arms))
    assert abs(share - 0.1) < 4 * sd, f"candidate share {share:.4f}, expected 0.1 ± {4 * sd:.4f}"


def test_observations_from_many_threads_are_all_counted():
    monitor = _monitor()
    values = np.random.default_rng().normal(10.0, 1.0, 400)

    def feed(arm):
        for v in values:
            monitor.observe(arm, float(v))

    threads = [threading.Thread(target=feed, args=(arm,)) for arm in ("old", "new", "old", "new")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    status = monitor.status()
    assert (status.n_control, status.n_candidate) == (800, 800)


def test_bad_monitor_input_is_refused():
    monitor = _monitor()
    with pytest.raises(InvalidArgumentError, match="unknown variant 'other'"):
        monitor.observe("other", 1.0)
    with pytest.raises(InvalidArgumentError, match="index 1 is nan"):
        monitor.observe_many("old", [1.0, math.nan])
    with pytest.raises(InvalidArgumentError, match="must differ, both are 'x'"):
        LiveMonitor(control="x", candidate="x", higher_is_better=True, threshold=Threshold(relative=0.1))
    with pytest.raises(
        InvalidArgumentError, match="max_samples must be at least 2 × min_samples = 20, got 5"
    ):
        _monitor(max_samples=5)
