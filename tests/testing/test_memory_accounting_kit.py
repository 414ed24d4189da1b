"""device.memory_accounting on devices that are not simulated: used_bytes must fall back when the
buffer is freed, may grow by no more than the buffer plus allocator slack, and every reading stays
consistent; free_bytes that a caching allocator holds still (as CUDA's device-wide figure does) is
said not to be compared, and passes."""

from __future__ import annotations

import random

from torchhal.hal_core import MemoryInfo
from torchhal.hal_core.adapters.cpu import CPUAdapter
from torchhal.testing import CheckStatus, format_report, run_conformance
from torchhal.testing.checks_device import ACCOUNTING_BUFFER_BYTES


class HighWaterMark(CPUAdapter):
    """used_bytes never falls (a peak, or an allocator's reserve): freed memory is never credited."""

    peak = 0

    def memory_info(self, index: int) -> MemoryInfo:
        info = super().memory_info(index)
        self.peak = max(self.peak, info.used_bytes)
        return info.model_copy(update={"used_bytes": self.peak})


class DoubleCount(CPUAdapter):
    """used_bytes grows by twice what is allocated (each allocation counted twice)."""

    base: int | None = None

    def memory_info(self, index: int) -> MemoryInfo:
        info = super().memory_info(index)
        if self.base is None:
            self.base = info.used_bytes
        return info.model_copy(update={"used_bytes": max(0, 2 * info.used_bytes - self.base)})


class FrozenFreeAtFirstReading(CPUAdapter):
    """free_bytes read once and never again: total minus what was in use then."""

    free: int | None = None

    def memory_info(self, index: int) -> MemoryInfo:
        info = super().memory_info(index)
        if self.free is None:
            self.free = info.total_bytes - info.used_bytes
        return info.model_copy(update={"free_bytes": self.free})


class CachedFree(CPUAdapter):
    """free_bytes that does not move, as torch.cuda.mem_get_info with a warm caching allocator
    (the buffer comes from, and goes back to, the allocator's reserve), within what is not used."""

    free: int | None = None

    def memory_info(self, index: int) -> MemoryInfo:
        info = super().memory_info(index)
        if self.free is None:
            self.free = (info.total_bytes - info.used_bytes) // 2
        return info.model_copy(update={"free_bytes": self.free})


def _buffer_bytes() -> int:
    """The kit's buffer on this host: 64 MiB, or 1% of the memory if less, in whole fp32 elements."""
    return min(ACCOUNTING_BUFFER_BYTES, CPUAdapter().memory_info(0).total_bytes // 100) // 4 * 4


def _accounting(adapter: CPUAdapter) -> tuple[CheckStatus, str, str]:
    report = run_conformance(adapter, seed=random.randrange(2**63))
    failed = {c.check for c in report.checks if c.status is CheckStatus.FAILED}
    result = report.result("device.memory_accounting")
    assert failed <= {"device.memory_accounting"}, format_report(report)
    return result.status, result.reason, format_report(report)


def test_used_bytes_that_never_falls_after_a_free_fails() -> None:
    """After the buffer was freed, used_bytes was never read again."""
    status, reason, report = _accounting(HighWaterMark())
    assert status is CheckStatus.FAILED, report
    assert f"after the {_buffer_bytes()}-byte buffer was freed; must fall by at least 90%" in reason
    assert reason.startswith("cpu: used_bytes fell by 0 bytes"), reason


def test_an_allocation_counted_twice_fails() -> None:
    """The bound was twice the buffer plus 64 MiB, which an exact double count met."""
    status, reason, report = _accounting(DoubleCount())
    assert status is CheckStatus.FAILED, report
    assert "must grow by at least 90% of it and at most" in reason, reason
    assert "it plus 1/8 of it or 4 MiB, whichever is more" in reason


def test_free_bytes_frozen_past_what_is_in_use_fails_on_the_reading_after_allocation() -> None:
    """free + used <= total was checked on an idle reading only."""
    status, reason, report = _accounting(FrozenFreeAtFirstReading())
    assert status is CheckStatus.FAILED, report
    assert f"after allocating {_buffer_bytes()} bytes: free_bytes" in reason, reason
    assert "> total_bytes" in reason


def test_free_bytes_a_caching_allocator_holds_still_passes_and_is_said_not_compared() -> None:
    """A correct CUDA adapter's free memory need not move with one allocation: not failed."""
    status, reason, report = _accounting(CachedFree())
    assert status is CheckStatus.PASSED, report
    assert "when it was freed; free_bytes not compared (not simulated" in reason, reason
