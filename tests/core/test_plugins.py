"""Plugin discovery: allowlist, autoload switch, isolation, strict mode, API versions, order."""

from __future__ import annotations

import sys

import pytest
from pydantic import ValidationError

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import ConfigurationError, PluginError
from torchhal.hal_core.plugins import Status
from torchhal.hal_core.settings import Settings

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
    assert "api_versions (2, 3) does not cover this torchhal's HAL API version 1" in d.reason
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


KERNEL_HOOK = """
RAN = []

@hookimpl
def torchhal_register_kernels(registry):
    RAN.append(True)
    import torch
    registry.register("matmul", "{name}-mm", torch.matmul, provider="{name}")
    {then}
"""


def kernel_plugin(name: str, *, api: tuple[int, int] = (1, 1), then: str = "pass") -> str:
    """A plugin with an adapter and a kernel hook that registers a matmul candidate, then `then`."""
    return adapter_plugin(name, api=api) + KERNEL_HOOK.format(name=name, then=then)


def providers(hal: HardwareAbstractionLayer) -> set[str]:
    return {c.provider for op in hal.kernels.ops() for c in hal.kernels.candidates(op)}


def test_plugin_refused_for_its_api_version_registers_no_kernels(plugin_dist, settings):
    module = plugin_dist("future", kernel_plugin("future", api=(2, 3)))
    plugin_dist("good", kernel_plugin("good"))
    hal = HardwareAbstractionLayer(settings=settings(plugins="future,good"))
    d = diag(hal, "future")
    assert (d.status, d.stage) == (Status.FAILED, "api-version")
    assert "skipped whole, its kernels included" in d.reason and d.distribution == "torchhal-test-future"
    assert "future" not in providers(hal) and "good" in providers(hal)
    assert sys.modules[module].RAN == []  # its kernel hook never ran
    assert [a.name for a in hal.adapters] == ["good", "cpu"]


def test_one_refused_adapter_refuses_its_whole_plugin(plugin_dist, settings):
    plugin_dist(
        "mixed",
        """
        from torchhal.hal_core import hookimpl
        from tests.core.adapters import FakeAdapter

        class Current(FakeAdapter):
            name = namespace = "current"

        class Old(FakeAdapter):
            name = namespace = "old"
            api_versions = (0, 0)

        @hookimpl
        def torchhal_adapters():
            return [Current(), Old()]
        """,
    )
    hal = HardwareAbstractionLayer(settings=settings(plugins="mixed"))
    d = diag(hal, "old")
    assert (d.status, d.stage) == (Status.FAILED, "api-version")
    assert "plugin 'mixed' is skipped whole" in d.reason
    assert [a.name for a in hal.adapters] == ["cpu"]


def test_kernel_hook_that_raises_leaves_no_candidate_and_no_adapter(plugin_dist, settings):
    plugin_dist("halfway", kernel_plugin("halfway", then="raise RuntimeError('second candidate broke')"))
    hal = HardwareAbstractionLayer(settings=settings(plugins="halfway"))
    d = diag(hal, "halfway")
    assert (d.status, d.stage) == (Status.FAILED, "kernels")
    assert "RuntimeError: second candidate broke" in d.reason
    assert "halfway" not in providers(hal)  # the candidate it registered before raising is gone
    assert [a.name for a in hal.adapters] == ["cpu"]


def test_adapter_whose_kernel_registration_raises_is_failed_not_loaded(settings):
    import torch

    from tests.core.adapters import FakeAdapter

    class HalfRegistered(FakeAdapter):
        def register_kernels(self, registry):
            registry.register("matmul", "acme-mm", torch.matmul, provider=self.name)
            registry.register("no_such_op", "acme-x", torch.add, provider=self.name)

    hal = HardwareAbstractionLayer(
        adapters=[HalfRegistered()], settings=settings(disable_plugin_autoload="1")
    )
    assert [(d.status, d.stage) for d in hal.diagnostics if d.name == "acme"] == [(Status.FAILED, "kernels")]
    assert "unknown op 'no_such_op'" in diag(hal, "acme").reason
    assert "acme" not in providers(hal)
    assert [d.id for d in hal.devices()] == ["cpu"]
    strict = settings(disable_plugin_autoload="1", strict_plugins="true")
    with pytest.raises(PluginError, match="no_such_op") as err:
        HardwareAbstractionLayer(adapters=[HalfRegistered()], settings=strict).devices()
    assert (err.value.plugin, err.value.stage) == ("acme", "kernels")


def test_strict_mode_raises_on_a_kernel_hook_that_raises(plugin_dist, settings):
    plugin_dist("bad", kernel_plugin("bad", then="raise RuntimeError('broke')"))
    hal = HardwareAbstractionLayer(settings=settings(strict_plugins="true", plugins="bad"))
    with pytest.raises(PluginError, match="broke") as err:
        hal.devices()
    assert (err.value.plugin, err.value.stage) == ("bad", "kernels")
    # asked again, the same plugin is blamed: the first attempt left no ops behind (the core's
    # kernel plugin was blamed for "op already defined")
    with pytest.raises(PluginError, match="broke") as again:
        hal.devices()
    assert (again.value.plugin, again.value.stage) == ("bad", "kernels")


def test_an_allowlisted_name_no_plugin_has_is_a_recorded_failure(plugin_dist, settings):
    """A typo in TORCHHAL_PLUGINS left the plugin it meant unloaded without a word."""
    plugin_dist("wanted", adapter_plugin("wanted"))
    hal = HardwareAbstractionLayer(settings=settings(plugins="Wanted,wanted"))
    assert [d.id for d in hal.devices() if d.id.startswith("wanted")] == ["wanted:0"]
    d = diag(hal, "Wanted")
    assert (d.status, d.stage) == (Status.FAILED, "allowlist")
    assert "TORCHHAL_PLUGINS names 'Wanted'; it accepts: " in d.reason and "wanted" in d.reason


def test_the_cpu_adapters_name_in_the_allowlist_is_no_failure(plugin_dist, settings):
    """`cpu` is the name `torchhal info` lists for the built-in adapter: allowlisted, it was
    recorded as a failure (strict mode raised). It allows no plugin, as meant."""
    plugin_dist("other", adapter_plugin("other"))
    hal = HardwareAbstractionLayer(settings=settings(plugins="cpu", strict_plugins="1"))
    assert [d.id for d in hal.devices()] == ["cpu"]
    assert [d.status for d in hal.diagnostics if d.name == "cpu"] == [Status.LOADED]
    assert (diag(hal, "other").status, diag(hal, "other").stage) == (Status.SKIPPED, "allowlist")


def test_a_misspelt_settings_keyword_is_refused():
    """Settings(disable_plugins_autoload=True) loaded every plugin: the keyword was dropped."""
    with pytest.raises(ValidationError, match="disable_plugins_autoload"):
        Settings(disable_plugins_autoload=True)  # type: ignore[call-arg]


@pytest.mark.parametrize("value", [",", " , "])
def test_an_allowlist_of_no_names_is_refused(settings, value):
    with pytest.raises(ConfigurationError, match=r"TORCHHAL_PLUGINS=.*names no plugin; to load none, set"):
        settings(plugins=value)


def test_a_blank_allowlist_is_unset_as_an_empty_one_is(settings):
    assert settings(plugins=" ").plugins is None


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda caps: [caps, caps], "device id acme:0 is given twice"),
        (
            lambda caps: [caps.model_copy(update={"vendor": "nvidia"})],
            "names adapter 'acme' of vendor 'nvidia'",
        ),
        (lambda caps: [object()], "returned object, not DeviceCapabilities"),
    ],
)
def test_records_an_adapter_cannot_stand_behind_fail_it(settings, change, reason):
    """Two devices under one id made hal.device(id) hold one for the other; a record of another
    vendor was listed under this adapter."""
    from tests.core.adapters import FakeAdapter, fake_caps

    class Miswritten(FakeAdapter):
        def discover(self):
            return change(fake_caps(0))

    hal = HardwareAbstractionLayer(adapters=[Miswritten()], settings=settings(disable_plugin_autoload="1"))
    d = diag(hal, "acme")
    assert (d.status, d.stage) == (Status.FAILED, "discover")
    assert reason in d.reason
    assert [dev.id for dev in hal.devices()] == ["cpu"]
