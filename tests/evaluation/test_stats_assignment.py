"""Deterministic assignment and the sample-ratio-mismatch check."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import scipy.stats as st

from torchhal.evaluation.stats import assign, sample_ratio_mismatch
from torchhal.evaluation.stats.assignment import unit_uniform
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
    ],
)
def test_bad_input_is_named(call, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        call()
