"""The three vendor plugins as the HAL finds them: entry points, cheap imports, fast absent probes."""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import subprocess
import sys
import time

import pytest
from torchhal_amd.adapter import AmdAdapter
from torchhal_intel.adapter import IntelAdapter
from torchhal_nvidia.adapter import NvidiaAdapter

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core.settings import Settings

PLUGINS = {"nvidia": "torchhal-nvidia", "amd": "torchhal-amd", "intel": "torchhal-intel"}


def test_each_plugin_is_its_own_distribution_with_one_entry_point():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="torchhal.adapters")}
    for name, dist in PLUGINS.items():
        assert eps[name].dist is not None and eps[name].dist.name == dist
        assert eps[name].value == f"torchhal_{name}.plugin"


def test_importing_the_plugins_loads_no_vendor_library():
    code = (
        "import json, sys, torchhal_nvidia.plugin, torchhal_amd.plugin, torchhal_intel.plugin;"
        "print(json.dumps(sorted({'torch', 'pynvml', 'amdsmi'} & set(sys.modules))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout) == []


@pytest.mark.parametrize("make", [NvidiaAdapter, AmdAdapter, IntelAdapter])
def test_probe_of_an_absent_runtime_answers_in_well_under_a_millisecond(make):
    vendor = make()
    if vendor.probe().available:
        pytest.skip(f"{vendor.name}'s runtime is present here; this measures its absence")
    times = []
    for _ in range(200):
        start = time.perf_counter()
        vendor.probe()
        times.append(time.perf_counter() - start)
    assert statistics.median(times) < 0.5e-3


def test_discovery_with_the_vendor_plugins_stays_under_50_ms():
    settings = Settings.from_env({"TORCHHAL_PLUGINS": ",".join(PLUGINS)})
    HardwareAbstractionLayer(settings=settings).devices()  # imports the plugin modules once
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        hal = HardwareAbstractionLayer(settings=settings)
        hal.devices()
        runs.append(time.perf_counter() - start)
    assert min(runs) < 0.050, f"discovery took {min(runs) * 1e3:.1f} ms at best"
    activated = {d.name for d in hal.diagnostics if d.stage in ("probe", "discover")}
    assert set(PLUGINS) <= activated  # each adapter was probed: absent here, loaded on its hardware
