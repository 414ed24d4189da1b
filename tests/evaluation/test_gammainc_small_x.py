"""The incomplete gamma function far below its mean, x << a: the Stirling branch (a >= 10) formed
r = (x − a)/a, which rounds to −1 for x/a < ~1e-16 (log1p(−1): a math domain error, reaching the
sample-ratio check through 21 or more arms that match their design up to rounding) and lost x/a's
digits before that (the lower tail 9 times too large at a = 11, x = 1e-15)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.special as sc
import scipy.stats as st

from torchhal.evaluation.stats import sample_ratio_mismatch, special
from torchhal.evaluation.stats.distributions import chi2_sf


def test_the_lower_tail_far_below_the_mean_matches_scipy() -> None:
    """a over 0.5 .. 1e5 (both branches; beyond, the tails near x = a lose ~a·1e-16 to rounding
    of their own), x/a log-uniform down to 1e-300, drawn afresh each run."""
    rng = np.random.default_rng()
    compared = 0
    for _ in range(3000):
        a = float(10 ** rng.uniform(-0.3, 5))
        x = a * float(10 ** rng.uniform(-300, 0))
        lower, upper = special.gammainc(a, x)
        reference = sc.gammainc(a, x)
        assert upper == pytest.approx(sc.gammaincc(a, x), rel=1e-9, abs=1e-300), (a, x)
        if reference > 1e-290:  # the relative error of scipy's own result grows in the subnormals
            assert lower == pytest.approx(reference, rel=1e-9), (a, x)
            compared += 1
        else:
            assert lower <= 1e-280, (a, x, lower)
    assert compared > 300  # the grid reaches tails that do not underflow


@pytest.mark.parametrize(
    ("a", "x"), [(1e7, 1e-10), (20.0, 1e-16), (10.0, 1e-300), (11.0, 1e-15), (1e7, 5e-324), (10.0, 1e-10)]
)
def test_the_review_s_points(a: float, x: float) -> None:
    lower, upper = special.gammainc(a, x)
    assert lower == pytest.approx(sc.gammainc(a, x), rel=1e-12, abs=0.0)
    assert upper == 1.0


def test_twenty_one_arms_that_match_their_design_pass_the_sample_ratio_check() -> None:
    """Counts equal to the design up to rounding give a chi-square of ~1e-30, not 0."""
    assert chi2_sf(1e-20, 40) == 1.0
    for counts, ratios in (([3] * 21, [1 / 3] * 21), ([300_000] * 21, [0.3] * 21)):
        result = sample_ratio_mismatch(counts, ratios)
        expected = np.array(ratios) / sum(ratios) * sum(counts)
        assert result.p_value == pytest.approx(st.chisquare(counts, expected).pvalue, abs=1e-12)
        assert result.p_value == 1.0
