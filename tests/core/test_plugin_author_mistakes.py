"""What a plugin or adapter author can get wrong, and what discovery does with it."""

from __future__ import annotations

import pytest
import torch

from tests.core.adapters import FakeAdapter, fake_caps
from tests.core.test_plugins import adapter_plugin, diag, kernel_plugin, providers
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import DeviceNotFoundError, PluginError
from torchhal.hal_core.plugins import Status


def test_a_misspelt_hook_fails_its_plugin_naming_the_hook(plugin_dist, settings):
    """`torchhal_register_kernel` (no s) never ran: the adapter loaded without its kernels and no
    diagnostic said why; a plugin whose only hook was misspelt had no diagnostic at all."""
    source = kernel_plugin("typo").replace("def torchhal_register_kernels", "def torchhal_register_kernel")
    plugin_dist("typo", source)
    plugin_dist("good", adapter_plugin("good"))
    hal = HardwareAbstractionLayer(settings=settings(plugins="typo,good"))
    d = diag(hal, "typo")
    assert (d.status, d.stage) == (Status.FAILED, "hooks")
    assert "implements torchhal_register_kernel, which torchhal does not define" in d.reason
    assert "torchhal_adapters, torchhal_register_kernels" in d.reason
    assert [a.name for a in hal.adapters] == ["good", "cpu"]
    assert "typo" not in providers(hal)
    with pytest.raises(PluginError, match="torchhal_register_kernel,") as err:
        HardwareAbstractionLayer(settings=settings(plugins="typo", strict_plugins="1")).devices()
    assert (err.value.plugin, err.value.stage) == ("typo", "hooks")


ATTRIBUTE_CASES = [
    # (attribute, value written in the plugin's source, stage, reason)
    ("priority", "'high'", "adapters", "priority must be an int, got 'high'"),  # crashed discovery
    ("priority", "float('nan')", "adapters", "priority must be an int, got nan"),  # arbitrary order
    ("api_versions", "'1'", "api-version", "got '1'"),  # was "not enough values to unpack"
    ("api_versions", "(True, True)", "api-version", "got (True, True)"),  # loaded as (1, 1)
    ("api_versions", "(1.0, 1.0)", "api-version", "got (1.0, 1.0)"),
    ("api_versions", "(1, 1, 1)", "api-version", "got (1, 1, 1)"),
    ("name", "''", "adapters", "name must be a non-empty string without spaces or commas"),
    ("name", "5", "adapters", "got 5"),
    ("vendor", "None", "adapters", "vendor must be a non-empty string, got None"),
    ("namespace", "'a:b'", "adapters", "namespace must be None or a non-empty string without ':'"),
]


@pytest.mark.parametrize(("attribute", "value", "stage", "reason"), ATTRIBUTE_CASES)
def test_a_malformed_adapter_attribute_refuses_its_plugin_not_discovery(
    plugin_dist, settings, attribute, value, stage, reason
):
    source = adapter_plugin("odd") + f"\nOddAdapter.{attribute} = {value}\n"
    plugin_dist("odd", source)
    plugin_dist("good", adapter_plugin("good"))
    hal = HardwareAbstractionLayer(settings=settings(plugins="odd,good"))
    failed = [d for d in hal.diagnostics if d.status is Status.FAILED]
    assert [(d.stage, d.distribution) for d in failed] == [(stage, "torchhal-test-odd")]
    assert reason in failed[0].reason and "plugin 'odd' is skipped whole" in failed[0].reason
    assert [a.name for a in hal.adapters] == ["good", "cpu"]
    assert [d.id for d in hal.devices()] == ["good:0", "cpu"]


@pytest.mark.parametrize(
    ("returned", "shown"),
    [
        ("'acme'", "returned 'acme'"),  # iterated: the reason named 'a'
        ("{'acme': Adapter()}", "returned {'acme': "),  # iterated: the keys
        ("None", "returned None"),  # a missing return: no adapter and no diagnostic
        ("Adapter()", "returned <"),  # was "'Adapter' object is not iterable"
    ],
)
def test_an_adapters_hook_that_returns_no_list_is_refused_naming_what_it_returned(
    plugin_dist, settings, returned, shown
):
    plugin_dist(
        "loose",
        f"""
        from torchhal.hal_core import hookimpl
        from tests.core.adapters import FakeAdapter as Adapter

        @hookimpl
        def torchhal_adapters():
            return {returned}
        """,
    )
    hal = HardwareAbstractionLayer(settings=settings(plugins="loose"))
    d = diag(hal, "loose")
    assert (d.status, d.stage) == (Status.FAILED, "adapters")
    assert d.reason.startswith(f"torchhal_adapters {shown}")
    assert d.reason.endswith("not a list or tuple of VendorAdapter")
    assert [a.name for a in hal.adapters] == ["cpu"]


class _Future(FakeAdapter):
    name = namespace = "future"
    api_versions = (2, 3)


class _Wordy(FakeAdapter):
    name = namespace = "wordy"
    priority = "high"  # type: ignore[assignment]


class _Cpu(FakeAdapter):
    name = "cpu"


def test_adapters_handed_to_the_hal_are_held_to_the_plugin_rules(settings):
    """`HardwareAbstractionLayer(adapters=...)` skipped every check: an unsupported API version
    loaded, a str priority crashed discovery with a bare TypeError, and names were listed twice."""
    hal = HardwareAbstractionLayer(
        adapters=[FakeAdapter(), FakeAdapter(), _Cpu(), _Future(), _Wordy()],
        settings=settings(disable_plugin_autoload="1"),
    )
    assert [a.name for a in hal.adapters] == ["acme", "cpu"]
    assert [d.id for d in hal.devices()] == ["acme:0", "cpu"]
    failed = {(d.name, d.stage, d.reason) for d in hal.diagnostics if d.status is Status.FAILED}
    assert failed == {
        ("acme", "adapters", "an adapter of this name is already loaded"),
        ("cpu", "adapters", "an adapter of this name is already loaded"),
        ("future", "api-version", "api_versions (2, 3) does not cover this torchhal's HAL API version 1"),
        ("wordy", "adapters", "priority must be an int, got 'high'"),
    }
    strict = settings(disable_plugin_autoload="1", strict_plugins="1")
    with pytest.raises(PluginError, match=r"api_versions \(2, 3\) does not cover") as err:
        HardwareAbstractionLayer(adapters=[_Future()], settings=strict).devices()
    assert (err.value.plugin, err.value.stage) == ("future", "api-version")


@pytest.mark.parametrize("first_on_path", ["aa", "zz"])
def test_entry_points_sharing_a_name_load_one_the_same_whatever_the_path_order(
    tmp_path, monkeypatch, settings, first_on_path
):
    """Both were imported, the one later on sys.path then refused by pluggy (its reason a dump of
    the plugin registry), so which plugin ran depended on the path order of the host."""
    import importlib
    import sys

    for dist in [*sorted({"aa", "zz"} - {first_on_path}), first_on_path]:  # prepended: last is first
        root = tmp_path / dist
        (root / f"torchhal_test_{dist}-0.1.dist-info").mkdir(parents=True)
        (root / f"{dist}_shared.py").write_text(adapter_plugin(dist))
        info = root / f"torchhal_test_{dist}-0.1.dist-info"
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchhal-test-{dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[torchhal.adapters]\nshared = {dist}_shared\n")
        monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    try:
        hal = HardwareAbstractionLayer(settings=settings(plugins="shared"))
        assert [a.name for a in hal.adapters] == ["aa", "cpu"]
        assert "zz_shared" not in sys.modules
        d = diag(hal, "shared")
        assert (d.status, d.stage, d.distribution) == (Status.FAILED, "import", "torchhal-test-zz")
        assert d.reason == (
            "not imported: distribution torchhal-test-aa has a plugin of this name, loaded instead; "
            "plugin names must be unique"
        )
    finally:
        for module in ("aa_shared", "zz_shared"):
            sys.modules.pop(module, None)


def test_an_adapters_diagnostics_name_the_distribution_it_came_from(plugin_dist, settings):
    """`torchhal info --json` showed "distribution": null for every adapter, installed wheels too."""
    plugin_dist("good", adapter_plugin("good"))
    hal = HardwareAbstractionLayer(settings=settings(plugins="good"))
    d = diag(hal, "good")
    assert (d.status, d.stage, d.distribution) == (Status.LOADED, "discover", "torchhal-test-good")
    assert diag(hal, "cpu").distribution is None  # built into the core


def test_a_hook_of_a_later_torchhal_marked_optional_is_not_a_misspelling(plugin_dist, settings):
    """pluggy's optionalhook lets a plugin implement a hook a later core adds; the misspelt-hook
    check refused such a plugin whole."""
    source = adapter_plugin("ahead") + (
        "\n\nfrom torchhal.hal_core import hookimpl as _impl\n\n"
        "@_impl(optionalhook=True)\ndef torchhal_future_hook():\n    raise AssertionError('never called')\n"
    )
    plugin_dist("ahead", source)
    hal = HardwareAbstractionLayer(settings=settings(plugins="ahead"))
    assert [a.name for a in hal.adapters] == ["ahead", "cpu"]
    assert diag(hal, "ahead").status is Status.LOADED


class _UnknownDeviceType(FakeAdapter):
    name = vendor = "npu"

    def __init__(self) -> None:
        super().__init__([fake_caps(adapter="npu", vendor="npu", device_type="npu")])


class _ProbeReturnsBool(FakeAdapter):
    name = vendor = "boolprobe"

    def probe(self):  # type: ignore[override]
        return True


class _DeviceIdRaises(FakeAdapter):
    name = vendor = "idraises"

    def __init__(self) -> None:
        super().__init__([fake_caps(adapter="idraises", vendor="idraises")])

    def device_id(self, index: int, device_type: str) -> str:
        raise KeyError(index)


class _DeviceIdNone(FakeAdapter):
    name = vendor = "idnone"

    def __init__(self) -> None:
        super().__init__([fake_caps(adapter="idnone", vendor="idnone")])

    def device_id(self, index: int, device_type: str) -> str:
        return None  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("adapter", "stage", "reason"),
    [
        # every HAL call raised "Expected one of cpu, cuda, ... device type at start of device string: npu"
        (_UnknownDeviceType, "discover", "device_type 'npu' is not a device type torch knows"),
        (_ProbeReturnsBool, "probe", "probe() returned True, not a ProbeResult"),  # AttributeError
        (_DeviceIdRaises, "discover", "device_id(0, 'cpu') raised KeyError: 0"),  # KeyError out of the HAL
        (
            _DeviceIdNone,
            "discover",
            "device_id(0, 'cpu') returned None, not a non-empty str",
        ),  # loaded as None
    ],
)
def test_an_adapter_whose_records_or_probe_are_wrong_fails_alone(settings, adapter, stage, reason):
    hal = HardwareAbstractionLayer(
        adapters=[adapter(), FakeAdapter()], settings=settings(disable_plugin_autoload="1")
    )
    assert [d.id for d in hal.devices()] == ["acme:0", "cpu"]
    failed = [
        (d.name, d.stage, d.reason[: len(reason)]) for d in hal.diagnostics if d.status is Status.FAILED
    ]
    assert failed == [(adapter.name, stage, reason)]
    with pytest.raises(PluginError, match="failed at " + stage):
        HardwareAbstractionLayer(
            adapters=[adapter()], settings=settings(disable_plugin_autoload="1", strict_plugins="1")
        ).devices()


def test_a_torch_device_of_a_type_no_adapter_found_names_the_devices(settings):
    """On a build without CUDA, torch.cuda.current_device() raised a bare AssertionError."""
    hal = HardwareAbstractionLayer(adapters=[FakeAdapter()], settings=settings(disable_plugin_autoload="1"))
    for missing in (torch.device("cuda"), torch.device("xpu"), torch.device("meta")):
        with pytest.raises(
            DeviceNotFoundError, match=f"no device '{missing.type}'; devices found: acme:0, cpu"
        ):
            hal.device(missing)


def test_a_plugin_that_offers_nothing_is_listed_saying_so(plugin_dist, settings):
    """A plugin whose torchhal_adapters returned [] and that registers no kernels was imported and
    registered but appeared nowhere: not in `torchhal info`, not in the diagnostics."""
    plugin_dist(
        "empty",
        """
        from torchhal.hal_core import hookimpl

        @hookimpl
        def torchhal_adapters():
            return []
        """,
    )
    hal = HardwareAbstractionLayer(settings=settings(plugins="empty"))
    d = diag(hal, "empty")
    assert (d.status, d.stage) == (Status.LOADED, "adapters")
    assert d.reason == "torchhal_adapters returned no adapter, and the plugin registers no kernels"
    assert [a.name for a in hal.adapters] == ["cpu"]
