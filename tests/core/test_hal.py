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
    InvalidArgumentError,
    NoDeviceMatchesError,
    telemetry,
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


@pytest.mark.parametrize("bad", [None, 3])
def test_a_device_that_is_neither_an_id_nor_a_device_is_refused(hal, bad):
    with pytest.raises(
        InvalidArgumentError,
        match=rf"a device must be a Device, a torch.device or an id such as 'cuda:0', got .*{bad}",
    ):
        hal.device(bad)
    with pytest.raises(InvalidArgumentError, match="a device must be a Device"), hal.use(bad):
        pass


class _Meta(FakeAdapter):
    """Devices of a torch device type of their own (no namespace): `meta:0` and `meta:1`."""

    name = "meta"
    namespace = None


def test_a_torch_device_gives_the_device_that_natively_owns_it(settings, monkeypatch):
    """`hal.device(tensor.device)` is what a PyTorch user writes; it was refused. Without an index
    it is the type's current device, as in torch: torch.cuda.set_device(r) then
    torch.device("cuda") is device r, never silently device 0."""
    import torch

    hal = HardwareAbstractionLayer(
        adapters=[_Meta([fake_caps(i, adapter="meta", device_type="meta") for i in range(2)]), FakeAdapter()],
        settings=settings(disable_plugin_autoload="1"),
    )
    assert hal.device(torch.device("meta", 1)) is hal.device("meta:1")
    assert hal.device(torch.empty(1).device) is hal.device("cpu")  # acme:0 is reached only by id
    assert hal.device(torch.device("cpu", 0)) is hal.device("cpu")
    with pytest.raises(DeviceNotFoundError, match=r"no device 'meta:7'; devices found: .*meta:0, meta:1"):
        hal.device(torch.device("meta", 7))
    with pytest.raises(
        InvalidArgumentError, match=r"torch.device\('meta'\) has no index and torch keeps no current"
    ):
        hal.device(torch.device("meta"))  # torch has no current meta device

    class CurrentIsOne:
        @staticmethod
        def current_device() -> int:
            return 1

    real = torch.get_device_module
    monkeypatch.setattr(torch, "get_device_module", lambda t: CurrentIsOne if t == "meta" else real(t))
    assert hal.device(torch.device("meta")) is hal.device("meta:1")


def test_another_hals_device_is_refused_rather_than_charged(hal, settings):
    """Routed through use(), another HAL's device ran the ops and its ledger and clock took them."""
    other = HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1"))
    theirs = other.device("cpu")
    assert hal.device(hal.device("cpu")) is hal.device("cpu")
    with pytest.raises(InvalidArgumentError, match=r"device cpu belongs to another HardwareAbstractionLayer"):
        hal.device(theirs)
    with pytest.raises(InvalidArgumentError, match="belongs to another"), hal.use(theirs):
        pass


def test_requirements_of_the_wrong_type_are_refused(hal):
    with pytest.raises(
        InvalidArgumentError, match=r"requirements must be a DeviceRequirements, got str 'cpu'"
    ):
        hal.best_device("cpu")


def test_best_device_prefers_real_then_priority_then_declared_peak(hal):
    choice = hal.choose_device(DeviceRequirements(dtypes=frozenset({DType.BF16})))
    assert choice.device.id == "acme:0"
    text = choice.explain()
    assert "acme:0: chosen: real device" in text and "declared peak bf16 400 TFLOP/s (test sheet)" in text
    assert "acme:2: rejected: dtypes ['bf16'] not supported" in text
    assert [r.device.id for r in choice.ranking] == ["acme:0", "acme:1", "cpu", "acme:2"]


def test_requirements_take_torch_dtypes(hal):
    """`dtypes={torch.bfloat16}` is what a PyTorch user writes; it was refused as no DType."""
    import torch

    req = DeviceRequirements(dtypes={torch.bfloat16, "fp32"})
    assert req.dtypes == {DType.BF16, DType.FP32}
    assert hal.best_device(req).id == hal.best_device(DeviceRequirements(dtypes={DType.BF16})).id
    with pytest.raises(ValueError, match=r"torchhal does not track torch\.complex64; .*torch\.bfloat16"):
        DeviceRequirements(dtypes=[torch.complex64])


def test_simulated_device_chosen_only_when_it_alone_qualifies(hal):
    assert hal.best_device(DeviceRequirements(features=frozenset({Feature.SIMULATED}))).id == "acme:2"


def test_requirements_no_device_meets_name_each_failure(hal):
    req = DeviceRequirements(dtypes=frozenset({DType.FP8_E4M3}), min_memory_bytes=2**40)
    with pytest.raises(NoDeviceMatchesError) as err:
        hal.best_device(req)
    assert set(err.value.failures) == {"acme:0", "acme:1", "acme:2", "cpu"}
    assert "dtypes ['fp8_e4m3'] not supported" in err.value.failures["cpu"][0]
    assert any("memory" in f and "< 1099511627776 required" in f for f in err.value.failures["acme:0"])


def _strict_json(text: str) -> object:
    """json.loads refusing NaN and +-Infinity, which JSON has not and JSON.parse rejects."""

    def refuse(constant: str) -> object:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_report_is_json_and_complete(hal):
    report = _strict_json(json.dumps(hal.report()))
    assert [d["id"] for d in report["devices"]] == ["acme:1", "acme:0", "acme:2", "cpu"]
    assert report["hal_api_version"] == 1
    assert {"rms_norm", "attention", "matmul"} <= set(report["kernels"])
    assert any(d["name"] == "acme" and d["status"] == "loaded" for d in report["diagnostics"])
    assert {"name": "reference", "provider": "torchhal", "priority": "-inf"} in report["kernels"]["rms_norm"]


def test_malformed_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("TORCHHAL_STRICT_PLUGINS", "perhaps")
    with pytest.raises(
        ConfigurationError, match=r"TORCHHAL_STRICT_PLUGINS='perhaps'.* \(on: 1, true, yes, on; off"
    ):
        HardwareAbstractionLayer()


def test_setting_values_are_read_without_surrounding_blanks(settings):
    assert settings(strict_plugins=" 1 ", autotune=" off").strict_plugins is True


def test_cache_dir_reads_home_as_a_shell_does(settings, monkeypatch, tmp_path):
    """'~/x' was a directory named '~' in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert settings(cache_dir="~/th").cache_dir == tmp_path / "th"


def test_a_relative_cache_dir_is_taken_from_the_working_directory_once(settings, monkeypatch, tmp_path):
    """It stayed relative, so a process that changed directory wrote its cache somewhere new."""
    monkeypatch.chdir(tmp_path)
    chosen = settings(cache_dir="cache").cache_dir
    monkeypatch.chdir("/")
    assert chosen == tmp_path / "cache" and chosen.is_absolute()


def test_a_relative_xdg_cache_home_is_ignored(settings, monkeypatch, tmp_path):
    """The XDG specification: a relative path there is invalid and ignored."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert settings().cache_dir == tmp_path / ".cache" / "torchhal"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings().cache_dir == tmp_path / "xdg" / "torchhal"


def test_a_misspelt_setting_is_logged_once_and_a_plugins_own_variable_is_not(capsys):
    """TORCHHAL_AUTOTUNES was ignored without a word; TORCHHAL_SIMASIC_SPEC is the simulated
    ASIC's own variable, which the core does not know."""
    from torchhal.hal_core.settings import Settings

    telemetry.configure(log_format="json")
    capsys.readouterr()
    env = {"TORCHHAL_AUTOTUNES": "off", "TORCHHAL_SIMASIC_SPEC": "edge", "TORCHHAL_CACHEDIR": "/tmp/x"}
    for _ in range(2):
        assert Settings.from_env(env).autotune == "auto"
    lines = [json.loads(raw) for raw in capsys.readouterr().err.splitlines()]
    assert sorted((x["variable"], x["did_you_mean"]) for x in lines) == [
        ("TORCHHAL_AUTOTUNES", "TORCHHAL_AUTOTUNE"),
        ("TORCHHAL_CACHEDIR", "TORCHHAL_CACHE_DIR"),
    ]
    assert all(x["event"] == "not a torchhal setting; ignored" for x in lines)


def test_disabling_a_kernel_no_candidate_has_is_logged(settings, capsys):
    """Not for provider/name of an adapter absent here (acme): its kernels exist where it does."""
    telemetry.configure(log_format="json")
    hal = HardwareAbstractionLayer(
        adapters=[FakeAdapter(available=False)],
        settings=settings(disable_plugin_autoload="1", disable_kernels="triton,tirton,acme/fast"),
    )
    hal.devices()
    lines = [json.loads(raw) for raw in capsys.readouterr().err.splitlines()]
    (line,) = (x for x in lines if x["event"] == "TORCHHAL_DISABLE_KERNELS names no kernel candidate")
    assert line["level"] == "warning" and line["names"] == ["tirton"] and "torchhal/triton" in line["known"]


def test_an_adapter_whose_topology_raises_leaves_only_its_links_out(settings, capsys):
    """It took hal.topology(), hal.report() and so `torchhal info` down with it."""

    class NoTopology(FakeAdapter):
        def topology(self):
            raise RuntimeError("nvml gone")

    telemetry.configure(log_format="json")
    hal = HardwareAbstractionLayer(
        adapters=[NoTopology([fake_caps(0)])], settings=settings(disable_plugin_autoload="1")
    )
    report = hal.report()
    assert [d["id"] for d in report["devices"]] == ["acme:0", "cpu"] and report["topology"]["links"] == []
    lines = [json.loads(raw) for raw in capsys.readouterr().err.splitlines()]
    assert any(
        x["event"] == "adapter topology failed; its links are left out" and "nvml gone" in x["error"]
        for x in lines
    )


def test_import_does_no_device_work_and_loads_no_plugin():
    code = (
        "import sys, torchhal, torchhal.ops;"
        "hal = torchhal.HardwareAbstractionLayer();"
        # torch._dynamo: 1.6 s of imports, and it imports triton
        "heavy = ('torchhal_', 'torchhal.kernels.plugin', 'triton', 'torch._dynamo');"
        "bad = [m for m in sys.modules if m.startswith(heavy)];"
        "assert not bad, bad;"
        "assert 'torch.cuda' not in sys.modules or not __import__('torch').cuda.is_initialized();"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_subpackages_are_attributes_after_import_torchhal():
    """`import torchhal; torchhal.kernels.patch(model)`, as the README writes it, raised
    AttributeError until something imported torchhal.kernels; the import itself stays light.
    `torchhal.telemetry.configure` (DESIGN.md) after a bare `import torchhal` too."""
    code = (
        "import sys, torchhal;"
        "light = not any(m.startswith(('torchhal.kernels', 'torchhal.distributed')) for m in sys.modules);"
        "names = [torchhal.kernels.patch.__name__, torchhal.distributed.__name__,"
        " torchhal.evaluation.__name__, torchhal.testing.__name__, torchhal.ops.__name__,"
        " torchhal.telemetry.configure.__name__];"
        "print(light, names)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    names = "'patch', 'torchhal.distributed', 'torchhal.evaluation', 'torchhal.testing', 'torchhal.ops'"
    assert out.stdout.strip() == f"True [{names}, 'configure']"  # telemetry was lost once
