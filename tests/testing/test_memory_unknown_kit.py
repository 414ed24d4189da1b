"""The conformance kit with memory figures an adapter reports as unknown: compared only where
known, named in the detail, and the accounting check not applicable (never a pass) without used."""

from __future__ import annotations

import random

from tests.testing.adapters import TwinHostAdapter
from torchhal.hal_core import MemoryInfo
from torchhal.hal_core.adapters.cpu import CPUAdapter
from torchhal.testing import CheckStatus, run_conformance


def _unknown(info: MemoryInfo, figures: set[str]) -> MemoryInfo:
    """`info` as a runtime that does not give `figures` reports it."""
    known = {f: getattr(info, f"{f}_bytes") for f in ("total", "free", "used") if f not in figures}
    return MemoryInfo(
        **{f"{f}_bytes": v for f, v in known.items()}, **{f"{f}_bytes": 0 for f in figures}, unknown=figures
    )


class MacLike(CPUAdapter):
    """The host as on macOS: no free memory and no resident set."""

    def memory_info(self, index: int) -> MemoryInfo:
        return _unknown(super().memory_info(index), {"free", "used"})


class WindowsLike(CPUAdapter):
    def memory_info(self, index: int) -> MemoryInfo:
        return _unknown(super().memory_info(index), {"total", "free", "used"})


class OverfullUnknownUsed(CPUAdapter):
    """used unknown, and the free memory it does give exceeds the capacity."""

    excess = random.randint(1, 2**30)

    def memory_info(self, index: int) -> MemoryInfo:
        info = super().memory_info(index)
        return _unknown(info.model_copy(update={"free_bytes": info.total_bytes + self.excess}), {"used"})


class OneTwinUnknown(TwinHostAdapter):
    """Two devices; twin:1 does not give used."""

    def memory_info(self, index: int) -> MemoryInfo:
        info = super().memory_info(index)
        return _unknown(info, {"used"}) if index == 1 else info


def test_unknown_figures_are_not_compared_and_accounting_is_not_applicable():
    """With 0 for unknown, the Windows host failed "total_bytes must be > 0" and the macOS host
    failed the accounting (used never grows), as if the adapter misreported."""
    for adapter, shown, unknown in (
        (MacLike(), "free unknown, used unknown", "free, used"),
        (WindowsLike(), "total unknown, free unknown, used unknown", "free, total, used"),
    ):
        report = run_conformance(adapter)
        info = report.result("device.memory_info")
        assert info.status is CheckStatus.PASSED, info.reason
        assert shown in info.reason and f"(not compared: {unknown} unknown)" in info.reason
        accounting = report.result("device.memory_accounting")
        assert accounting.status is CheckStatus.NOT_APPLICABLE, accounting.reason
        assert accounting.reason == (
            "memory_info() says used_bytes is unknown on cpu: its growth on an allocation cannot be checked"
        )


def test_known_figures_are_still_compared():
    adapter = OverfullUnknownUsed()
    report = run_conformance(adapter)
    info = report.result("device.memory_info")
    assert info.status is CheckStatus.FAILED
    total = CPUAdapter().memory_info(0).total_bytes
    assert f"free_bytes {total + adapter.excess} > total_bytes {total}" in info.reason


def test_a_device_without_used_is_named_beside_the_ones_checked():
    report = run_conformance(OneTwinUnknown())
    accounting = report.result("device.memory_accounting")
    assert accounting.status is CheckStatus.PASSED, accounting.reason
    assert "twin:0: used_bytes grew by" in accounting.reason
    assert "twin:1: not checked: memory_info() says used_bytes is unknown" in accounting.reason


class WindowsHost(WindowsLike):
    """The host as on Windows, capacity included: its capabilities declare 0 bytes."""

    def discover(self):
        return [c.model_copy(update={"memory_bytes": 0}) for c in super().discover()]


class ZeroCapacity(CPUAdapter):
    """Declares 0 bytes while its memory_info() gives a total: a misreport."""

    def discover(self):
        return [c.model_copy(update={"memory_bytes": 0}) for c in super().discover()]


def test_a_capacity_of_0_passes_discovery_only_where_memory_info_says_total_is_unknown():
    """The Windows host failed the kit's discovery check ("memory_bytes must be > 0")."""
    host = run_conformance(WindowsHost()).result("adapter.discover")
    assert host.status is CheckStatus.PASSED, host.reason
    assert "memory not stated" in host.reason
    zero = run_conformance(ZeroCapacity()).result("adapter.discover")
    assert zero.status is CheckStatus.FAILED
    assert "memory_bytes is 0, which only a device whose memory_info() names 'total'" in zero.reason
