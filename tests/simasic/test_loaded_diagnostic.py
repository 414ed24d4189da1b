"""The simulated ASIC's `loaded` diagnostic, as `torchhal info` shows it."""

from __future__ import annotations

import pytest

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core.settings import Settings


@pytest.mark.parametrize("devices", ["1", "3"])
def test_the_diagnostic_gives_the_device_count_once(monkeypatch: pytest.MonkeyPatch, devices: str) -> None:
    """ "1 device(s); simulated ASIC spec 'edge-64x64', 1 device(s): time and memory modelled"."""
    monkeypatch.setenv("TORCHHAL_SIMASIC_DEVICES", devices)
    hal = HardwareAbstractionLayer(settings=Settings.from_env({"TORCHHAL_PLUGINS": "simasic"}))
    (diag,) = [d for d in hal.diagnostics if d.name == "simasic"]
    assert diag.reason == f"{devices} device(s); simulated ASIC spec 'edge-64x64': time and memory modelled"
