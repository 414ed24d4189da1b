"""The memory ledger and the simulated clock, through the adapter and the HAL's Device."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torchhal_simasic.state import MemoryLedger, SimulatedClock

from torchhal.hal_core import DeviceOutOfMemoryError, InvalidArgumentError, UnsupportedError


def test_allocation_is_charged_and_freed_with_its_storage(sim_hal):
    dev = sim_hal().device("simasic:0")
    t = dev.empty((7, 9), torch.float32)
    assert (t.shape, t.dtype, t.device.type) == ((7, 9), torch.float32, "cpu")
    assert dev.memory_info().used_bytes == 7 * 9 * 4
    view = t[2:]
    del t
    gc.collect()
    assert dev.memory_info().used_bytes == 252, "a view keeps the storage, and the charge, alive"
    del view
    gc.collect()
    info = dev.memory_info()
    assert (info.used_bytes, info.free_bytes, info.total_bytes, info.simulated) == (0, 1 << 20, 1 << 20, True)


def test_out_of_memory_names_sizes_and_leaves_the_ledger_unchanged(sim_hal, tiny):
    dev = sim_hal(tiny(memory_bytes=4096)).device("simasic:0")
    held = dev.empty((750,), torch.float32)  # 3000 bytes
    with pytest.raises(DeviceOutOfMemoryError) as err:
        dev.empty((500,), torch.float32)  # 2000 more
    message = str(err.value)
    assert "simasic:0" in message
    assert "requested 2000 bytes with 3000 of 4096 bytes in use (1096 free)" in message
    assert (err.value.requested, err.value.used, err.value.capacity) == (2000, 3000, 4096)
    ledger = dev.adapter.state(0).ledger
    assert (ledger.used, ledger.peak) == (3000, 3000)
    assert held.numel() == 750


def test_peak_is_the_high_water_mark(sim_hal):
    dev = sim_hal().device("simasic:0")
    ledger = dev.adapter.state(0).ledger
    a = dev.empty((100,), torch.float32)
    b = dev.empty((50,), torch.bfloat16)
    del a
    gc.collect()
    assert (ledger.used, ledger.peak) == (100, 500)
    ledger.reset_peak()
    assert ledger.peak == 100
    del b


def test_allocation_refuses_dtypes_and_sizes_outside_the_spec(sim_hal):
    dev = sim_hal().device("simasic:0")
    with pytest.raises(UnsupportedError, match=r"dtype torch.float64 is not supported"):
        dev.empty((4,), torch.float64)
    with pytest.raises(UnsupportedError, match=r"allocation on simasic:0: dtype torch.float16 is not in"):
        dev.adapter.allocate(0, torch.device("cpu"), (4,), torch.float16)
    with pytest.raises(InvalidArgumentError, match=r"sizes must be integers >= 0, got \(4, -1\)"):
        dev.adapter.allocate(0, torch.device("cpu"), (4, -1), torch.float32)
    assert dev.memory_info().used_bytes == 0


def test_ledger_is_consistent_under_threads():
    ledger = MemoryLedger("simasic:0", 1 << 30)
    barrier = threading.Barrier(4)

    def work(size: int) -> None:
        barrier.wait()
        for _ in range(2000):
            ledger.charge(size)
            ledger.release(size)
        ledger.charge(size)

    threads = [threading.Thread(target=work, args=(size,)) for size in (1, 10, 100, 1000)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert ledger.used == 1111
    assert 1111 <= ledger.peak <= 1111 + 1000 + 100 + 10 + 1


def test_clock_is_monotonic():
    clock = SimulatedClock()
    assert clock.advance(2.5e-6) == 2.5e-6
    with pytest.raises(InvalidArgumentError, match="finite time >= 0 s, got -1e-09"):
        clock.advance(-1e-9)
    with pytest.raises(InvalidArgumentError, match="got nan"):
        clock.advance(float("nan"))
    assert clock.now() == 2.5e-6


def test_timer_reads_simulated_time(sim_hal):
    dev = sim_hal().device("simasic:0")
    timer = dev.timer()
    start = timer.mark()
    dev.adapter.state(0).clock.advance(0.125)
    end = timer.mark()
    assert timer.elapsed_ms(start, end) == 125.0
    assert timer.elapsed_ms(start, start) == 0.0
    with pytest.raises(InvalidArgumentError, match="marks must come from mark"):
        timer.elapsed_ms(0, 1)


def test_copy_charges_twice_the_bytes_over_bandwidth_plus_launch(sim_hal):
    """A copy within device memory (both tensors on the ledger); an upload crosses the host link
    (tests/simasic/test_cost_edges.py)."""
    dev = sim_hal().device("simasic:0")
    src = dev.empty((250,), torch.float32).normal_()
    dst = dev.empty((250,), torch.float32)
    clock = dev.adapter.state(0).clock
    dev.copy_(dst, src)
    assert torch.equal(dst, src)
    assert clock.now() == pytest.approx(2 * 1000 / 1e11 + 1e-6, rel=1e-12)  # bytes/B + one launch
    with pytest.raises(InvalidArgumentError, match="same dtype and shape"):
        dev.copy_(dst, src.to(torch.bfloat16))
