"""Entry-point discovery, the allowlist, per-plugin isolation and diagnostics.

Listing entry points imports nothing. A plugin is imported only when allowed; one that fails
to import, implements no hook, raises in a hook or declares an unsupported API version is
skipped whole and recorded (strict mode raises instead): it contributes no adapter and no
kernel candidate. Kernel registration is all or nothing, for plugins and adapters alike.
Entry points of the torchhal distribution itself (the built-in kernels) load the same way but
are not subject to the allowlist: they are part of the core, not optional plugins
(docs/decisions.md).
"""

from __future__ import annotations

import enum
import importlib.metadata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pluggy

from torchhal.hal_core import hookspecs, telemetry
from torchhal.hal_core.adapter import HAL_API_VERSION, VendorAdapter
from torchhal.hal_core.capabilities import DeviceCapabilities
from torchhal.hal_core.errors import PluginError
from torchhal.hal_core.kernels import KernelRegistry
from torchhal.hal_core.settings import Settings

log = telemetry.get_logger("torchhal.plugins")
CORE_DISTRIBUTION = "torchhal"


class Status(str, enum.Enum):
    LOADED = "loaded"  # imported, hooks run, adapter found its hardware
    ABSENT = "absent"  # adapter loaded, but its runtime or hardware is not here
    SKIPPED = "skipped"  # not imported, by the allowlist or autoload switch
    FAILED = "failed"  # broke: import, hooks, API version, probe, discover or kernel registration


@dataclass(frozen=True, slots=True)
class Diagnostic:
    name: str  # plugin (entry point) or adapter name
    status: Status
    stage: str  # allowlist, autoload, import, hooks, adapters, api-version, probe, discover, kernels
    reason: str
    distribution: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        return {
            "name": self.name,
            "status": self.status.value,
            "stage": self.stage,
            "reason": self.reason,
            "distribution": self.distribution,
        }


@dataclass(frozen=True, slots=True)
class ActiveAdapter:
    adapter: VendorAdapter
    devices: tuple[DeviceCapabilities, ...]


class PluginLoader:
    """Loads plugins into one pluggy manager and activates their adapters, recording everything."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.diagnostics: list[Diagnostic] = []
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)
        self._core: set[str] = set()  # plugins of the torchhal distribution itself
        self._distributions: dict[str, str | None] = {}  # plugin name -> its distribution

    def record(self, diag: Diagnostic) -> None:
        self.diagnostics.append(diag)
        if diag.status is Status.FAILED:
            telemetry.count("torchhal.plugin.failures", plugin=diag.name, stage=diag.stage)
            log.warning("plugin skipped", plugin=diag.name, stage=diag.stage, reason=diag.reason)
            if self.settings.strict_plugins:
                raise PluginError(diag.name, diag.stage, diag.reason)
        else:
            log.debug("plugin", plugin=diag.name, status=diag.status.value, reason=diag.reason)

    def load_entry_points(self) -> None:
        eps = sorted(importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP), key=lambda e: e.name)
        self._check_allowlist({ep.name for ep in eps})
        for ep in eps:
            dist = ep.dist.name if ep.dist is not None else None
            if dist != CORE_DISTRIBUTION:
                if self.settings.disable_plugin_autoload:
                    self.record(
                        Diagnostic(
                            ep.name,
                            Status.SKIPPED,
                            "autoload",
                            "TORCHHAL_DISABLE_PLUGIN_AUTOLOAD is set",
                            dist,
                        )
                    )
                    continue
                allow = self.settings.plugins
                if allow is not None and ep.name not in allow:
                    self.record(
                        Diagnostic(
                            ep.name,
                            Status.SKIPPED,
                            "allowlist",
                            f"not in TORCHHAL_PLUGINS={','.join(allow)}",
                            dist,
                        )
                    )
                    continue
            with telemetry.span("torchhal.plugin.load", plugin=ep.name, distribution=dist):
                try:
                    module = ep.load()
                except Exception as exc:
                    self.record(
                        Diagnostic(ep.name, Status.FAILED, "import", f"{type(exc).__name__}: {exc}", dist)
                    )
                    continue
                self.register(module, ep.name, dist)

    def _check_allowlist(self, installed: set[str]) -> None:
        """A name in TORCHHAL_PLUGINS that no installed plugin has (a typo, 'SimASIC') would leave
        the plugin it meant unloaded without a word: each is recorded as a failure."""
        allow = self.settings.plugins
        if allow is None or self.settings.disable_plugin_autoload:
            return
        for name in allow:
            if name not in installed:
                reason = f"TORCHHAL_PLUGINS names {name!r}; installed plugins: {', '.join(sorted(installed))}"
                self.record(Diagnostic(name, Status.FAILED, "allowlist", reason))

    def register(self, plugin: object, name: str, distribution: str | None = None) -> None:
        """Register a plugin object (module or instance) that implements torchhal hooks."""
        try:
            self.manager.register(plugin, name=name)
        except Exception as exc:  # pluggy rejects malformed hook implementations
            self.record(
                Diagnostic(name, Status.FAILED, "hooks", f"{type(exc).__name__}: {exc}", distribution)
            )
            return
        if not self.manager.get_hookcallers(plugin):
            self.manager.unregister(plugin)
            self.record(Diagnostic(name, Status.FAILED, "hooks", "implements no torchhal hook", distribution))
            return
        self._distributions[name] = distribution
        if distribution == CORE_DISTRIBUTION:
            self._core.add(name)

    def distributions(self) -> set[str]:
        """The distributions of the plugins still registered: the code behind their kernels."""
        return {
            d for name, d in self._distributions.items() if d is not None and self.manager.has_plugin(name)
        }

    def load(self, registry: KernelRegistry, builtin: Sequence[VendorAdapter] = ()) -> list[VendorAdapter]:
        """Collect the plugins' adapters, then run the kernel hooks of the plugins still standing.

        Adapters come first so that a plugin refused for them (an API version this core lacks)
        never runs its kernel hook. Returns `builtin` and the adapters of the plugins that loaded
        whole, by priority then name (never pluggy's registration order)."""
        offered = self._offered_adapters(builtin)
        impls = self.manager.hook.torchhal_register_kernels.get_hookimpls()
        # core ops first: they define what the other plugins' candidates attach to
        for impl in sorted(impls, key=lambda i: (i.plugin_name not in self._core, i.plugin_name)):
            try:
                with registry.all_or_nothing():
                    impl.function(registry=registry)
            except Exception as exc:
                self._refuse(impl.plugin_name, impl.plugin_name, "kernels", _describe(exc))
        kept = [a for plugin, found in offered.items() if self.manager.has_plugin(plugin) for a in found]
        return sorted([*builtin, *kept], key=lambda a: (-a.priority, a.name))

    def _offered_adapters(self, builtin: Sequence[VendorAdapter]) -> dict[str, list[VendorAdapter]]:
        """Each plugin's adapters, all or none: a plugin whose hook raises or that offers one
        adapter it may not is refused whole."""
        taken = {a.name for a in builtin}
        offered: dict[str, list[VendorAdapter]] = {}
        impls = self.manager.hook.torchhal_adapters.get_hookimpls()
        for impl in sorted(impls, key=lambda i: i.plugin_name):
            plugin = impl.plugin_name
            try:
                result: Any = impl.function()
                adapters = list(result or ())
                refusal = _refusal(plugin, adapters, taken)  # reads attributes an adapter may lack
            except Exception as exc:
                self._refuse(plugin, plugin, "torchhal_adapters", _describe(exc))
                continue
            if refusal is not None:
                self._refuse(plugin, *refusal)
                continue
            taken.update(a.name for a in adapters)
            offered[plugin] = adapters
        return offered

    def _refuse(self, plugin: str, name: str, stage: str, reason: str) -> None:
        """Record a plugin's failure and unregister it, so none of its hooks runs again."""
        self.manager.unregister(name=plugin)
        self.record(Diagnostic(name, Status.FAILED, stage, reason, self._distributions.get(plugin)))

    def activate(self, adapters: Sequence[VendorAdapter], registry: KernelRegistry) -> list[ActiveAdapter]:
        """Probe each adapter, discover its devices and let it register kernels, in isolation."""
        active = []
        taken_ids: set[str] = set()
        for adapter in adapters:
            with telemetry.span(
                "torchhal.adapter.discover", adapter=adapter.name, vendor=adapter.vendor
            ) as span:
                try:
                    probe = adapter.probe()
                except Exception as exc:
                    self.record(
                        Diagnostic(adapter.name, Status.FAILED, "probe", f"{type(exc).__name__}: {exc}")
                    )
                    continue
                if not probe.available:
                    self.record(Diagnostic(adapter.name, Status.ABSENT, "probe", probe.reason))
                    continue
                try:
                    devices = tuple(adapter.discover())
                except Exception as exc:
                    self.record(
                        Diagnostic(adapter.name, Status.FAILED, "discover", f"{type(exc).__name__}: {exc}")
                    )
                    continue
                span.set_attribute("torchhal.devices", len(devices))
                wrong = _wrong_records(adapter, devices, taken_ids)
                if wrong is not None:
                    self.record(Diagnostic(adapter.name, Status.FAILED, "discover", wrong))
                    continue
                if not devices:
                    self.record(
                        Diagnostic(adapter.name, Status.ABSENT, "discover", f"{probe.reason}; no devices")
                    )
                    continue
                try:
                    with registry.all_or_nothing():
                        adapter.register_kernels(registry)
                except Exception as exc:
                    self.record(Diagnostic(adapter.name, Status.FAILED, "kernels", _describe(exc)))
                    continue
                self.record(
                    Diagnostic(
                        adapter.name, Status.LOADED, "discover", f"{len(devices)} device(s); {probe.reason}"
                    )
                )
                active.append(ActiveAdapter(adapter, devices))
                taken_ids.update(adapter.device_id(c.index, c.device_type) for c in devices)
        return active


def _wrong_records(adapter: VendorAdapter, devices: Sequence[object], taken_ids: set[str]) -> str | None:
    """Why an adapter's discovered records cannot stand (None if they can): each must be
    DeviceCapabilities naming this adapter and its vendor, under a device id no other device
    has, or `hal.device(id)` and the ranking would hold one device for another."""
    ids = set(taken_ids)
    for caps in devices:
        if not isinstance(caps, DeviceCapabilities):
            return f"discover() returned {type(caps).__name__}, not DeviceCapabilities"
        if (caps.adapter, caps.vendor) != (adapter.name, adapter.vendor):
            return (
                f"a record names adapter {caps.adapter!r} of vendor {caps.vendor!r}; "
                f"this adapter is {adapter.name!r} of {adapter.vendor!r}"
            )
        device_id = adapter.device_id(caps.index, caps.device_type)
        if device_id in ids:
            return f"device id {device_id} is given twice"
        ids.add(device_id)
    return None


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _refusal(plugin: str, adapters: Sequence[object], taken: set[str]) -> tuple[str, str, str] | None:
    """Why a plugin's adapters cannot load, as (name to report, stage, reason); None if they can."""
    whole = f"; plugin {plugin!r} is skipped whole, its kernels included"
    names = set(taken)
    for adapter in adapters:
        if not isinstance(adapter, VendorAdapter):
            return plugin, "adapters", f"returned {adapter!r}, not a VendorAdapter{whole}"
        if not adapter.supports_api(HAL_API_VERSION):
            low, high = adapter.api_versions
            return (
                adapter.name,
                "api-version",
                f"supports HAL API {low}..{high}, this torchhal is {HAL_API_VERSION}{whole}",
            )
        if adapter.name in names:
            return adapter.name, "adapters", f"an adapter of this name is already loaded{whole}"
        names.add(adapter.name)
    return None
