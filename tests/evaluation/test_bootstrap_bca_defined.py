"""When BCa is defined for the ratio of medians, and what `compare` records.

`compare` promised a percentile interval "where BCa is undefined" behind a test of `bca is None`
that never held. BCa's transform 1 − a·(z0 + z) stays positive for every unpaired pair of samples
(|a| <= 1/(6√6), see `bootstrap_ratio_of_medians`), so the fallback was dead and is gone; the
paired bootstrap can fold it at confidences within ~1e-12 of 1, and then said nothing: it
returned the largest resampled ratio as both ends, an interval excluding the estimate."""

from __future__ import annotations

import math

import numpy as np
import pytest

from torchhal.evaluation.compare import compare
from torchhal.evaluation.metrics import METRICS, Threshold
from torchhal.evaluation.stats import bootstrap_ratio_of_medians
from torchhal.evaluation.stats.bootstrap import _jackknife_acceleration
from torchhal.hal_core.errors import InvalidArgumentError

BOUND = 1.0 / (6.0 * math.sqrt(6.0))  # the unpaired acceleration's largest magnitude, at n = 3


def test_unpaired_accelerations_stay_within_the_bound_that_keeps_bca_defined() -> None:
    """Fresh samples of 2..9 values spread over up to 8 orders of magnitude: |a| never exceeds
    1/(6√6), and three values with one far out reach it; with |z0| <= 5.33 and |z| <= 8.3 the
    transform 1 − a·(z0 + z) stays above 0.07."""
    rng = np.random.default_rng()
    for _ in range(3000):
        a = np.exp(rng.normal(0.0, rng.uniform(0.01, 8.0), rng.integers(2, 10)))
        b = np.exp(rng.normal(0.0, rng.uniform(0.01, 8.0), rng.integers(2, 10)))
        assert abs(_jackknife_acceleration(a, b, False)) <= BOUND * (1 + 1e-12), (a, b)
    far = float(10 ** rng.uniform(3, 8))
    worst = _jackknife_acceleration(np.array([1.0, 1.0 + 1 / far, far]), np.array([2.0, 2.0]), False)
    assert abs(worst) == pytest.approx(BOUND, rel=1e-3)
    assert 1.0 - BOUND * (5.33 + 8.3) > 0.07


def test_a_paired_bca_that_folds_is_refused_naming_the_confidence() -> None:
    """Eight pairs spread over six orders of magnitude (a = −0.133, z0 = −0.41) at the largest
    confidence below 1: the lower level's transform is −0.15, and the old code returned
    (771058, 771058), the largest resampled ratio twice, for a ratio of 0.022."""
    a = [0.00384, 4.16, 104.0, 3570.0, 921.0, 0.0139, 0.122, 0.151]
    b = [0.703, 191.0, 649.0, 0.00463, 2220.0, 1.03, 0.673, 447.0]
    confidence = 1.0 - 2.0**-52
    with pytest.raises(
        InvalidArgumentError,
        match=rf"^BCa is undefined at confidence {confidence!r} for these samples: its transform",
    ):
        bootstrap_ratio_of_medians(a, b, paired=True, confidence=confidence, seed=0)
    ordinary = bootstrap_ratio_of_medians(a, b, paired=True, confidence=0.95, seed=0)
    assert ordinary.bca[0] <= ordinary.ratio <= ordinary.bca[1]


def test_compare_records_the_bca_interval_it_reports() -> None:
    rng = np.random.default_rng()
    candidate, baseline = rng.lognormal(0.1, 0.5, 12), rng.lognormal(0.0, 0.5, 15)
    seed = int(rng.integers(1000))
    result = compare(
        candidate, baseline, metric=METRICS["latency"], threshold=Threshold(relative=0.05), seed=seed
    )
    boot = bootstrap_ratio_of_medians(candidate, baseline, confidence=0.95, seed=seed)
    assert result.ratio_method == "bca" and result.ratio_interval == boot.bca
