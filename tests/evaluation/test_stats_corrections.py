"""Holm and Benjamini–Hochberg: the worked example of Benjamini & Hochberg (1995) and statsmodels."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from torchhal.evaluation.stats import benjamini_hochberg, holm
from torchhal.hal_core.errors import InvalidArgumentError

# Benjamini & Hochberg (1995), section 4: fifteen p-values from a multiple-endpoint trial.
BH_1995 = [
    0.0201,
    0.0001,
    0.0004,
    0.0019,
    0.0095,
    0.0278,
    0.0298,
    0.0344,
    0.0459,
    0.3240,
    0.4262,
    0.5719,
    0.6528,
    0.7590,
    1.0,
]


def test_benjamini_hochberg_paper_example() -> None:
    result = benjamini_hochberg(BH_1995, alpha=0.05)
    # The paper rejects the four smallest (p_(4) = 0.0095 <= 4/15·0.05; p_(5) = 0.0201 > 5/15·0.05).
    assert sorted(np.array(BH_1995)[list(result.reject)]) == [0.0001, 0.0004, 0.0019, 0.0095]
    # By hand: adj_(i) = min_{j>=i} 15·p_(j)/j; the first five in sorted order.
    by_hand = {0.0001: 0.0015, 0.0004: 0.003, 0.0019: 0.0095, 0.0095: 0.035625, 0.0201: 0.0603}
    for p, adjusted in zip(BH_1995, result.adjusted, strict=True):
        if p in by_hand:
            assert adjusted == pytest.approx(by_hand[p], rel=1e-12)
    assert result.adjusted[-1] == 1.0


def test_holm_paper_example() -> None:
    result = holm(BH_1995, alpha=0.05)
    # Holm rejects three: 0.0019 <= 0.05/13, but 0.0095 > 0.05/12.
    assert sorted(np.array(BH_1995)[list(result.reject)]) == [0.0001, 0.0004, 0.0019]
    # By hand: adj_(i) = max_{j<=i} (16 − j)·p_(j): 15·0.0001, 14·0.0004, 13·0.0019, 12·0.0095, 11·0.0201.
    by_hand = {0.0001: 0.0015, 0.0004: 0.0056, 0.0019: 0.0247, 0.0095: 0.114, 0.0201: 0.2211}
    for p, adjusted in zip(BH_1995, result.adjusted, strict=True):
        if p in by_hand:
            assert adjusted == pytest.approx(by_hand[p], rel=1e-12)


def test_monotone_in_p_and_capped_at_one() -> None:
    rng = np.random.default_rng(2)
    p = rng.uniform(size=40) ** 3
    for correct in (holm, benjamini_hochberg):
        adjusted = np.array(correct(p).adjusted)
        order = np.argsort(p)
        assert np.all(np.diff(adjusted[order]) >= 0)
        assert np.all(adjusted >= p) and np.all(adjusted <= 1.0)


@pytest.mark.parametrize(("ours", "theirs"), [(holm, "holm"), (benjamini_hochberg, "fdr_bh")])
def test_matches_statsmodels(ours, theirs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # statsmodels' Holm runs a full gc.collect() per call, ~0.1 s each with torch loaded.
    monkeypatch.setattr(gc, "collect", lambda generation=2: 0)
    multitest = pytest.importorskip(
        "statsmodels.stats.multitest",
        reason="statsmodels is the reference for adjusted p-values (dev dependency)",
    )
    rng = np.random.default_rng(1979)
    for _ in range(200):
        m = int(rng.integers(1, 60))
        p = rng.uniform(size=m) ** rng.uniform(0.5, 6.0)
        if rng.uniform() < 0.3:
            p[rng.integers(0, m, size=m // 2)] = p[0]  # ties
        alpha = float(rng.choice([0.01, 0.05, 0.1]))
        mine = ours(p, alpha=alpha)
        reject, adjusted, _, _ = multitest.multipletests(p, alpha=alpha, method=theirs)
        np.testing.assert_allclose(mine.adjusted, adjusted, rtol=1e-12, atol=1e-15)
        assert list(mine.reject) == list(reject)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([], "at least 1 values, got 0"),
        ([0.2, 1.2], "index 1 is 1.2"),
        ([0.1, float("nan")], "index 1 is nan"),
    ],
)
def test_bad_pvalues_are_named(values: list, message: str) -> None:
    for correct in (holm, benjamini_hochberg):
        with pytest.raises(InvalidArgumentError, match=message):
            correct(values)
