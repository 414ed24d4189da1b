"""Entry-point discovery, the allowlist, per-plugin isolation and diagnostics.

Listing entry points imports nothing. A plugin is imported only when allowed; one that fails
to import, implements no hook, raises in a hook or declares an unsupported API version is
skipped and recorded (strict mode raises instead). Entry points of the torchhal distribution
itself (the built-in kernels) load the same way but are not subject to the allowlist: they
are part of the core, not optional plugins (docs/decisions.md).
"""

from __future__ import annotations

import enum
import importlib.metadata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pluggy

from torchhal.hal_core import hookspecs, telemetry
from torchhal.hal_core.adapter import HAL_API_VERSION, VendorAdapter
from torchhal.hal_core.capabilities import DeviceCapabilities
from torchhal.hal_core.errors import PluginError
from torchhal.hal_core.kernels import KernelRegistry
from torchhal.hal_core.settings import Settings

log = telemetry.get_logger("torchhal.plugins")
CORE_DISTRIBUTION = "torchhal"
T = TypeVar("T")


class Status(str, enum.Enum):
    LOADED = "loaded"  # imported, hooks run, adapter found its hardware
    ABSENT = "absent"  # adapter loaded, but its runtime or hardware is not here
    SKIPPED = "skipped"  # not imported, by the allowlist or autoload switch
    FAILED = "failed"  # broke: import, hooks, API version, probe or discover raised


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
        if distribution == CORE_DISTRIBUTION:
            self._core.add(name)

    def _each(self, hook: str, call: Callable[[Callable[..., Any]], T]) -> list[tuple[str, T]]:
        """Run one hook plugin by plugin, so one raising plugin cannot take the others down."""
        results = []
        impls = sorted(getattr(self.manager.hook, hook).get_hookimpls(), key=lambda i: i.plugin_name)
        for impl in impls:
            try:
                results.append((impl.plugin_name, call(impl.function)))
            except Exception as exc:
                self.record(Diagnostic(impl.plugin_name, Status.FAILED, hook, f"{type(exc).__name__}: {exc}"))
        return results

    def register_kernels(self, registry: KernelRegistry) -> None:
        """Core ops first (they define what vendor candidates attach to), then other plugins."""
        impls = self.manager.hook.torchhal_register_kernels.get_hookimpls()
        for impl in sorted(impls, key=lambda i: (i.plugin_name not in self._core, i.plugin_name)):
            try:
                impl.function(registry=registry)
            except Exception as exc:
                self.record(
                    Diagnostic(impl.plugin_name, Status.FAILED, "kernels", f"{type(exc).__name__}: {exc}")
                )

    def adapters(self, builtin: Iterable[VendorAdapter] = ()) -> list[VendorAdapter]:
        found: list[VendorAdapter] = list(builtin)
        for plugin, result in self._each("torchhal_adapters", lambda fn: fn()):
            for adapter in result or ():
                if not isinstance(adapter, VendorAdapter):
                    self.record(
                        Diagnostic(
                            plugin, Status.FAILED, "adapters", f"returned {adapter!r}, not a VendorAdapter"
                        )
                    )
                elif not adapter.supports_api(HAL_API_VERSION):
                    low, high = adapter.api_versions
                    self.record(
                        Diagnostic(
                            adapter.name,
                            Status.FAILED,
                            "api-version",
                            f"supports HAL API {low}..{high}, this torchhal is {HAL_API_VERSION}",
                        )
                    )
                elif any(a.name == adapter.name for a in found):
                    self.record(
                        Diagnostic(
                            adapter.name,
                            Status.FAILED,
                            "adapters",
                            "an adapter of this name is already loaded",
                        )
                    )
                else:
                    found.append(adapter)
        return sorted(found, key=lambda a: (-a.priority, a.name))

    def activate(self, adapters: Sequence[VendorAdapter], registry: KernelRegistry) -> list[ActiveAdapter]:
        """Probe each adapter, discover its devices and let it register kernels, in isolation."""
        active = []
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
                if not devices:
                    self.record(
                        Diagnostic(adapter.name, Status.ABSENT, "discover", f"{probe.reason}; no devices")
                    )
                    continue
                try:
                    adapter.register_kernels(registry)
                except Exception as exc:
                    self.record(
                        Diagnostic(adapter.name, Status.FAILED, "kernels", f"{type(exc).__name__}: {exc}")
                    )
                self.record(
                    Diagnostic(
                        adapter.name, Status.LOADED, "discover", f"{len(devices)} device(s); {probe.reason}"
                    )
                )
                active.append(ActiveAdapter(adapter, devices))
        return active
