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
from opentelemetry import trace

from torchhal.hal_core import hookspecs, telemetry
from torchhal.hal_core.adapter import VendorAdapter, attribute_problems
from torchhal.hal_core.adapters.cpu import CPUAdapter
from torchhal.hal_core.capabilities import DeviceCapabilities, ProbeResult
from torchhal.hal_core.errors import PluginError, UnknownOpError
from torchhal.hal_core.kernels import REFERENCE, KernelRegistry
from torchhal.hal_core.settings import Settings

log = telemetry.get_logger("torchhal.plugins")
CORE_DISTRIBUTION = "torchhal"


class Status(str, enum.Enum):
    LOADED = "loaded"  # imported, hooks run, adapter found its hardware (or a kernels-only plugin ran)
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
        self._adapter_distributions: dict[str, str | None] = {}  # adapter name -> its plugin's

    def record(self, diag: Diagnostic, span: trace.Span | None = None) -> None:
        """Keep `diag`, and put it on `span` (the plugin's or adapter's own, an error status when it
        failed) or, without one, a failure as an event on the current (discovery) span: a trace
        showed every plugin and adapter as fine, a failed import included."""
        self.diagnostics.append(diag)
        if span is not None:
            span.set_attributes(
                {
                    "torchhal.status": diag.status.value,
                    "torchhal.stage": diag.stage,
                    "torchhal.reason": diag.reason,
                }
            )
            if diag.status is Status.FAILED:
                span.set_status(trace.StatusCode.ERROR, f"{diag.stage}: {diag.reason}")
        elif diag.status is Status.FAILED:
            attributes = {"plugin": diag.name, "stage": diag.stage, "reason": diag.reason}
            trace.get_current_span().add_event("torchhal.plugin.failed", attributes)
        if diag.status is Status.FAILED:
            telemetry.count("torchhal.plugin.failures", plugin=diag.name, stage=diag.stage)
            log.warning("plugin failed", plugin=diag.name, stage=diag.stage, reason=diag.reason)
            if self.settings.strict_plugins:
                raise PluginError(diag.name, diag.stage, diag.reason)
        else:
            log.debug("plugin", plugin=diag.name, status=diag.status.value, reason=diag.reason)

    def load_entry_points(self) -> None:
        """Load each allowed entry point by name. Of entry points that share a name (two
        distributions), the core's or else the first by distribution name loads, the same on
        every host; the others are refused unimported (one was imported, then refused by pluggy
        with which one won depending on sys.path order)."""
        eps = sorted(
            importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP),
            key=lambda e: (e.name, _dist(e) != CORE_DISTRIBUTION, _dist(e) or ""),
        )
        core = {ep.name for ep in eps if _dist(ep) == CORE_DISTRIBUTION}
        self._check_allowlist({ep.name for ep in eps} - core, core)
        loading: dict[str, str | None] = {}  # entry-point name -> distribution of the one loaded
        for ep in eps:
            dist = _dist(ep)
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
            if ep.name in loading:
                reason = (
                    f"not imported: distribution {loading[ep.name]} has a plugin of this name, "
                    "loaded instead; plugin names must be unique"
                )
                self.record(Diagnostic(ep.name, Status.FAILED, "import", reason, dist))
                continue
            loading[ep.name] = dist
            with telemetry.span("torchhal.plugin.load", plugin=ep.name, distribution=dist) as span:
                try:
                    module = ep.load()
                except Exception as exc:
                    self.record(
                        Diagnostic(ep.name, Status.FAILED, "import", f"{type(exc).__name__}: {exc}", dist),
                        span,
                    )
                    continue
                self.register(module, ep.name, dist, span)

    def _check_allowlist(self, plugins: set[str], core: set[str]) -> None:
        """A name in TORCHHAL_PLUGINS that no installed plugin has (a typo, 'SimASIC') would leave
        the plugin it meant unloaded without a word: each is recorded as a failure, the message
        listing the plugins of other distributions, which the allowlist governs, and the built-in
        CPU adapter's name (`cpu` alone allows no plugin). The core's own entry points (the
        built-in kernels) load whatever it says: naming one is accepted, and said to change nothing."""
        allow = self.settings.plugins
        if allow is None or self.settings.disable_plugin_autoload:
            return
        accepted = plugins | {CPUAdapter.name}
        for name in allow:
            if name in core:
                log.info("TORCHHAL_PLUGINS names a part of torchhal itself, which always loads", plugin=name)
            elif name not in accepted:
                reason = f"TORCHHAL_PLUGINS names {name!r}; it accepts: {', '.join(sorted(accepted))}"
                self.record(Diagnostic(name, Status.FAILED, "allowlist", reason))

    def register(
        self, plugin: object, name: str, distribution: str | None = None, span: trace.Span | None = None
    ) -> None:
        """Register a plugin object (module or instance) that implements torchhal hooks; `span`: its
        loading span, which a refusal marks."""
        try:
            self.manager.register(plugin, name=name)
        except Exception as exc:  # pluggy rejects malformed hook implementations
            self.record(
                Diagnostic(name, Status.FAILED, "hooks", f"{type(exc).__name__}: {exc}", distribution), span
            )
            return
        callers = self.manager.get_hookcallers(plugin) or []
        # a hook this torchhal does not define is a misspelling, unless marked optionalhook: pluggy's
        # way for a plugin to implement a hook of a later torchhal, which this one never calls
        optional = {
            c.name
            for c in callers
            if c.spec is None and all(i.optionalhook for i in c.get_hookimpls() if i.plugin is plugin)
        }
        unknown = sorted(c.name for c in callers if c.spec is None and c.name not in optional)
        if len(callers) == len(optional) or unknown:
            self.manager.unregister(plugin)
            reason = "implements no torchhal hook"
            if unknown:  # a misspelt hook would never run: its kernels or adapters silently missing
                known = ", ".join(sorted(n for n in vars(hookspecs) if n.startswith(f"{hookspecs.PROJECT}_")))
                reason = (
                    f"implements {', '.join(unknown)}, which torchhal does not define (its hooks: {known})"
                )
            self.record(Diagnostic(name, Status.FAILED, "hooks", reason, distribution), span)
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
        builtin = self._checked_builtin(builtin)
        offered = self._offered_adapters(builtin)
        impls = self.manager.hook.torchhal_register_kernels.get_hookimpls()
        # core ops first: they define what the other plugins' candidates attach to
        waiting = sorted(impls, key=lambda i: (i.plugin_name not in self._core, i.plugin_name))
        while waiting:  # a pass per round of plugins that attach to ops other plugins define
            tried = [(impl, self._register_kernels(impl, registry, offered)) for impl in waiting]
            deferred = [(impl, exc) for impl, exc in tried if exc is not None]
            if len(deferred) == len(waiting):  # no progress: the ops they attach to are nowhere
                for impl, exc in deferred:
                    self._refuse(impl.plugin_name, impl.plugin_name, "kernels", _describe(exc))
                break
            waiting = [impl for impl, _ in deferred]
        kept = [a for plugin, found in offered.items() if self.manager.has_plugin(plugin) for a in found]
        return sorted([*builtin, *kept], key=lambda a: (-a.priority, a.name))

    def _register_kernels(
        self, impl: Any, registry: KernelRegistry, offered: dict[str, list[VendorAdapter]]
    ) -> UnknownOpError | None:
        """Run one plugin's kernel hook, all or nothing. Returns the error of a plugin that
        attaches to an op no plugin has defined yet (one whose name sorted before the definer's
        failed): deferred, its hook is run again in the next pass, and refused with this error
        when a pass makes no progress. Any other failure is refused now."""
        plugin = impl.plugin_name
        # a plugin of kernels only has no adapter whose diagnostic would show it loaded
        kernels_only = plugin not in self._core and not offered.get(plugin)
        before = _kernel_names(registry) if kernels_only else None
        try:
            with registry.all_or_nothing():
                impl.function(registry=registry)
        except UnknownOpError as exc:
            if plugin not in self._core:
                return exc
            self._refuse(plugin, plugin, "kernels", _describe(exc))
            return None
        except Exception as exc:
            self._refuse(plugin, plugin, "kernels", _describe(exc))
            return None
        if before is not None:
            reason = _kernels_added(before, _kernel_names(registry))
            self.record(Diagnostic(plugin, Status.LOADED, "kernels", reason, self._distributions.get(plugin)))
        return None

    def _checked_builtin(self, builtin: Sequence[VendorAdapter]) -> list[VendorAdapter]:
        """The adapters handed to the HAL directly, each held to the rules a plugin's adapter is:
        one with a malformed attribute crashed discovery (a str priority in the sort) and one of
        an unsupported API version or a name already taken loaded unchecked."""
        kept: list[VendorAdapter] = []
        taken: set[str] = set()
        for adapter in builtin:
            try:
                problem = _adapter_problem(adapter, taken)
            except Exception as exc:  # an attribute that raises when read
                problem = "adapters", _describe(exc)
            if problem is not None:
                self.record(Diagnostic(_label(adapter, type(adapter).__name__), Status.FAILED, *problem))
                continue
            kept.append(adapter)
            taken.add(adapter.name)
        return kept

    def _offered_adapters(self, builtin: Sequence[VendorAdapter]) -> dict[str, list[VendorAdapter]]:
        """Each plugin's adapters, all or none: a plugin whose hook raises or that offers one
        adapter it may not is refused whole."""
        taken = {a.name for a in builtin}
        offered: dict[str, list[VendorAdapter]] = {}
        impls = self.manager.hook.torchhal_adapters.get_hookimpls()
        with_kernels = {i.plugin_name for i in self.manager.hook.torchhal_register_kernels.get_hookimpls()}
        for impl in sorted(impls, key=lambda i: i.plugin_name):
            plugin = impl.plugin_name
            try:
                result: Any = impl.function()
                if not isinstance(result, Sequence) or isinstance(result, (str, bytes)):
                    # a str or dict was iterated ("returned 'a'"), None taken for no adapters
                    self._refuse(
                        plugin,
                        plugin,
                        "adapters",
                        f"torchhal_adapters returned {result!r}, not a list or tuple of VendorAdapter",
                    )
                    continue
                adapters = list(result)
                refusal = _refusal(plugin, adapters, taken)  # reads attributes an adapter may lack
            except Exception as exc:
                self._refuse(plugin, plugin, "torchhal_adapters", _describe(exc))
                continue
            if refusal is not None:
                self._refuse(plugin, *refusal)
                continue
            if not adapters and plugin not in with_kernels:  # loaded, offering nothing: said, not hidden
                reason = "torchhal_adapters returned no adapter, and the plugin registers no kernels"
                self.record(
                    Diagnostic(plugin, Status.LOADED, "adapters", reason, self._distributions.get(plugin))
                )
            taken.update(a.name for a in adapters)
            self._adapter_distributions.update((a.name, self._distributions.get(plugin)) for a in adapters)
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
            dist = self._adapter_distributions.get(adapter.name)  # None: built in or handed to the HAL
            with telemetry.span(
                "torchhal.adapter.discover", adapter=adapter.name, vendor=adapter.vendor
            ) as span:
                try:
                    probe = adapter.probe()
                except Exception as exc:
                    self.record(
                        Diagnostic(
                            adapter.name, Status.FAILED, "probe", f"{type(exc).__name__}: {exc}", dist
                        ),
                        span,
                    )
                    continue
                if not isinstance(probe, ProbeResult):
                    reason = f"probe() returned {probe!r}, not a ProbeResult"
                    self.record(Diagnostic(adapter.name, Status.FAILED, "probe", reason, dist), span)
                    continue
                if not probe.available:
                    self.record(Diagnostic(adapter.name, Status.ABSENT, "probe", probe.reason, dist), span)
                    continue
                try:
                    devices = tuple(adapter.discover())
                except Exception as exc:
                    self.record(
                        Diagnostic(
                            adapter.name, Status.FAILED, "discover", f"{type(exc).__name__}: {exc}", dist
                        ),
                        span,
                    )
                    continue
                span.set_attribute("torchhal.devices", len(devices))
                try:
                    device_ids = _device_ids(adapter, devices, taken_ids)
                except (TypeError, ValueError) as exc:
                    self.record(Diagnostic(adapter.name, Status.FAILED, "discover", str(exc), dist), span)
                    continue
                if not devices:
                    self.record(
                        Diagnostic(
                            adapter.name, Status.ABSENT, "discover", f"{probe.reason}; no devices", dist
                        ),
                        span,
                    )
                    continue
                try:
                    with registry.all_or_nothing():
                        adapter.register_kernels(registry)
                except Exception as exc:
                    self.record(
                        Diagnostic(adapter.name, Status.FAILED, "kernels", _describe(exc), dist), span
                    )
                    continue
                self.record(
                    Diagnostic(
                        adapter.name,
                        Status.LOADED,
                        "discover",
                        f"{len(devices)} device(s); {probe.reason}",
                        dist,
                    ),
                    span,
                )
                active.append(ActiveAdapter(adapter, devices))
                taken_ids.update(device_ids)
        return active


def _device_ids(adapter: VendorAdapter, devices: Sequence[object], taken_ids: set[str]) -> list[str]:
    """The HAL ids of an adapter's discovered records, or TypeError/ValueError saying why the records
    cannot stand: each must be DeviceCapabilities naming this adapter and its vendor, on a device
    type torch knows (every HAL device has a torch device), under a non-empty str id no other
    device has, or `hal.device(id)` and the ranking would hold one device for another."""
    import torch

    ids = set(taken_ids)
    found = []
    for caps in devices:
        if not isinstance(caps, DeviceCapabilities):
            raise TypeError(f"discover() returned {type(caps).__name__}, not DeviceCapabilities")
        if (caps.adapter, caps.vendor) != (adapter.name, adapter.vendor):
            raise ValueError(
                f"a record names adapter {caps.adapter!r} of vendor {caps.vendor!r}; "
                f"this adapter is {adapter.name!r} of {adapter.vendor!r}"
            )
        try:
            torch.device(caps.device_type, caps.index)
        except RuntimeError as exc:
            raise ValueError(
                f"device_type {caps.device_type!r} is not a device type torch knows: {exc}"
            ) from None
        try:
            device_id = adapter.device_id(caps.index, caps.device_type)
        except Exception as exc:
            raise ValueError(
                f"device_id({caps.index}, {caps.device_type!r}) raised {_describe(exc)}"
            ) from exc
        if not isinstance(device_id, str) or not device_id:
            raise TypeError(
                f"device_id({caps.index}, {caps.device_type!r}) returned {device_id!r}, not a non-empty str"
            )
        if device_id in ids:
            raise ValueError(f"device id {device_id} is given twice")
        ids.add(device_id)
        found.append(device_id)
    return found


def _kernel_names(registry: KernelRegistry) -> tuple[set[str], set[str]]:
    """The registry's ops, and its candidates as `op/provider/name` (references left out)."""
    ops = set(registry.ops())
    return ops, {
        f"{op}/{c.qualified_name}" for op in ops for c in registry.candidates(op) if c.name != REFERENCE
    }


def _kernels_added(before: tuple[set[str], set[str]], after: tuple[set[str], set[str]]) -> str:
    """What a plugin of kernels only added, for its `loaded` diagnostic (`torchhal info`)."""
    ops, candidates = sorted(after[0] - before[0]), sorted(after[1] - before[1])
    parts = [f"defined op(s) {', '.join(ops)}"] if ops else []
    parts.append(f"added {', '.join(candidates)}" if candidates else "added no kernel candidate")
    return "kernels only, no adapter: " + "; ".join(parts)


def _dist(ep: importlib.metadata.EntryPoint) -> str | None:
    return ep.dist.name if ep.dist is not None else None


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _label(adapter: object, fallback: str) -> str:
    """The name to report an adapter under: its own where it is an adapter with a usable one."""
    name = getattr(adapter, "name", None) if isinstance(adapter, VendorAdapter) else None
    return name if isinstance(name, str) and name else fallback


def _adapter_problem(adapter: object, taken: set[str]) -> tuple[str, str] | None:
    """Why `adapter` cannot load, as (stage, reason); None if it can."""
    problems = attribute_problems(adapter)
    if problems:
        stage = "api-version" if any(attr == "api_versions" for attr, _ in problems) else "adapters"
        return stage, "; ".join(problem for _, problem in problems)
    assert isinstance(adapter, VendorAdapter)
    if adapter.name in taken:
        return "adapters", "an adapter of this name is already loaded"
    return None


def _refusal(plugin: str, adapters: Sequence[object], taken: set[str]) -> tuple[str, str, str] | None:
    """Why a plugin's adapters cannot load, as (name to report, stage, reason); None if they can."""
    whole = f"; plugin {plugin!r} is skipped whole, its kernels included"
    names = set(taken)
    for adapter in adapters:
        problem = _adapter_problem(adapter, names)
        if problem is not None:
            stage, reason = problem
            return _label(adapter, plugin), stage, reason + whole
        names.add(_label(adapter, plugin))
    return None
