"""split_batch: per-rank batch sizes proportional to throughput, largest-remainder rounding."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchhal.distributed import modelled_step_times, split_batch
from torchhal.hal_core import InvalidArgumentError

rates = st.lists(st.floats(min_value=1e-3, max_value=1e3, allow_nan=False), min_size=1, max_size=8)


def test_proportional_split_with_largest_remainders():
    assert split_batch(10, [1.0, 1.0, 2.0]) == (3, 2, 5)  # quotas 2.5, 2.5, 5: the tie goes to rank 0
    assert split_batch(7, [3.0, 1.0]) == (5, 2)  # quotas 5.25, 1.75
    assert split_batch(100, [0.05, 12.0, 0.05, 6.0]) == (
        1,
        66,
        1,
        32,
    )  # minimums of 1 take a sample from the largest surplus


def test_every_rank_gets_at_least_one_sample_even_when_its_quota_is_tiny():
    assert split_batch(4, [1e-6, 1.0, 1.0, 1.0]) == (1, 1, 1, 1)
    assert split_batch(5, [1e-6, 100.0, 1.0]) == (1, 3, 1)


@given(rates, st.integers(min_value=0, max_value=5000))
def test_sizes_sum_to_the_batch_and_stay_within_one_sample_of_the_quota(throughputs, extra):
    batch = len(throughputs) + extra
    sizes = split_batch(batch, throughputs)
    assert sum(sizes) == batch and min(sizes) >= 1
    quotas = [batch * t / math.fsum(throughputs) for t in throughputs]
    if all(q >= 1 for q in quotas):
        assert all(abs(b - q) < 1 for b, q in zip(sizes, quotas, strict=True)), (sizes, quotas)


@given(rates, st.integers(min_value=0, max_value=5000))
def test_a_faster_rank_never_gets_fewer_samples(throughputs, extra):
    sizes = split_batch(len(throughputs) + extra, throughputs)
    for i, j in ((i, j) for i in range(len(sizes)) for j in range(len(sizes))):
        if throughputs[i] > throughputs[j]:
            assert sizes[i] >= sizes[j], (throughputs, sizes)


def test_modelled_step_times_balance_after_the_split():
    throughputs = [0.8, 0.05, 12.5]  # TFLOP/s
    sizes = split_batch(1000, throughputs)
    times = modelled_step_times(sizes, throughputs, flop_per_sample=1e9)
    assert max(times) / min(times) < 1.1
    even = modelled_step_times([333, 333, 334], throughputs, flop_per_sample=1e9)
    assert max(even) / min(even) > 100


@pytest.mark.parametrize(
    ("batch", "throughputs", "message"),
    [
        (4, [], "at least one rank"),
        (4, [1.0, 0.0], r"finite and > 0, got \[\(1, 0.0\)\]"),
        (4, [1.0, float("nan")], "finite and > 0"),
        (1, [1.0, 2.0], r"global_batch must be an integer >= the number of ranks \(2\), got 1"),
        (2.5, [1.0], "got 2.5"),
    ],
)
def test_bad_arguments_are_refused_with_the_value_seen(batch, throughputs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        split_batch(batch, throughputs)


def test_modelled_step_times_need_one_rate_per_batch():
    with pytest.raises(InvalidArgumentError, match="2 batch sizes for 1 throughputs"):
        modelled_step_times([1, 2], [1.0], 1.0)
