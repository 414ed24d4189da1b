"""Group-sequential boundaries to published precision, and α spent to the last digits.

A fixed 601-point grid over ±9 sd with the trapezoid rule put the five-look boundaries ~5e-4
wide of the published ones and spent 0.0497 of α = 0.05. The reference here is independent of
the implementation: the Armitage–McPherson–Rowe recursion with Simpson's rule on 1201 points
spanning each continuation region, and scipy's normal distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from torchhal.evaluation.stats import group_boundaries
from torchhal.evaluation.stats.group_sequential import spent_alpha

FIVE = [0.2, 0.4, 0.6, 0.8, 1.0]


def _crossing_probabilities(fractions: list[float], bounds: list[float], points: int = 1201) -> np.ndarray:
    """P(first crossing at look k) for two-sided z boundaries `bounds`, by the recursion on the
    score B(t), the sub-density of each look on its continuation region integrated by Simpson."""
    weights = np.full(points, 2.0)
    weights[1::2], weights[0], weights[-1] = 4.0, 1.0, 1.0
    out, x, density, last = [], None, None, 0.0
    for t, b in zip(fractions, bounds, strict=True):
        edge = min(b, 9.0) * math.sqrt(t)
        y = np.linspace(-edge, edge, points)
        if x is None:
            out.append(2.0 * stats.norm.sf(b))
            density = stats.norm.pdf(y, scale=math.sqrt(t))
        else:
            sd = math.sqrt(t - last)
            mass = weights * (x[1] - x[0]) / 3.0 * density
            beyond = stats.norm.sf((edge - x) / sd) + stats.norm.cdf((-edge - x) / sd)
            out.append(float(mass @ beyond) if math.isfinite(b) else 0.0)
            density = stats.norm.pdf((y[:, None] - x[None, :]) / sd) / sd @ mass
        x, last = y, t
    return np.array(out)


@pytest.mark.parametrize(
    ("spending", "published"),
    [
        # the review's reference (a 4001-point Simpson recursion, 4.87688 3.35701 2.68028 2.28982
        # 2.03103 and 2.43798 2.42681 2.41019 2.39665 2.38598, checked against gsDesign's sfLDOF and
        # sfLDPocock) to four decimals; the gsDesign tables it quotes differ by one in the last
        # digit at 3.3569, 2.4101, 2.3966, 2.3859. The old grid gave 3.3574 and 2.4273.
        ("obrien-fleming", [4.8769, 3.3570, 2.6803, 2.2898, 2.0310]),
        ("pocock", [2.4380, 2.4268, 2.4102, 2.3967, 2.3860]),
    ],
)
def test_five_equal_looks_match_the_published_boundaries(spending: str, published: list[float]) -> None:
    got = group_boundaries(FIVE, spending=spending)
    assert got == pytest.approx(published, abs=6e-5)  # four decimals: 5e-5 is rounding
    cumulative = np.cumsum(_crossing_probabilities(FIVE, got))
    planned = [spent_alpha(f, 0.05, spending) for f in FIVE]
    assert cumulative == pytest.approx(planned, abs=1e-7)


@pytest.mark.parametrize("spending", ["obrien-fleming", "pocock"])
def test_random_designs_spend_exactly_alpha(spending: str) -> None:
    """Fresh looks and α each run: at every look the independent recursion's probability of
    having crossed equals the spending function there, and the total equals α."""
    rng = np.random.default_rng()
    for _ in range(3):
        alpha = float(rng.uniform(0.01, 0.2))
        looks = int(rng.integers(2, 9))
        gaps = rng.uniform(0.02, 1.0, looks)  # >= 0.25 % of the information apart
        fractions = [float(f) for f in np.cumsum(gaps) / gaps.sum()]
        fractions[-1] = 1.0
        bounds = group_boundaries(fractions, alpha=alpha, spending=spending)
        crossed = _crossing_probabilities(fractions, bounds)
        planned = np.array([spent_alpha(f, alpha, spending) for f in fractions])
        assert np.abs(np.cumsum(crossed) - planned).max() <= 1e-6, (fractions, alpha, bounds)
        assert abs(crossed.sum() - alpha) <= 1e-5


def test_early_looks_that_spend_nothing_cannot_reject_and_pass_their_alpha_on() -> None:
    """O'Brien-Fleming at 1 % and 2 % of the information spends ~1e-40: nothing a float can hold
    beside 1, so those looks get infinite boundaries and the later ones spend α in full."""
    fractions = [0.01, 0.02, 0.5, 1.0]
    bounds = group_boundaries(fractions)
    assert bounds[:2] == [math.inf, math.inf] and all(math.isfinite(b) for b in bounds[2:])
    crossed = _crossing_probabilities(fractions, bounds)
    assert np.cumsum(crossed)[2:] == pytest.approx(
        [spent_alpha(f, 0.05, "obrien-fleming") for f in fractions[2:]], abs=1e-7
    )
