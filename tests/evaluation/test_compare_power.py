"""compare()'s reported power is the power of its own verdict test, which doubles a one-sided p."""

from __future__ import annotations

import numpy as np

from torchhal.evaluation.compare import _beyond_threshold, compare
from torchhal.evaluation.metrics import METRICS, Threshold
from torchhal.evaluation.stats import hodges_lehmann_shift


def test_reported_power_matches_how_often_the_verdict_shows_the_change() -> None:
    """20 per arm, sd 1, threshold 0.5, a true regression of twice the threshold. The verdict's
    test (Mann–Whitney beyond the threshold, one-sided p doubled) shows it in 32% of runs; the
    power compare() reports averages 0.35 (Welch's power at one-sided alpha/2: a little above the
    rank test's) where at one-sided alpha it averaged 0.47. The verdict is simulated over 6,000
    runs (SE 0.006); the reported power is averaged over 60 compare() calls (its spread across
    samples is 0.074, SE 0.0096): the difference has SE 0.011, so the tolerance 0.09 lies 5 SE
    from the expected 0.03 and 5.7 SE below the old 0.154."""
    rng = np.random.default_rng(4242)
    n, threshold, alpha = 20, 0.5, 0.05
    runs = 6_000
    baseline = rng.normal(100.0, 1.0, (runs, n))
    candidate = rng.normal(100.0 + 2 * threshold, 1.0, (runs, n))
    shown = 0
    for a, b in zip(candidate, baseline, strict=True):
        shift = hodges_lehmann_shift(a, b, confidence=1 - alpha).shift
        shown += _beyond_threshold(a, b, shift, threshold) < alpha  # the verdict's uncorrected test
    rate = shown / runs
    reported = [
        compare(
            candidate[i],
            baseline[i],
            metric=METRICS["latency"],
            threshold=Threshold(absolute=threshold),
            alpha=alpha,
            n_resamples=100,
        ).power
        for i in range(60)
    ]
    assert abs(float(np.mean(reported)) - rate) <= 0.09, (np.mean(reported), rate)
