"""The adapter as the HAL sees it: entry-point discovery, env selection, capabilities, topology."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
from torchhal_simasic.adapter import SimASICAdapter

from tests.simasic.tiny import TINY
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import DeviceNotFoundError, DType, Feature, HealthStatus, LinkType, PluginError
from torchhal.hal_core.settings import Settings


def _fresh_hal(**env: str) -> HardwareAbstractionLayer:
    """A HAL that loads the installed simasic plugin alone, whatever TORCHHAL_* the caller set."""
    return HardwareAbstractionLayer(settings=Settings.from_env({"TORCHHAL_PLUGINS": "simasic", **env}))


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="torchhal.adapters", name="simasic")
    (ep,) = eps
    assert ep.value == "torchhal_simasic.plugin"
    assert ep.dist is not None and ep.dist.name == "torchhal-simasic"


def test_discovered_through_the_entry_point_with_the_edge_spec_by_default():
    hal = _fresh_hal()
    dev = hal.device("simasic:0")
    assert [d.id for d in hal.devices()] == ["simasic:0", "cpu"]
    caps = dev.capabilities
    assert (caps.vendor, caps.adapter, caps.device_type, caps.arch) == (
        "simulated",
        "simasic",
        "cpu",
        "systolic-64x64",
    )
    assert (caps.compute_units, caps.simd_width, caps.collective_backends) == (1, 64, ("gloo",))
    assert caps.features == {Feature.SIMULATED, Feature.DEVICE_EVENTS}
    assert DType.FP64 not in caps.dtypes
    peaks = caps.declared_peaks
    assert peaks is not None and peaks.source == "simulated spec edge-64x64"
    assert peaks.tflops[DType.BF16] == pytest.approx(2 * 64 * 64 * 2 * 0.8e9 / 1e12)
    assert peaks.memory_bandwidth_gbps == pytest.approx(34.1)
    assert not hal.best_device().simulated, "a real device ranks above a simulated one"


def test_env_selects_the_spec_and_device_count(monkeypatch):
    monkeypatch.setenv("TORCHHAL_SIMASIC_SPEC", "h100-like")
    monkeypatch.setenv("TORCHHAL_SIMASIC_DEVICES", "3")
    hal = _fresh_hal()
    ids = [d.id for d in hal.devices() if d.capabilities.adapter == "simasic"]
    assert ids == ["simasic:0", "simasic:1", "simasic:2"]
    caps = hal.device("simasic:2").capabilities
    assert (caps.name, caps.memory_bytes) == ("Simulated ASIC h100-like-132x128", 80_000_000_000)
    assert caps.declared_peaks is not None
    assert caps.declared_peaks.tflops[DType.BF16] == pytest.approx(989.4, rel=1e-3)
    topo = hal.topology()
    links = [
        topo.link("simasic:0", "simasic:1"),
        topo.link("simasic:1", "simasic:2"),
        topo.link("simasic:0", "simasic:2"),
    ]
    assert all(lk is not None and lk.type is LinkType.HOST and lk.bandwidth_gbps == 64.0 for lk in links)
    assert topo.link("simasic:0", "cpu") is None


def test_env_spec_file(monkeypatch, tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    monkeypatch.setenv("TORCHHAL_SIMASIC_SPEC", str(path))
    assert _fresh_hal().device("simasic:0").capabilities.arch == "systolic-4x4"


@pytest.mark.parametrize("devices", ["-2", "²", "65"])
def test_bad_env_is_a_recorded_plugin_failure_or_an_error_when_strict(monkeypatch, devices):
    monkeypatch.setenv("TORCHHAL_SIMASIC_DEVICES", devices)
    hal = _fresh_hal()
    (diag,) = [d for d in hal.diagnostics if d.name == "simasic"]
    assert (diag.status.value, diag.stage) == ("failed", "probe")
    assert f"TORCHHAL_SIMASIC_DEVICES must be an integer from 1 to 64, got {devices!r}" in diag.reason
    assert [d.id for d in hal.devices()] == ["cpu"]
    with pytest.raises(PluginError, match="TORCHHAL_SIMASIC_DEVICES"):
        _fresh_hal(TORCHHAL_STRICT_PLUGINS="1").devices()


def test_device_services(sim_hal):
    hal = sim_hal()
    dev = hal.device("simasic:0")
    dev.synchronize()
    health = dev.health()
    assert health.status is HealthStatus.OK and "simulated" in health.messages[0]
    assert dev.memory_info().simulated
    assert hal.topology().devices == ("simasic:0", "cpu")
    with pytest.raises(DeviceNotFoundError, match="no device 'simasic:4'; devices found: simasic:0"):
        dev.adapter.synchronize(4)


def test_each_hal_simulates_its_own_machine():
    first, second = _fresh_hal(), _fresh_hal()
    a, b = first.device("simasic:0"), second.device("simasic:0")
    a.adapter.state(0).clock.advance(1.0)
    assert b.adapter.state(0).clock.now() == 0.0


def test_the_template_adapter_passes_the_conformance_kit():
    from torchhal.testing import format_report, run_conformance

    report = run_conformance(SimASICAdapter())
    assert report.ok, format_report(report)
