"""Defects a demanding user hit at the edges: Student's t quantiles in the far tails at df <= 2,
the live monitor on states that arrive with legitimate traffic, the bootstrap's resample count,
and the sample store's integrity check on every open."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from torchhal.evaluation.metrics import Threshold
from torchhal.evaluation.monitor import LiveMonitor, MonitorDecision
from torchhal.evaluation.stats import bootstrap, bootstrap_ratio_of_medians
from torchhal.evaluation.stats import distributions as D
from torchhal.hal_core import InvalidArgumentError

# --- Student's t, far tails at small df -------------------------------------------------------


def _t_quantile_mpmath(p: float, df: float) -> float:
    """The t < 0 with P(T <= t) = p, at 50 digits: the root in u = log(-t) of log sf(e^u) = log p."""
    mp = pytest.importorskip("mpmath", reason="mpmath (torch's sympy needs it) is the 50-digit reference")
    mp.mp.dps = 50
    a, half = mp.mpf(df) / 2, mp.mpf(1) / 2

    def log_sf(u: object) -> object:
        x = mp.mpf(df) / (mp.mpf(df) + mp.exp(2 * u))
        return mp.log(mp.betainc(a, half, 0, x, regularized=True) / 2)

    # the power-law tail P(T > t) ≈ (df/t²)^(df/2) / (df·B(df/2, ½)) gives the start
    start = (mp.log(mp.mpf(df)) / 2 * df - mp.log(df * mp.beta(a, half)) - mp.log(mp.mpf(p))) / df
    root = mp.findroot(lambda u: log_sf(u) - mp.log(mp.mpf(p)), start)
    return -float(mp.exp(root))


def test_cauchy_quantiles_in_the_far_tail_match_the_closed_form() -> None:
    """df = 1 is Cauchy: t = tan(π(p − ½)) = −1/tan(πp). Below p = 1e-150 the old code returned
    -1.34e154 (t² overflowed, so every farther t had tail 0) or -inf."""
    rng = np.random.default_rng()
    for p in [1e-160, 1e-200, 1e-300, 1e-308, *(10.0 ** rng.uniform(-307, -150, size=20))]:
        assert D.t_ppf(p, 1.0) == pytest.approx(-1.0 / math.tan(math.pi * p), rel=1e-13), p


@pytest.mark.parametrize("df", [0.3, 0.7, 1.0, 1.5, 2.0])
def test_t_quantiles_below_1e_150_against_mpmath(df: float) -> None:
    """Quantiles beyond |t| = 1.3e154 are now found (or are -inf where they exceed the largest
    float), and their tail probabilities are the mpmath ones."""
    rng = np.random.default_rng()
    for p in 10.0 ** rng.uniform(-307, -100, size=6):
        reference = _t_quantile_mpmath(float(p), df)
        got = D.t_ppf(float(p), df)
        if math.isinf(reference) or -reference > sys.float_info.max:
            assert got == -math.inf, (p, df)
        else:
            assert got == pytest.approx(reference, rel=1e-12), (p, df)


def test_t_quantile_at_df_2_closed_form_past_the_overflow_of_t_squared() -> None:
    """df = 2: t = (2p − 1)/sqrt(2p(1 − p)), beyond 1.3e154 for subnormal p (the old code
    answered -1.34e154 for p = 1e-320, whose quantile is -7.07e159). A subnormal tail carries
    fewer bits, so the quantile found from it is good to ~1e-12 there."""
    rng = np.random.default_rng()
    for p in [5e-324, *(10.0 ** rng.uniform(-323, -309, size=10))]:
        assert D.t_ppf(p, 2.0) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-10), p


def test_t_tail_and_density_past_the_overflow_of_t_squared() -> None:
    """P(T > t) and the density at |t| > 1.3e154 were 0 (t² = inf); at df = 1 they are
    1/π·atan(1/t) ≈ 1/(πt) and 1/(π(1 + t²)) ≈ 1/(πt²), and at large df the tail is 0, not NaN."""
    mp = pytest.importorskip("mpmath", reason="mpmath (torch's sympy needs it) is the 50-digit reference")
    mp.mp.dps = 50
    rng = np.random.default_rng()
    for t in 10.0 ** rng.uniform(155, 308, size=10):
        assert D.t_sf(t, 1.0) == pytest.approx(1.0 / (math.pi * t), rel=1e-14)
        assert D.t_cdf(-t, 1.0) == pytest.approx(1.0 / (math.pi * t), rel=1e-14)
        assert D.t_sf(t, 1e12) == 0.0
    df = mp.mpf(0.5)
    for t in 10.0 ** rng.uniform(155, 200, size=10):  # df = 0.5: the density falls as t^-1.5
        scale = 1 + mp.mpf(float(t)) ** 2 / df
        density = mp.gamma((df + 1) / 2) / (mp.gamma(df / 2) * mp.sqrt(df * mp.pi)) * scale ** (-(df + 1) / 2)
        assert D.t_pdf(float(t), 0.5) == pytest.approx(float(density), rel=1e-12)


# --- the live monitor on legitimate states ------------------------------------------------------


def _monitor(**kwargs: object) -> LiveMonitor:
    args: dict[str, object] = dict(
        control="old", candidate="new", higher_is_better=False, threshold=Threshold(relative=0.05)
    )
    return LiveMonitor(**{**args, **kwargs})  # type: ignore[arg-type]


def test_relative_threshold_over_a_zero_control_mean_waits_then_decides() -> None:
    """An error rate with no errors yet in the control: status() raised InvalidArgumentError
    mid-traffic. Now it reports the effect as undefined and takes no decision on it, even with
    the sequential test already significant, and rolls back once the control's mean is off 0."""
    rng = np.random.default_rng()
    monitor = _monitor()
    monitor.observe_many("old", np.zeros(200))
    monitor.observe_many("new", rng.binomial(1, 0.5, 200).astype(float))
    status = monitor.status()
    assert status.decision is MonitorDecision.CONTINUE
    assert "undefined while the control's mean is 0" in status.reason
    assert math.isnan(status.threshold)
    assert status.p_value <= 0.05 and status.interval[0] > 0  # significant, yet not acted on
    control_errors = np.zeros(200)
    control_errors[rng.choice(200, size=4, replace=False)] = 1.0
    monitor.observe_many("old", control_errors)
    monitor.observe_many("new", rng.binomial(1, 0.5, 200).astype(float))
    status = monitor.status()
    assert status.decision is MonitorDecision.ROLL_BACK and status.reason.startswith("regressed")
    assert status.threshold == pytest.approx(0.05 * 4 / 400, rel=1e-12)


def test_zero_control_mean_still_stops_at_max_samples_and_says_why() -> None:
    monitor = _monitor(max_samples=40)
    monitor.observe_many("old", np.zeros(20))
    monitor.observe_many("new", np.zeros(20))
    status = monitor.status()
    assert status.decision is MonitorDecision.STOP and status.reason.startswith("inconclusive")
    assert "undefined" in status.reason


def test_observations_whose_squares_overflow_are_refused_and_the_monitor_goes_on() -> None:
    """A value of 1e160 was taken; then every status() raised OverflowError (the variance
    squares it) and fed the pending batch to the sequential test again at each try."""
    rng = np.random.default_rng()
    monitor = _monitor()
    monitor.observe_many("old", rng.normal(10.0, 1.0, 50))
    monitor.observe_many("new", rng.normal(10.0, 1.0, 50))
    huge = float(10.0 ** rng.uniform(101, 308))
    with pytest.raises(
        InvalidArgumentError, match=r"observations of 'old' must lie within ± 1e\+100; index 2 is "
    ):
        monitor.observe_many("old", [10.0, 11.0, -huge])
    status = monitor.status()
    assert (status.n_control, status.n_candidate) == (50, 50)
    assert status.decision in (MonitorDecision.CONTINUE, MonitorDecision.STOP)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["abc"], "sample 'old' must be numbers, got \\['abc'\\]"),
        ([1 + 2j], "sample 'old' must be numbers"),
        (np.ones((2, 2)), "sample 'old' must be 1-D, got shape \\(2, 2\\)"),
    ],
)
def test_observations_that_are_not_finite_numbers_are_refused_naming_the_variant(
    values: object, message: str
) -> None:
    """A string or a complex number raised Python's bare ValueError/TypeError, naming no variant."""
    monitor = _monitor()
    with pytest.raises(InvalidArgumentError, match=message):
        monitor.observe_many("old", values)  # type: ignore[arg-type]
    assert monitor.status().n_control == 0


def test_a_generator_of_observations_is_read_once() -> None:
    monitor = _monitor()
    monitor.observe_many("old", (float(i) for i in range(5)))
    assert monitor.status().n_control == 5


# --- the bootstrap's resample count and chunks ------------------------------------------------


@pytest.mark.parametrize("paired", [False, True])
def test_bootstrap_result_does_not_depend_on_the_chunk_size(
    paired: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unpaired, a chunk drew a's indices then b's from one stream, so the same seed gave other
    intervals when the chunk size changed (one row per chunk against all rows in one)."""
    rng = np.random.default_rng()
    n = int(rng.integers(5, 40))
    a, b = rng.lognormal(0.0, 0.3, n), rng.lognormal(0.1, 0.3, n if paired else int(rng.integers(5, 40)))
    seed = int(rng.integers(2**32))
    monkeypatch.setattr(bootstrap, "_VALUES_PER_CHUNK", 10**12)
    whole = bootstrap_ratio_of_medians(a, b, paired=paired, n_resamples=3001, seed=seed)
    monkeypatch.setattr(bootstrap, "_VALUES_PER_CHUNK", 1)  # one resample per chunk
    assert bootstrap_ratio_of_medians(a, b, paired=paired, n_resamples=3001, seed=seed) == whole
    monkeypatch.setattr(bootstrap, "_VALUES_PER_CHUNK", 7 * (a.size + b.size))  # 7 rows a chunk
    assert bootstrap_ratio_of_medians(a, b, paired=paired, n_resamples=3001, seed=seed) == whole


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_resamples": 10**12}, "n_resamples must be at most 10,000,000 .* got 1,000,000,000,000"),
        ({"n_resamples": 10_000_001}, "n_resamples must be at most .* got 10,000,001"),
        ({"seed": None}, "seed must be an integer >= 0, got None"),
        ({"seed": -1}, "seed must be an integer >= 0, got -1"),
    ],
)
def test_bootstrap_refuses_a_resample_count_it_cannot_hold_and_a_missing_seed(
    kwargs: dict[str, object], message: str
) -> None:
    """10**12 resamples asked numpy for 7 TiB (MemoryError); seed=None drew a fresh seed, so
    the intervals changed from call to call with nothing said."""
    args: dict[str, object] = {"n_resamples": 1000, "seed": 0, **kwargs}
    with pytest.raises(InvalidArgumentError, match=message):
        bootstrap_ratio_of_medians([1.0, 2.0, 3.0], [1.5, 2.5, 3.5], **args)  # type: ignore[arg-type]
