"""The HAL facade: devices, ids, best-device choice with reasons, report, import hygiene."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.core.adapters import FakeAdapter, fake_caps
from torchhal import DeviceRequirements, HardwareAbstractionLayer
from torchhal.hal_core import (
    ConfigurationError,
    DeclaredPeaks,
    DeviceNotFoundError,
    DType,
    Feature,
    NoDeviceMatchesError,
)


@pytest.fixture
def hal(settings):
    fast = fake_caps(0, declared_peaks=DeclaredPeaks(source="test sheet", tflops={DType.BF16: 400.0}))
    slow = fake_caps(1, declared_peaks=DeclaredPeaks(source="test sheet", tflops={DType.BF16: 100.0}))
    sim = fake_caps(2, features=frozenset({Feature.SIMULATED}), dtypes=frozenset({DType.FP32, DType.FP64}))
    return HardwareAbstractionLayer(
        adapters=[FakeAdapter([slow, fast, sim])], settings=settings(disable_plugin_autoload="1")
    )


def test_device_ids_and_aliases(hal):
    assert [d.id for d in hal.devices()] == ["acme:1", "acme:0", "acme:2", "cpu"]
    assert hal.device("acme").id == "acme:0"
    assert hal.device("cpu:0") is hal.device("cpu")


def test_unknown_device_lists_the_ids_that_exist(hal):
    with pytest.raises(DeviceNotFoundError) as err:
        hal.device("cuda:3")
    assert str(err.value) == "no device 'cuda:3'; devices found: acme:1, acme:0, acme:2, cpu"


def test_best_device_prefers_real_then_priority_then_declared_peak(hal):
    choice = hal.choose_device(DeviceRequirements(dtypes=frozenset({DType.BF16})))
    assert choice.device.id == "acme:0"
    text = choice.explain()
    assert "acme:0: chosen: real device" in text and "declared peak bf16 400 TFLOP/s (test sheet)" in text
    assert "acme:2: rejected: dtypes ['bf16'] not supported" in text
    assert [r.device.id for r in choice.ranking] == ["acme:0", "acme:1", "cpu", "acme:2"]


def test_simulated_device_chosen_only_when_it_alone_qualifies(hal):
    assert hal.best_device(DeviceRequirements(features=frozenset({Feature.SIMULATED}))).id == "acme:2"


def test_requirements_no_device_meets_name_each_failure(hal):
    req = DeviceRequirements(dtypes=frozenset({DType.FP8_E4M3}), min_memory_bytes=2**40)
    with pytest.raises(NoDeviceMatchesError) as err:
        hal.best_device(req)
    assert set(err.value.failures) == {"acme:0", "acme:1", "acme:2", "cpu"}
    assert "dtypes ['fp8_e4m3'] not supported" in err.value.failures["cpu"][0]
    assert any("memory" in f and "< 1099511627776 required" in f for f in err.value.failures["acme:0"])


def test_report_is_json_and_complete(hal):
    report = json.loads(json.dumps(hal.report()))
    assert [d["id"] for d in report["devices"]] == ["acme:1", "acme:0", "acme:2", "cpu"]
    assert report["hal_api_version"] == 1
    assert {"rms_norm", "attention", "matmul"} <= set(report["kernels"])
    assert any(d["name"] == "acme" and d["status"] == "loaded" for d in report["diagnostics"])


def test_malformed_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("TORCHHAL_STRICT_PLUGINS", "perhaps")
    with pytest.raises(ConfigurationError, match="TORCHHAL_STRICT_PLUGINS='perhaps'"):
        HardwareAbstractionLayer()


def test_import_does_no_device_work_and_loads_no_plugin():
    code = (
        "import sys, torchhal, torchhal.ops;"
        "hal = torchhal.HardwareAbstractionLayer();"
        "bad = [m for m in sys.modules if m.startswith(('torchhal_', 'torchhal.kernels.plugin', 'triton'))];"
        "assert not bad, bad;"
        "assert 'torch.cuda' not in sys.modules or not __import__('torch').cuda.is_initialized();"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
