"""HardwareAbstractionLayer: the facade users hold.

Construction is free; plugins are loaded and devices discovered on first use. A process may
hold several HALs: each has its own plugin manager, adapters and kernel registry.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchhal.hal_core import telemetry
from torchhal.hal_core.adapter import HAL_API_VERSION, VendorAdapter
from torchhal.hal_core.adapters.cpu import CPUAdapter
from torchhal.hal_core.capabilities import DeviceRequirements, DType, Topology
from torchhal.hal_core.device import Device
from torchhal.hal_core.dispatch_memo import guard_implementation
from torchhal.hal_core.errors import (
    DeviceNotFoundError,
    InvalidArgumentError,
    NoDeviceMatchesError,
    UnsupportedError,
)
from torchhal.hal_core.kernels import REFERENCE, KernelRegistry, Locate
from torchhal.hal_core.plugins import ActiveAdapter, Diagnostic, PluginLoader, Status
from torchhal.hal_core.settings import Settings
from torchhal.hal_core.tuning import Tuner, code_versions

if TYPE_CHECKING:
    import torch

    from torchhal.hal_core.capabilities import MeasuredProfile
    from torchhal.hal_core.collectives import Communicator

log = telemetry.get_logger("torchhal.hal")
_active: contextvars.ContextVar[tuple[HardwareAbstractionLayer, Device] | None] = contextvars.ContextVar(
    "torchhal_active_device", default=None
)


active_use: Callable[[], tuple[HardwareAbstractionLayer, Device] | None] = _active.get
"""The innermost `hal.use(device)` block's (HAL, device), if any: ops dispatch through that HAL.
A bound C method rather than a function: every op call asks, and a Python frame costs more."""


@contextlib.contextmanager
def resumed_use(active: tuple[HardwareAbstractionLayer, Device] | None) -> Iterator[None]:
    """Make `active`, an earlier `active_use()` (None: no block), the active use again for a while:
    an op's backward runs where its forward ran, on whichever thread autograd runs it."""
    token = _active.set(active)
    try:
        yield
    finally:
        _active.reset(token)


def keeping_use(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, run under the `hal.use(device)` block active now (or none) wherever and whenever
    it is called: for work torch runs again later, on the thread of its choosing, such as the
    forward that activation checkpointing recomputes during backward. While torch.compile traces,
    `function` itself: Dynamo cannot trace a context variable (a graph break per call), and a
    compiled graph runs no hook of ours anyway (the backward custom ops have none either)."""
    import torch  # loaded by whoever checkpoints; hal_core does not import it at module level

    if torch.compiler.is_compiling():
        return function
    use = active_use()

    @functools.wraps(function)
    def in_use(*args: Any, **kwargs: Any) -> Any:
        if active_use() is use:
            return function(*args, **kwargs)
        with resumed_use(use):
            return function(*args, **kwargs)

    return in_use


@dataclass(frozen=True, slots=True)
class Ranked:
    device: Device
    eligible: bool
    reasons: tuple[str, ...]  # why it failed, or what it was ranked on


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    device: Device
    ranking: tuple[Ranked, ...]  # eligible devices best first, then the rejected ones

    def explain(self) -> str:
        lines = []
        for r in self.ranking:
            verdict = "chosen" if r.device is self.device else ("eligible" if r.eligible else "rejected")
            lines.append(f"{r.device.id}: {verdict}: {'; '.join(r.reasons)}")
        return "\n".join(lines)


class _Discovered:
    def __init__(
        self, adapters: list[VendorAdapter], active: list[ActiveAdapter], loader: PluginLoader
    ) -> None:
        self.adapters = tuple(adapters)
        self.diagnostics = tuple(loader.diagnostics)
        self.distributions = tuple(sorted(loader.distributions()))
        self.devices = tuple(Device(a.adapter, caps) for a in active for caps in a.devices)
        self.by_id = {d.id: d for d in self.devices}
        self.by_torch: dict[torch.device, Device] = {}
        for dev in self.devices:
            # Tensors route to the device that natively owns their torch device; devices under a
            # namespace of their own (a simulated ASIC in host memory) are reached through `use()`.
            if dev.adapter.namespace is None:
                self.by_torch.setdefault(dev.torch_device, dev)

    def not_found(self, requested: str) -> DeviceNotFoundError:
        """The error for a device id none of these devices has, naming the plugins that failed."""
        failed = [(d.name, d.stage, d.reason) for d in self.diagnostics if d.status is Status.FAILED]
        return DeviceNotFoundError(requested, self.by_id, failed)


class HardwareAbstractionLayer:
    """Adapters, devices, kernels and collectives for this process, discovered on first use."""

    def __init__(
        self,
        *,
        plugins: Sequence[object] = (),
        adapters: Sequence[VendorAdapter] = (),
        settings: Settings | None = None,
    ) -> None:
        """`plugins`: extra hook-implementing objects; `adapters`: extra adapter instances."""
        self.settings = settings if settings is not None else Settings.from_env()
        self._kernels = KernelRegistry(
            disabled=frozenset(self.settings.disable_kernels),
            tuner=Tuner(
                self.settings.cache_dir,
                self.settings.autotune,
                code=self._kernel_code,
                timing=self.settings.selection_timing,
            ),
        )
        self._extra_plugins = tuple(plugins)
        self._extra_adapters = tuple(adapters)
        self._state: _Discovered | None = None
        self._lock = threading.Lock()
        self._profiles: dict[str, MeasuredProfile] = {}
        self._locator: Locate = self._locate  # bound once: `dispatch` hands it on with every call

    def _kernel_code(self) -> dict[str, str]:
        """Versions of the code behind the kernel candidates, which measured selections persist
        beside their winners (candidates that `plugins=` objects register have none)."""
        return code_versions(self._discovered().distributions)

    def _discovered(self) -> _Discovered:
        state = self._state
        if state is None:
            with self._lock:
                if self._state is None:
                    self._state = self._discover()
                state = self._state
        return state

    def _discover(self) -> _Discovered:
        # all or nothing: after a strict-mode PluginError, the next call discovers again from an
        # empty registry (the kept ops made it blame the core plugin: "already defined")
        with telemetry.span("torchhal.discovery") as span, self._kernels.all_or_nothing():
            loader = PluginLoader(self.settings)
            loader.load_entry_points()
            for plugin in self._extra_plugins:
                loader.register(plugin, getattr(plugin, "__name__", type(plugin).__name__))
            adapters = loader.load(self._kernels, builtin=(CPUAdapter(), *self._extra_adapters))
            active = loader.activate(adapters, self._kernels)
            self._warn_unknown_disabled_kernels(
                absent={a.name for a in adapters} - {x.adapter.name for x in active}
            )
            state = _Discovered(adapters, active, loader)
            span.set_attribute("torchhal.adapters", [a.name for a in adapters])
            span.set_attribute("torchhal.devices", [d.id for d in state.devices])
        log.info("discovery done", devices=[d.id for d in state.devices], adapters=[a.name for a in adapters])
        return state

    def _warn_unknown_disabled_kernels(self, absent: set[str]) -> None:
        """A TORCHHAL_DISABLE_KERNELS entry that names no candidate (a typo) disables nothing.
        `provider/name` entries of adapters absent here are not judged: their kernels are
        registered only where their hardware is, and one setting may serve a whole fleet. The
        names offered leave out the reference, which the setting may not name (Settings)."""
        registry = self._kernels
        known = {
            n
            for op in registry.ops()
            for c in registry.candidates(op)
            if c.name != REFERENCE
            for n in (c.name, c.qualified_name)
        }
        unknown = [
            name
            for name in self.settings.disable_kernels
            if name not in known and name.partition("/")[0] not in absent
        ]
        if unknown:
            log.warning(
                "TORCHHAL_DISABLE_KERNELS names no kernel candidate",
                names=unknown,
                known=sorted(known),
                hint="write provider/name for a kernel of an adapter whose hardware is absent here",
            )

    @property
    def kernels(self) -> KernelRegistry:
        """The registry of ops and candidates, filled by discovery."""
        if self._state is None:
            self._discovered()
        return self._kernels

    @property
    def adapters(self) -> tuple[VendorAdapter, ...]:
        """Every adapter that loaded (present or absent), in priority order."""
        return self._discovered().adapters

    @property
    def diagnostics(self) -> tuple[Diagnostic, ...]:
        return self._discovered().diagnostics

    def devices(self) -> tuple[Device, ...]:
        return self._discovered().devices

    def device(self, device_id: str | Device | torch.device) -> Device:
        """A device by HAL id (`cuda:0`, `simasic:1`, `cpu`); `cuda` means `cuda:0`. A Device is
        returned as it is if it is this HAL's: another HAL's would run on, and charge, that one.
        A torch.device (`tensor.device`) gives the device that natively owns it; one without an
        index means the current device of its type, as in torch (`torch.cuda.set_device(r)` then
        `torch.device("cuda")` is device r)."""
        state = self._discovered()
        loaded = sys.modules.get("torch")  # a torch.device exists only once torch is imported
        if loaded is not None and isinstance(device_id, loaded.device):
            if not any(t.type == device_id.type for t in state.by_torch):
                # before asking torch for a current device, which a build without it refuses raw
                raise state.not_found(str(device_id))
            return self._native_device(_indexed(loaded, device_id))
        if isinstance(device_id, Device):
            if state.by_id.get(device_id.id) is not device_id:
                raise InvalidArgumentError(
                    f"device {device_id.id} belongs to another HardwareAbstractionLayer; "
                    f"pass this one's, hal.device({device_id.id!r})"
                )
            return device_id
        if not isinstance(device_id, str):
            seen = f"{type(device_id).__name__} {device_id!r}"
            raise InvalidArgumentError(
                f"a device must be a Device, a torch.device or an id such as 'cuda:0', got {seen}"
            )
        key = device_id.strip()
        dev = state.by_id.get(key) or state.by_id.get(key + ":0")
        if dev is None and key == "cpu:0":
            dev = state.by_id.get("cpu")
        if dev is None:
            raise state.not_found(device_id)
        return dev

    def device_for_tensor(self, tensor: torch.Tensor) -> Device:
        """The HAL device a tensor is on: the active `use()` device if it matches, else by torch device."""
        tdev = tensor.device
        active = _active.get()
        if active is not None and active[0] is self and active[1].torch_device.type == tdev.type:
            return active[1]
        return self._native_device(tdev)

    def _native_device(self, tdev: torch.device) -> Device:
        """The device that natively owns a torch device, whatever `use()` block is active."""
        state = self._state or self._discovered()
        dev = state.by_torch.get(tdev)
        if dev is None:
            raise state.not_found(str(tdev))
        return dev

    def dispatch(self, op: str, *args: Any) -> Any:
        """Run registry op `op` on the device of its first argument (or the `use()` device).

        What `torchhal.ops` calls: the device is looked up only for argument layouts the registry
        has not seen under the same `use()` override."""
        if self._state is None:
            self._discovered()
        active = active_use()
        route = active[1] if active is not None and active[0] is self else None
        return self._kernels.dispatch(op, route, self._locator, *args)

    def dispatcher(self, op: str, *, seen_only: bool = False) -> Callable[..., Any]:
        """`dispatch` bound to `op` with no route (with `seen_only`, the registry's
        `dispatch_seen`): it runs on the device that natively owns the first tensor's torch
        device, even inside this HAL's `use()` blocks, whose calls are the caller's to route to
        `dispatch` (as `torchhal.ops` does). What `torchhal.ops` calls on the default HAL: a
        C-level partial of the registry's method, so a call skips this HAL's frame and its
        `use()` lookup."""
        self._discovered()
        if seen_only:
            return functools.partial(self._kernels.dispatch_seen, op, None)
        return functools.partial(
            self._kernels.dispatch, op, None, functools.partial(self._locate, native=True)
        )

    def _locate(self, op: str, first: Any, native: bool = False) -> Device:
        """The device for an op's first argument: `device_for_tensor`'s, or with `native` the one
        that owns its torch device (what a call with no route must run on)."""
        try:
            return self._native_device(first.device) if native else self.device_for_tensor(first)
        except AttributeError:
            raise InvalidArgumentError(
                f"{op}: the first argument must be a torch.Tensor, got {type(first).__name__}"
            ) from None
        except DeviceNotFoundError as err:  # its message names neither the op nor the tensor
            raise UnsupportedError(
                f"{op}: the first argument is on {err.requested}, which no adapter of this HAL drives; "
                f"devices found: {', '.join(err.available) or 'none'}"
            ) from None

    @contextlib.contextmanager
    def use(self, device: Device | str) -> Iterator[Device]:
        """Route ops on tensors of this device's torch type to `device` (e.g. a simulated ASIC)."""
        dev = self.device(device)
        with resumed_use((self, dev)):
            yield dev

    def choose_device(self, requirements: DeviceRequirements | None = None) -> DeviceChoice:
        """Rank every device against `requirements`, with the reasons for each verdict."""
        if requirements is not None and not isinstance(requirements, DeviceRequirements):
            seen = f"{type(requirements).__name__} {requirements!r}"
            raise InvalidArgumentError(f"requirements must be a DeviceRequirements, got {seen}")
        req = requirements or DeviceRequirements()
        eligible: list[tuple[tuple[Any, ...], Ranked]] = []
        rejected: list[Ranked] = []
        for dev in self.devices():
            failures = req.failures(dev.capabilities)
            if failures:
                rejected.append(Ranked(dev, False, tuple(failures)))
                continue
            key, reasons = _rank_key(dev)
            collective = req.collective_match(dev.capabilities)
            if collective is not None:  # says how `rccl` was met by an AMD device's `nccl`
                reasons = (*reasons, collective)
            eligible.append((key, Ranked(dev, True, reasons)))
        if not eligible:
            raise NoDeviceMatchesError(req, {r.device.id: r.reasons for r in rejected})
        eligible.sort(key=lambda item: item[0])
        ranking = tuple(r for _, r in eligible) + tuple(rejected)
        choice = DeviceChoice(ranking[0].device, ranking)
        log.info("device chosen", device=choice.device.id, explanation=choice.explain())
        return choice

    def best_device(self, requirements: DeviceRequirements | None = None) -> Device:
        return self.choose_device(requirements).device

    def topology(self) -> Topology:
        topo = Topology()
        state = self._discovered()
        for adapter in state.adapters:
            if any(d.adapter is adapter for d in state.devices):
                try:
                    topo = topo.merged(adapter.topology())
                except Exception as exc:  # isolated like every adapter hook: `info` still reports
                    telemetry.count("torchhal.topology.failures", adapter=adapter.name)
                    log.warning(
                        "adapter topology failed; its links are left out",
                        adapter=adapter.name,
                        error=f"{type(exc).__name__}: {exc}",
                    )
        return topo

    def communicator(self, **kwargs: Any) -> Communicator:
        """A Communicator over torch.distributed for this process; see `collectives.Communicator`."""
        from torchhal.hal_core.collectives import Communicator

        return Communicator.create(self, **kwargs)

    def profile(self, device: Device | str, *, refresh: bool = False) -> MeasuredProfile:
        """Measured profile of a device, from the on-disk cache unless `refresh`. One that lost a
        figure to out of memory is returned but not kept: the next call measures again."""
        from torchhal.hal_core.profile import measure_or_load, passing_losses

        dev = self.device(device)
        if refresh or dev.id not in self._profiles:
            profile = measure_or_load(self, dev, refresh=refresh)
            if passing_losses(profile):
                return profile
            self._profiles[dev.id] = profile
        return self._profiles[dev.id]

    def report(self) -> dict[str, Any]:
        """Everything discovery found, as JSON-able data (`torchhal info --json`)."""
        import torch

        from torchhal import __version__

        state = self._discovered()
        return {
            "torchhal_version": __version__,
            "torch_version": torch.__version__,
            "hal_api_version": HAL_API_VERSION,
            "adapters": [
                {
                    "name": a.name,
                    "vendor": a.vendor,
                    "priority": a.priority,
                    "api_versions": list(a.api_versions),
                }
                for a in state.adapters
            ],
            "devices": [{"id": d.id, **d.capabilities.model_dump(mode="json")} for d in state.devices],
            "diagnostics": [d.as_dict() for d in state.diagnostics],
            "topology": self.topology().model_dump(mode="json"),
            "kernels": {
                op: [
                    {"name": c.name, "provider": c.provider, "priority": _json_number(c.priority)}
                    for c in self.kernels.candidates(op)
                ]
                for op in self.kernels.ops()
            },
            "kernel_fallbacks": dict(self.kernels.fallback_counts),
            "kernel_guards": guard_implementation(),  # the dispatch memo's: torchhal_speedups or python
            "profiles": {k: p.model_dump(mode="json") for k, p in self._profiles.items()},
        }


def _json_number(value: float) -> float | str:
    """value, or its name where JSON has no number for it (the reference's priority is -inf, and
    `-Infinity`, which Python's json writes, is refused by JSON.parse and other strict parsers)."""
    return value if math.isfinite(value) else str(value)


def _indexed(loaded: Any, tdev: torch.device) -> torch.device:
    """`tdev` with the index torch means by it (`loaded` is the torch module): the host has one
    (`cpu`, also `cpu:0`), and an accelerator without an index is its type's current device."""
    if tdev.type == "cpu":
        host: torch.device = loaded.device("cpu")
        return host
    if tdev.index is not None:
        return tdev
    try:
        current = loaded.get_device_module(tdev.type).current_device()
    except (AttributeError, RuntimeError) as exc:
        raise InvalidArgumentError(
            f"torch.device({tdev.type!r}) has no index and torch keeps no current {tdev.type} device "
            f"({exc}); give one, e.g. torch.device({tdev.type!r}, 0)"
        ) from None
    indexed: torch.device = loaded.device(tdev.type, current)
    return indexed


def _rank_key(dev: Device) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    """Real before simulated, then adapter priority, declared peak, memory, then device type and
    index (numeric: `cuda:2` before `cuda:10`), then id."""
    caps = dev.capabilities
    peak, basis = 0.0, "no declared peak"
    if caps.declared_peaks is not None:
        for dtype in (DType.BF16, DType.FP32):
            if dtype in caps.declared_peaks.tflops:
                peak = caps.declared_peaks.tflops[dtype]
                basis = f"declared peak {dtype.value} {peak:g} TFLOP/s ({caps.declared_peaks.source})"
                break
    reasons = (
        "simulated device" if caps.simulated else "real device",
        f"adapter {caps.adapter!r} priority {dev.adapter.priority}",
        basis,
        f"memory {caps.memory_text}" if caps.memory_bytes else caps.memory_text,
    )
    key = (
        caps.simulated,
        -dev.adapter.priority,
        -peak,
        -caps.memory_bytes,
        caps.device_type,
        caps.index,
        dev.id,
    )
    return key, reasons
