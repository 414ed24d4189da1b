"""The built-in CPU adapter on platforms without os.sysconf / os.getloadavg (Windows) or without
SC_AVPHYS_PAGES (macOS): discovery works and figures it cannot read are said to be unknown."""

from __future__ import annotations

import os

import pytest

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import telemetry
from torchhal.hal_core.adapters import cpu
from torchhal.hal_core.capabilities import HealthStatus


@pytest.fixture(autouse=True)
def fresh_warnings():
    cpu._unreadable.cache_clear()  # said once per process: each test starts unsaid
    yield
    cpu._unreadable.cache_clear()


def test_windows_without_sysconf_and_getloadavg(monkeypatch, settings):
    """Windows' os has neither: discovery raised AttributeError, so no HAL had a CPU device."""
    monkeypatch.delattr(os, "sysconf")
    monkeypatch.delattr(os, "getloadavg")
    before = telemetry.counts()
    hal = HardwareAbstractionLayer(
        adapters=[cpu.CPUAdapter()], settings=settings(disable_plugin_autoload="1")
    )
    dev = hal.device("cpu")
    assert dev.capabilities.memory_bytes == 0  # unknown, never a guessed size
    info = dev.memory_info()
    assert (info.total_bytes, info.free_bytes, info.used_bytes) == (0, 0, 0)
    health = dev.health()
    assert health.status is HealthStatus.OK and health.utilization_pct is None
    assert health.messages == ("utilization unknown: no load average on this platform",)
    after = telemetry.counts()
    for figure in ("SC_PAGE_SIZE", "SC_PHYS_PAGES", "SC_AVPHYS_PAGES", "load average"):
        key = f"torchhal.cpu.unreadable,figure={figure}"
        assert after.get(key, 0) == before.get(key, 0) + 1, key  # said once, however often asked
    dev.memory_info()
    assert (
        telemetry.counts()["torchhal.cpu.unreadable,figure=SC_PAGE_SIZE"]
        == after["torchhal.cpu.unreadable,figure=SC_PAGE_SIZE"]
    )


def test_macos_without_available_pages(monkeypatch, settings):
    """macOS' sysconf has no SC_AVPHYS_PAGES: memory_info raised ValueError; the total stays read."""
    names = {k: v for k, v in os.sysconf_names.items() if k != "SC_AVPHYS_PAGES"}
    linux_sysconf = os.sysconf

    def macos_sysconf(name):
        if name not in names:
            raise ValueError("unrecognized configuration name")  # what macOS' os.sysconf says
        return linux_sysconf(name)

    monkeypatch.setattr(os, "sysconf_names", names)
    monkeypatch.setattr(os, "sysconf", macos_sysconf)
    hal = HardwareAbstractionLayer(
        adapters=[cpu.CPUAdapter()], settings=settings(disable_plugin_autoload="1")
    )
    info = hal.device("cpu").memory_info()
    expected = linux_sysconf("SC_PAGE_SIZE") * linux_sysconf("SC_PHYS_PAGES")
    assert info.total_bytes == expected == hal.device("cpu").capabilities.memory_bytes
    assert info.free_bytes == 0 and 0 < info.used_bytes < expected


def test_load_average_unobtainable(monkeypatch, settings):
    """os.getloadavg raises OSError where the system cannot give it: health() raised it."""

    def unobtainable():
        raise OSError("Load average was unobtainable")

    monkeypatch.setattr(os, "getloadavg", unobtainable)
    health = cpu.CPUAdapter().health(0)
    assert health.status is HealthStatus.OK and health.utilization_pct is None


def test_linux_figures_unchanged():
    info = cpu.CPUAdapter().memory_info(0)
    page = os.sysconf("SC_PAGE_SIZE")
    assert info.total_bytes == page * os.sysconf("SC_PHYS_PAGES")
    assert 0 < info.free_bytes <= info.total_bytes
    health = cpu.CPUAdapter().health(0)
    assert health.utilization_pct is not None and health.messages[0].startswith("1-minute load average")
