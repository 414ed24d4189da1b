"""Order-statistic quantile intervals at a confidence exactly at a rank boundary.

The size check read the extreme tails as (1 − q)^n and q^n, the rank search through the incomplete
beta, 2 ulp higher: at the median of 5 values and 0.9375 (the textbook level of (x_(1), x_(5)))
the lower rank came out 0 and the "interval" was (max, max); elsewhere ranks past n raised
IndexError. Both now read `binom_tails`."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import numpy as np
import pytest
import scipy.stats as st

from torchhal.evaluation.stats import quantile_ci
from torchhal.evaluation.stats.intervals import minimum_size_for_quantile_ci
from torchhal.hal_core.errors import InvalidArgumentError


def test_the_median_of_five_at_its_exact_level_is_the_textbook_interval() -> None:
    result = quantile_ci([3.0, 1.0, 4.0, 1.5, 9.0], 0.5, 0.9375)
    assert result.ranks == (1, 5) and result.interval == (1.0, 9.0)
    assert result.coverage == 0.9375


def _textbook_ranks(n: int, q: float, tail: float) -> tuple[int, int] | None:
    """Ranks from exact rational binomial tails: the largest l with P(B <= l − 1) <= tail and the
    smallest u with P(B >= u) <= tail; None when no l >= 1 or u <= n qualifies."""
    qq, t = Fraction(q), Fraction(tail)
    pmf = [math.comb(n, i) * qq**i * (1 - qq) ** (n - i) for i in range(n + 1)]
    below = [sum(pmf[:k]) for k in range(n + 2)]  # below[k] = P(B <= k − 1)
    lower = max(k for k in range(n + 2) if below[k] <= t)
    upper = min(u for u in range(1, n + 2) if 1 - below[u] <= t)
    return (lower, upper) if lower >= 1 and upper <= n else None


def test_dyadic_quantiles_at_their_extreme_tails_get_the_exact_ranks() -> None:
    """For q = 1/2, 1/4, 3/4 every power of q and 1 − q below 2^-60 is a float, and so is the
    confidence 1 − 2·tail: the implementation must land on the exact rational answer."""
    rng = np.random.default_rng()  # fresh values each run: the ranks must not depend on them
    for q in (0.5, 0.25, 0.75):
        for n in range(1, 25):
            for tail in {(1 - q) ** n, q**n}:
                confidence = 1.0 - 2.0 * tail
                if not 0.0 < confidence < 1.0:
                    continue
                x = rng.normal(size=n)
                expected = _textbook_ranks(n, q, 0.5 * (1.0 - confidence))
                if expected is None:
                    with pytest.raises(InvalidArgumentError, match=f"got {n}: even the widest"):
                        quantile_ci(x, q, confidence)
                    continue
                result = quantile_ci(x, q, confidence)
                assert result.ranks == expected, (q, n, confidence)
                ordered = np.sort(x)
                assert result.interval == (ordered[expected[0] - 1], ordered[expected[1] - 1])


def test_every_boundary_confidence_gives_valid_tight_ranks_or_a_clear_error() -> None:
    """The review's grid (388 silent rank-0 results, ~140 IndexErrors), sampled afresh each run,
    against scipy's binomial: ranks inside 1..n, coverage >= confidence, no tighter rank would
    do; or, below the minimum size, an error naming the confidence, n and the best confidence."""
    rng = np.random.default_rng()
    qs = (0.5, 0.25, 0.75, 0.1, 0.9, 0.3, 0.05, 0.2, 0.6, 0.01)
    for _ in range(400):
        q, n = float(rng.choice(qs)), int(rng.integers(2, 400))
        tail = float(rng.choice([(1 - q) ** n, q**n]))
        confidence = 1.0 - 2.0 * tail
        if not 0.0 < confidence < 1.0:
            continue
        tail = 0.5 * (1.0 - confidence)
        x = rng.lognormal(size=n)
        if n < minimum_size_for_quantile_ci(q, confidence):
            with pytest.raises(InvalidArgumentError) as caught:
                quantile_ci(x, q, confidence)
            message = str(caught.value)
            assert f"a confidence of {confidence!r} for the {q!r} quantile" in message
            best = float(re.search(rf"the best confidence at n = {n} is (\S+)$", message).group(1))
            worst = max(st.binom.cdf(0, n, q), st.binom.sf(n - 1, n, q))
            assert best == pytest.approx(max(0.0, 1.0 - 2.0 * worst), rel=1e-5, abs=1e-12)
            assert best < confidence
            if best > 0.0:  # the level the error names is one these values reach
                assert 1 <= quantile_ci(x, q, best).ranks[0]
            continue
        result = quantile_ci(x, q, confidence)
        lower, upper = result.ranks
        assert 1 <= lower <= upper <= n, (q, n, confidence, result.ranks)
        ordered = np.sort(x)
        assert result.interval == (ordered[lower - 1], ordered[upper - 1])
        low_tail, high_tail = st.binom.cdf(lower - 1, n, q), st.binom.sf(upper - 1, n, q)
        assert result.coverage == pytest.approx(1.0 - low_tail - high_tail, abs=1e-12)
        assert low_tail <= tail * (1 + 1e-9) and high_tail <= tail * (1 + 1e-9)
        # tight: one rank in from either side would leave more than the tail outside
        assert lower == n or st.binom.cdf(lower, n, q) > tail * (1 - 1e-9)
        assert upper == 1 or st.binom.sf(upper - 2, n, q) > tail * (1 - 1e-9)


def test_too_few_values_name_the_confidence_n_and_the_best_confidence() -> None:
    message = (
        "a confidence of 0.96 for the 0.5 quantile needs at least 6 values, got 5: even the widest "
        "interval, (x_(1), x_(n)), leaves 0.03125 in a tail, more than (1 − confidence)/2 = 0.02; "
        "the best confidence at n = 5 is 0.9375"
    )
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        quantile_ci(np.arange(5.0), 0.5, 0.96)
    with pytest.raises(InvalidArgumentError, match=r"got 1: .* the best confidence at n = 1 is 0.0$"):
        quantile_ci([1.0], 0.3, 0.5)
