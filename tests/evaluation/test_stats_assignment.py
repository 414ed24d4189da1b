"""Deterministic assignment and the sample-ratio-mismatch checks (one look, and anytime-valid)."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import scipy.stats as st

from torchhal.evaluation.stats import assign, sample_ratio_mismatch, sequential_sample_ratio_mismatch
from torchhal.evaluation.stats.assignment import SRM_CONCENTRATION, unit_uniform
from torchhal.hal_core.errors import InvalidArgumentError


def test_assignment_is_stable_across_processes() -> None:
    """Python's hash() is salted per process; a fresh interpreter must still agree."""
    units = [f"user-{i}" for i in range(20)]
    here = [assign(u, ["control", "treatment"], salt="exp-42") for u in units]
    code = (
        "from torchhal.evaluation.stats import assign\n"
        f"print(','.join(assign(u, ['control', 'treatment'], salt='exp-42') for u in {units!r}))"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert there.stdout.strip().split(",") == here


def test_hashing_is_pinned() -> None:
    """Golden values: a change to the hashing would silently reshuffle every running experiment."""
    assert unit_uniform("unit-7", "salt") == 0.21567268214577717
    assert unit_uniform("", "") == 0.7891985391709461
    assert [assign(f"user-{i}", ["control", "treatment"], salt="exp-42") for i in range(8)] == [
        "treatment",
        "treatment",
        "control",
        "treatment",
        "treatment",
        "control",
        "treatment",
        "control",
    ]
    assert unit_uniform("unit-7", "salt") != unit_uniform("unit-7", "salt2")
    # The length prefix keeps ("ab", "c") and ("a", "bc") apart.
    assert unit_uniform("c", "ab") != unit_uniform("bc", "a")


def test_split_follows_the_weights() -> None:
    variants = ["a", "b", "c"]
    weights = [0.5, 0.3, 0.2]
    counts = {v: 0 for v in variants}
    for i in range(12_000):
        counts[assign(f"id{i}", variants, weights, salt="split")] += 1
    observed = [counts[v] for v in variants]
    result = sample_ratio_mismatch(observed, weights)
    assert result.p_value > 0.001, f"split {observed} mismatches weights {weights}: p = {result.p_value}"
    assert st.chisquare(observed, np.array(weights) * 12_000).pvalue == pytest.approx(
        result.p_value, rel=1e-9
    )


def test_salts_randomise_independently() -> None:
    first = np.array([assign(f"u{i}", [0, 1], salt="one") for i in range(8000)])
    second = np.array([assign(f"u{i}", [0, 1], salt="two") for i in range(8000)])
    table = np.array([[np.sum((first == x) & (second == y)) for y in (0, 1)] for x in (0, 1)])
    assert st.chi2_contingency(table).pvalue > 0.001  # no association between experiments


def test_zero_weight_variant_gets_nobody() -> None:
    assert {assign(f"u{i}", ["off", "on"], [0.0, 1.0], salt="s") for i in range(2000)} == {"on"}


def test_sample_ratio_mismatch_matches_scipy() -> None:
    rng = np.random.default_rng(1900)
    for _ in range(200):
        k = int(rng.integers(2, 8))
        ratios = rng.uniform(0.1, 1.0, k)
        counts = rng.multinomial(int(rng.integers(10, 100_000)), ratios / ratios.sum())
        mine = sample_ratio_mismatch(counts, ratios)
        ref = st.chisquare(counts, counts.sum() * ratios / ratios.sum())
        assert mine.statistic == pytest.approx(ref.statistic, rel=1e-9, abs=1e-12)
        assert mine.p_value == pytest.approx(ref.pvalue, rel=1e-9, abs=1e-12)
        assert mine.df == k - 1 and mine.total == counts.sum()


def test_sample_ratio_mismatch_flags_a_broken_split() -> None:
    assert sample_ratio_mismatch([50_600, 49_400], [1, 1]).p_value < 0.001  # 1.2 % off at n = 100 000


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: assign("u", []), "at least one variant"),
        (lambda: assign("u", ["a", "a"]), "distinct"),
        (lambda: assign("u", ["a", "b"], [1.0]), "one number per variant"),
        (lambda: assign("u", ["a", "b"], [1.0, -1.0]), "index 1 is -1.0"),
        (lambda: assign("u", ["a", "b"], [0.0, 0.0]), "sum to 0.0"),
        (lambda: assign(7, ["a", "b"]), "unit_id and salt must be str, got int"),
        (lambda: sample_ratio_mismatch([10, 5.5], [1, 1]), "index 1 is 5.5"),
        (lambda: sample_ratio_mismatch([10, -1], [1, 1]), "index 1 is -1"),
        (lambda: sample_ratio_mismatch([10, 5], [1, 0]), "ratios must be > 0; index 1 is 0"),
        (lambda: sample_ratio_mismatch([10, 5, 1], [1, 1]), "got 3 and 2"),
        (lambda: sample_ratio_mismatch([0, 0], [1, 1]), "all counts are 0"),
        (lambda: sequential_sample_ratio_mismatch([10, -1], [1, 1]), "index 1 is -1"),
        (lambda: sequential_sample_ratio_mismatch([10, 5], [1, 0]), "ratios must be > 0; index 1 is 0"),
        (
            lambda: sequential_sample_ratio_mismatch([10, 5], [1, 1], concentration=0.0),
            "concentration must be > 0, got 0.0",
        ),
        (
            lambda: sequential_sample_ratio_mismatch([10, 5], [1, 1], concentration=math.inf),
            "concentration must be finite, got inf",
        ),
    ],
)
def test_bad_input_is_named(call, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        call()


# --- the anytime-valid check ---------------------------------------------------------------


def polya_log_bayes_factor(arms: list[int], ratios: list[float], concentration: float) -> float:
    """The Dirichlet-multinomial Bayes factor built unit by unit, as Pólya's urn predicts each
    next unit: P(arm i | counts so far) = (c·p_i + n_i) / (c + n), against p_i under the design."""
    p = np.asarray(ratios, dtype=float) / sum(ratios)
    counts = np.zeros(len(ratios))
    total = 0.0
    for n, arm in enumerate(arms):
        total += math.log((concentration * p[arm] + counts[arm]) / (concentration + n) / p[arm])
        counts[arm] += 1
    return total


def test_the_bayes_factor_is_the_product_of_the_urns_predictions() -> None:
    rng = np.random.default_rng()
    for _ in range(60):
        k = int(rng.integers(2, 6))
        ratios = rng.uniform(0.05, 1.0, k)
        truth = rng.dirichlet(np.ones(k))
        arms = rng.choice(k, size=int(rng.integers(1, 3000)), p=truth).tolist()
        c = float(rng.choice([0.5, 10.0, 100.0, 5000.0]))
        result = sequential_sample_ratio_mismatch(np.bincount(arms, minlength=k), ratios, concentration=c)
        reference = polya_log_bayes_factor(arms, ratios.tolist(), c)
        assert result.log_bayes_factor == pytest.approx(reference, rel=1e-9, abs=1e-9)
        assert result.p_value == pytest.approx(min(1.0, math.exp(-reference)), rel=1e-8, abs=0.0)
        assert result.total == len(arms) and result.concentration == c


def test_the_bayes_factor_at_large_counts_against_mpmath() -> None:
    mp = pytest.importorskip("mpmath", reason="mpmath is the 50-digit reference for log-gamma")
    mp.mp.dps = 50
    rng = np.random.default_rng()
    for _ in range(20):
        k = int(rng.integers(2, 5))
        ratios = rng.uniform(0.05, 1.0, k)
        counts = rng.multinomial(int(10 ** rng.uniform(4, 9)), rng.dirichlet(np.full(k, 50.0)))
        result = sequential_sample_ratio_mismatch(counts, ratios)
        p = [mp.mpf(float(r)) / mp.fsum(mp.mpf(float(v)) for v in ratios) for r in ratios]
        prior = [SRM_CONCENTRATION * v for v in p]

        def log_b(a: list) -> object:
            return mp.fsum(mp.loggamma(v) for v in a) - mp.loggamma(mp.fsum(a))

        reference = (
            log_b([a + int(n) for a, n in zip(prior, counts, strict=True)])
            - log_b(prior)
            - mp.fsum(int(n) * mp.log(v) for n, v in zip(counts, p, strict=True))
        )
        assert result.log_bayes_factor == pytest.approx(float(reference), rel=1e-9, abs=1e-6)


def rollback_edges(weights: tuple[float, float], alpha: float, n_max: int) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper): a look at n units flags a candidate count k <= lower[n] or >= upper[n].

    log BF is convex in k (log Γ is), so each n's flagged counts are the two tails around
    n·share, where BF <= 1; each edge is walked from where it was at n − 1.
    """
    share = weights[1] / sum(weights)

    def flags(n: int, k: int) -> bool:
        return sequential_sample_ratio_mismatch([n - k, k], weights).p_value < alpha

    lower, upper = np.full(n_max + 1, -1), np.full(n_max + 1, 1)
    lo, hi = -1, 1
    for n in range(1, n_max + 1):
        mode = round(n * share)
        assert not flags(n, mode)
        lo, hi = min(lo, mode - 1), max(hi, mode + 1)
        while lo + 1 < mode and flags(n, lo + 1):
            lo += 1
        while lo >= 0 and not flags(n, lo):
            lo -= 1
        while hi - 1 > mode and flags(n, hi - 1):
            hi -= 1
        while hi <= n and not flags(n, hi):
            hi += 1
        lower[n], upper[n] = lo, hi
    return lower, upper


def flagged_by(share: float, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """P(some look at 1..n units has flagged), exactly, for candidates arriving with P(share)."""
    alive, flagged = np.array([1.0]), np.zeros(lower.size)
    for n in range(1, lower.size):
        step = np.zeros(n + 1)
        step[:-1] += alive * (1.0 - share)
        step[1:] += alive * share
        k = np.arange(n + 1)
        hit = (k <= lower[n]) | (k >= upper[n])
        flagged[n] = flagged[n - 1] + step[hit].sum()
        step[hit] = 0.0
        alive = step
    return flagged


@pytest.mark.parametrize("weights", [(0.5, 0.5), (0.99, 0.01)])
def test_a_sound_split_checked_after_every_unit_is_flagged_at_most_alpha_of_the_time(weights) -> None:
    """Exactly, by enumerating the counts, a look after each of 2,000 units at alpha = 0.001. The
    one-look p-values the monitor used were valid per look only: 0.0071 by 100 units at 50:50,
    0.028 by 10,000; 0.0051 by 1,000 at 99:1."""
    alpha = 0.001
    lower, upper = rollback_edges(weights, alpha, 2000)
    flagged = flagged_by(weights[1] / sum(weights), lower, upper)
    assert flagged[-1] <= alpha, flagged[[100, 1000, 2000]]


def test_monte_carlo_false_rollbacks_over_2000_looks() -> None:
    """2,000 sound 50:50 streams of 2,000 units, a look after each unit, alpha = 0.05: the
    share flagged stays within Monte Carlo error of at most alpha, and matches the exact count."""
    alpha, runs, units = 0.05, 2000, 2000
    lower, upper = rollback_edges((0.5, 0.5), alpha, units)
    rng = np.random.default_rng()
    k = np.cumsum(rng.uniform(size=(runs, units)) < 0.5, axis=1)
    rate = float(((k <= lower[1:]) | (k >= upper[1:])).any(axis=1).mean())
    exact = flagged_by(0.5, lower, upper)[-1]
    se = math.sqrt(exact * (1 - exact) / runs)
    assert exact <= alpha and rate <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs)
    assert abs(rate - exact) <= 4 * se + 1e-3, (rate, exact)


@pytest.mark.parametrize(
    ("weights", "share", "units"), [((0.5, 0.5), 0.45, 4000), ((0.99, 0.01), 0.003, 5000)]
)
def test_a_broken_split_is_flagged(weights, share, units) -> None:
    """Power at alpha = 0.001, exactly: 45:55 against 50:50 within 4,000 units, and a 99:1
    canary that lost 70% of its candidate's traffic within 5,000 (both 0.99; their expected
    counts are flagged from ~1,800 and ~2,400 units). A sound split: at most 0.001."""
    lower, upper = rollback_edges(weights, 0.001, units)
    assert flagged_by(share, lower, upper)[-1] >= 0.95
    assert flagged_by(weights[1] / sum(weights), lower, upper)[-1] <= 0.001
