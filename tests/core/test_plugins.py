"""Plugin discovery: allowlist, autoload switch, isolation, strict mode, API versions, order."""

from __future__ import annotations

import sys

import pytest

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import PluginError
from torchhal.hal_core.plugins import Status

ADAPTER_PLUGIN = """
from torchhal.hal_core import hookimpl, ProbeResult
from tests.core.adapters import FakeAdapter, fake_caps

class {cls}(FakeAdapter):
    name = "{name}"
    priority = {priority}
    namespace = "{name}"
    api_versions = {api}

@hookimpl
def torchhal_adapters():
    return [{cls}([fake_caps(adapter="{name}")])]
"""


def adapter_plugin(name: str, priority: int = 50, api: tuple[int, int] = (1, 1)) -> str:
    return ADAPTER_PLUGIN.format(cls=name.capitalize() + "Adapter", name=name, priority=priority, api=api)


def diag(hal: HardwareAbstractionLayer, name: str):
    found = [d for d in hal.diagnostics if d.name == name]
    assert found, f"no diagnostic for {name}: {hal.diagnostics}"
    return found[-1]


def test_plugin_not_on_allowlist_is_never_imported(plugin_dist, settings):
    sentinel = plugin_dist("sentinel", "raise AssertionError('the sentinel plugin was imported')\n")
    plugin_dist("wanted", adapter_plugin("wanted"))
    hal = HardwareAbstractionLayer(settings=settings(plugins="wanted"))
    assert [d.id for d in hal.devices() if d.id.startswith("wanted")] == ["wanted:0"]
    assert sentinel not in sys.modules
    d = diag(hal, "sentinel")
    assert (d.status, d.stage) == (Status.SKIPPED, "allowlist")
    assert "TORCHHAL_PLUGINS=wanted" in d.reason


def test_disable_autoload_imports_no_plugin_but_keeps_cpu_and_builtin_kernels(plugin_dist, settings):
    sentinel = plugin_dist("sentinel", "raise AssertionError('imported')\n")
    hal = HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1"))
    assert sentinel not in sys.modules
    assert diag(hal, "sentinel").status is Status.SKIPPED
    assert [d.id for d in hal.devices()] == ["cpu"]
    assert "rms_norm" in hal.kernels.ops()


def test_plugin_that_fails_to_import_is_skipped_with_reason(plugin_dist, settings):
    plugin_dist("broken", "import torchhal_no_such_module_xyz\n")
    plugin_dist("good", adapter_plugin("good"))
    hal = HardwareAbstractionLayer(settings=settings())
    d = diag(hal, "broken")
    assert (d.status, d.stage) == (Status.FAILED, "import")
    assert "torchhal_no_such_module_xyz" in d.reason
    assert "good:0" in [dev.id for dev in hal.devices()]


def test_plugin_without_hooks_is_skipped(plugin_dist, settings):
    plugin_dist("hookless", "VALUE = 1\n")
    hal = HardwareAbstractionLayer(settings=settings())
    d = diag(hal, "hookless")
    assert (d.status, d.stage, d.reason) == (Status.FAILED, "hooks", "implements no torchhal hook")


def test_plugin_raising_in_hook_does_not_take_others_down(plugin_dist, settings):
    plugin_dist(
        "raiser",
        """
        from torchhal.hal_core import hookimpl
        @hookimpl
        def torchhal_adapters():
            raise RuntimeError("driver exploded")
        """,
    )
    plugin_dist("good", adapter_plugin("good"))
    hal = HardwareAbstractionLayer(settings=settings())
    d = diag(hal, "raiser")
    assert (d.status, d.stage) == (Status.FAILED, "torchhal_adapters")
    assert "driver exploded" in d.reason
    assert "good:0" in [dev.id for dev in hal.devices()]


def test_unsupported_api_version_is_skipped(plugin_dist, settings):
    plugin_dist("future", adapter_plugin("future", api=(2, 3)))
    hal = HardwareAbstractionLayer(settings=settings())
    d = diag(hal, "future")
    assert (d.status, d.stage) == (Status.FAILED, "api-version")
    assert "2..3" in d.reason and "is 1" in d.reason
    assert not [dev for dev in hal.devices() if dev.id.startswith("future")]


@pytest.mark.parametrize(
    "source, stage",
    [
        ("import torchhal_no_such_module_xyz\n", "import"),
        ("VALUE = 1\n", "hooks"),
        (adapter_plugin("future", api=(2, 2)), "api-version"),
    ],
)
def test_strict_mode_raises(plugin_dist, settings, source, stage):
    plugin_dist("future" if stage == "api-version" else "bad", source)
    hal = HardwareAbstractionLayer(settings=settings(strict_plugins="true"))
    with pytest.raises(PluginError) as err:
        hal.devices()
    assert err.value.stage == stage


def test_adapter_order_is_priority_then_name_not_registration_order(plugin_dist, settings):
    plugin_dist("zeta", adapter_plugin("zeta", priority=70))
    plugin_dist("alpha", adapter_plugin("alpha", priority=20))
    plugin_dist("beta", adapter_plugin("beta", priority=70))
    hal = HardwareAbstractionLayer(settings=settings(plugins="zeta,alpha,beta"))
    names = [a.name for a in hal.adapters]
    assert names == ["beta", "zeta", "alpha", "cpu"]


def test_absent_hardware_is_reported_absent_not_failed(settings):
    from tests.core.adapters import FakeAdapter

    hal = HardwareAbstractionLayer(
        adapters=[FakeAdapter(available=False)], settings=settings(disable_plugin_autoload="1")
    )
    d = diag(hal, "acme")
    assert (d.status, d.reason) == (Status.ABSENT, "no acme")
    assert [dev.id for dev in hal.devices()] == ["cpu"]


def test_probe_raising_is_isolated(settings):
    from tests.core.adapters import FakeAdapter

    class Exploding(FakeAdapter):
        def probe(self):
            raise OSError("libacme.so: cannot open shared object file")

    hal = HardwareAbstractionLayer(adapters=[Exploding()], settings=settings(disable_plugin_autoload="1"))
    d = diag(hal, "acme")
    assert (d.status, d.stage) == (Status.FAILED, "probe")
    assert "libacme.so" in d.reason


def test_discovery_is_lazy_and_per_hal(plugin_dist, settings):
    module = plugin_dist("lazy", adapter_plugin("lazy"))
    hal = HardwareAbstractionLayer(settings=settings())
    assert module not in sys.modules  # constructing a HAL loads nothing
    hal.devices()
    assert module in sys.modules
    other = HardwareAbstractionLayer(settings=settings(plugins="none-at-all"))
    assert [d.id for d in other.devices()] == ["cpu"]
