"""split_batch: per-rank batch sizes proportional to throughput, largest-remainder rounding; and the
re-split by measured step times that balances them."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torchhal_simasic.adapter import SimASICAdapter
from torchhal_simasic.spec import bundled_spec

from torchhal import HardwareAbstractionLayer
from torchhal.distributed import measured_throughput, modelled_step_times, rebalanced_split, split_batch
from torchhal.hal_core import InvalidArgumentError
from torchhal.hal_core.settings import Settings

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
        (1, [1.0, 2.0], r"global_batch must be an integer \(not bool\) >= the number of ranks \(2\), got 1"),
        (2.5, [1.0], "got 2.5"),
    ],
)
def test_bad_arguments_are_refused_with_the_value_seen(batch, throughputs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        split_batch(batch, throughputs)


def test_modelled_step_times_need_one_rate_per_batch():
    with pytest.raises(InvalidArgumentError, match="2 batch sizes for 1 throughputs"):
        modelled_step_times([1, 2], [1.0], 1.0)


def _simulated_step_ms(hal, device, batch: int, weight: torch.Tensor) -> float:
    """A step's worth of work on a simulated ASIC: three (batch x 128) @ (128 x 128) products,
    timed by the device's own (simulated) timer."""
    x = device.empty((batch, 128), torch.float32).normal_()
    timer = device.timer()
    start = timer.mark()
    for _ in range(3):
        hal.kernels.call("matmul", device, x, weight)
    return timer.elapsed_ms(start, timer.mark())


def test_rebalancing_by_measured_step_times_balances_two_simulated_asics():
    """An edge and a datacenter ASIC split 4096 samples by their matmul rate at 128^3. That rate
    does not predict the step's shapes (the measured split leaves the edge ~3x slower), so the
    split is redone from the step times measured on each device: after two re-splits the slower
    device takes at most 1.2x the faster's time, where an even split would leave it near 10x."""
    devices = []
    for spec in ("edge", "datacenter"):
        settings = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})
        hal = HardwareAbstractionLayer(adapters=[SimASICAdapter(bundled_spec(spec))], settings=settings)
        devices.append((hal, hal.device("simasic:0")))
    weights = [d.empty((128, 128), torch.float32).normal_() for _, d in devices]

    def imbalance(sizes):
        times = [_simulated_step_ms(h, d, b, w) for (h, d), b, w in zip(devices, sizes, weights, strict=True)]
        return times, max(times) / min(times)

    rates = [measured_throughput(h, d, torch.float32, (128, 128, 128)) for h, d in devices]
    sizes = split_batch(4096, rates)
    times, first = imbalance(sizes)
    assert first > 2, (sizes, times)  # the matmul rate alone does not balance this workload
    for _ in range(2):
        sizes = rebalanced_split(4096, sizes, [t / 1e3 for t in times])
        times, ratio = imbalance(sizes)
    assert sum(sizes) == 4096 and sizes[0] < sizes[1]
    assert ratio <= 1.2, (sizes, times)
    _, even = imbalance((2048, 2048))
    assert even > 5


def test_rebalanced_split_refuses_bad_step_times():
    with pytest.raises(
        InvalidArgumentError, match=r"step_times_s must be finite and > 0, got \[\(1, 0.0\)\]"
    ):
        rebalanced_split(8, (4, 4), (0.5, 0.0))
    with pytest.raises(InvalidArgumentError, match="2 batch sizes for 3 step times"):
        rebalanced_split(8, (4, 4), (0.5, 0.5, 0.5))
    assert rebalanced_split(12, (6, 6), (0.3, 0.1)) == (3, 9)  # 20 and 60 samples/s
