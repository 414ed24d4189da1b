"""The simulated ASIC's spec and timer refuse what has no meaning."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from torchhal.hal_core import ConfigurationError, InvalidArgumentError, UnsupportedError


def test_sram_larger_than_memory_is_refused_naming_both_fields(tiny):
    """An on-chip buffer larger than the memory it caches was accepted: the cost model then held
    whole operands in SRAM that the device could never have stored."""
    memory = 1 << 20
    sram = memory + random.randint(1, memory)
    with pytest.raises(ConfigurationError) as err:
        tiny(sram_bytes=sram, memory_bytes=memory)
    assert f"sram_bytes: on-chip SRAM must not exceed memory_bytes ({memory}), got {sram}" in str(err.value)
    assert tiny(sram_bytes=memory, memory_bytes=memory).sram_bytes == memory  # an SRAM-only chip


def test_marks_of_another_device_are_refused(sim_hal, tiny):
    """elapsed_ms(mark of simasic:0, mark of simasic:1) subtracted two unrelated clocks and
    returned a number that meant nothing."""
    hal = sim_hal(tiny(devices=2))
    dev0, dev1 = hal.device("simasic:0"), hal.device("simasic:1")
    t0, t1 = dev0.timer(), dev1.timer()
    start0 = t0.mark()
    dev1.adapter.state(1).clock.advance(random.uniform(1e-3, 1.0))
    end1 = t1.mark()
    with pytest.raises(
        InvalidArgumentError, match="timer of simasic:0: end is a mark of simasic:1, not of simasic:0"
    ):
        t0.elapsed_ms(start0, end1)
    with pytest.raises(
        InvalidArgumentError, match="timer of simasic:1: start is a mark of simasic:0, not of simasic:1"
    ):
        t1.elapsed_ms(start0, end1)
    # one device's marks, read through another timer of the same device, still work
    seconds = random.uniform(1e-3, 1.0)
    start1 = t1.mark()
    dev1.adapter.state(1).clock.advance(seconds)
    assert dev1.timer().elapsed_ms(start1, t1.mark()) == pytest.approx(seconds * 1e3, rel=1e-9)


def test_marks_of_another_hals_device_of_the_same_id_are_refused(sim_hal):
    """Two HALs each have a simasic:0 with its own clock: their marks share an id, not a clock."""
    first, second = sim_hal().device("simasic:0"), sim_hal().device("simasic:0")
    start = first.timer().mark()
    second.adapter.state(0).clock.advance(0.5)
    with pytest.raises(InvalidArgumentError, match="end is a mark of another simasic:0's clock"):
        first.timer().elapsed_ms(start, second.timer().mark())


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_integer_and_bool_tensors_are_stored_and_charged(sim_hal, dtype):
    """Labels, indices and masks could not be put on the device (the spec's dtypes are the formats
    it computes in), so a training batch's targets stayed host tensors off the ledger."""
    dev = sim_hal().device("simasic:0")
    ledger = dev.adapter.state(0).ledger
    n = random.randint(1, 1000)
    host = torch.randint(0, 2 if dtype is torch.bool else 100, (n,)).to(dtype)
    stored = dev.to_device(host)
    assert stored.dtype == dtype and torch.equal(stored, host)
    assert ledger.used == n * dtype.itemsize
    del stored
    gc.collect()
    assert ledger.used == 0


def test_float_and_complex_formats_outside_the_spec_are_still_refused(sim_hal):
    dev = sim_hal().device("simasic:0")
    with pytest.raises(UnsupportedError, match=r"dtype torch.float64 is not supported"):
        dev.to_device(torch.randn(4, dtype=torch.float64))
    with pytest.raises(
        UnsupportedError,
        match=r"allocation on simasic:0: dtype torch.complex64 is not in the spec's dtypes "
        r"\['bf16', 'fp32'\], nor integer or bool storage",
    ):
        dev.empty((4,), torch.complex64)
    assert dev.memory_info().used_bytes == 0
