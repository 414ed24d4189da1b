"""VendorAdapter: the contract every vendor plugin implements.

An adapter speaks for one vendor runtime. It reads that runtime only through its own probe
object, so tests can hand it recorded facts, and it reports absent hardware as absent.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from torchhal.hal_core.capabilities import (
    DeviceCapabilities,
    HealthReport,
    MemoryInfo,
    ProbeResult,
    Topology,
)

if TYPE_CHECKING:
    import torch

    from torchhal.hal_core.kernels import KernelRegistry

HAL_API_VERSION = 1
"""Major version of the adapter contract. An adapter lists the majors it supports."""


class DeviceTimer(Protocol):
    """Marks points in a device's timeline; `elapsed_ms` waits for both marks to complete."""

    def mark(self) -> object: ...

    def elapsed_ms(self, start: object, end: object) -> float: ...


class HostTimer:
    """Synchronize the device, then read the host clock: for devices without timing events."""

    def __init__(self, synchronize: Callable[[], None]) -> None:
        self._synchronize = synchronize

    def mark(self) -> object:
        self._synchronize()
        return time.perf_counter_ns()

    def elapsed_ms(self, start: object, end: object) -> float:
        assert isinstance(start, int) and isinstance(end, int)
        return (end - start) / 1e6


class EventTimer:
    """Timing events of a torch device runtime (`torch.cuda.Event`, `torch.xpu.Event`, ...):
    device time with no host synchronisation between marks. `record()` returns a recorded event."""

    def __init__(self, record: Callable[[], Any]) -> None:
        self._record = record

    def mark(self) -> object:
        return self._record()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        end.synchronize()
        return float(start.elapsed_time(end))


class VendorAdapter(abc.ABC):
    """One vendor runtime. Subclasses set the class attributes and implement the methods.

    `probe()` must be cheap and must not initialise the runtime beyond asking whether it is
    there; everything else is called only after `probe()` said available.
    """

    name: ClassVar[str]  # unique adapter name, also the TORCHHAL_PLUGINS allowlist entry
    vendor: ClassVar[str]
    priority: ClassVar[int] = 0  # higher first when several adapters are present
    api_versions: ClassVar[tuple[int, int]] = (1, 1)  # inclusive range of HAL_API_VERSION
    namespace: ClassVar[str | None] = None  # device-id prefix; None means the torch device type

    @abc.abstractmethod
    def probe(self) -> ProbeResult:
        """Is this vendor's runtime present? Cheap, side-effect free."""

    @abc.abstractmethod
    def discover(self) -> Sequence[DeviceCapabilities]:
        """Every device this runtime sees, with its declared capabilities."""

    @abc.abstractmethod
    def synchronize(self, index: int) -> None:
        """Wait for all work queued on the device."""

    @abc.abstractmethod
    def memory_info(self, index: int) -> MemoryInfo: ...

    @abc.abstractmethod
    def health(self, index: int) -> HealthReport: ...

    @abc.abstractmethod
    def topology(self) -> Topology:
        """Links between this adapter's devices (ids as the HAL names them)."""

    @abc.abstractmethod
    def collective_backend(self) -> str:
        """The torch.distributed backend for this runtime's devices (nccl, xccl, gloo)."""

    def numerics_settings(self) -> dict[str, Any]:
        """The runtime's process-wide switches that change results or timings on its devices
        (TF32, reduced-precision reductions, autotuning), read from flags without initialising
        anything: an evaluation's fingerprint records them. The default: none of its own
        (`hal_core.torch_flags` reads torch's)."""
        return {}

    def register_kernels(self, registry: KernelRegistry) -> None:  # noqa: B027
        """Add vendor kernel candidates. Adapters without vendor kernels add none."""

    def device_id(self, index: int, device_type: str) -> str:
        """The HAL id of a device: `cuda:0`, `simasic:1`; the single CPU is plain `cpu`."""
        return f"{self.namespace or device_type}:{index}"

    def timer(self, index: int) -> DeviceTimer:
        """Device-side timer. The default synchronizes and reads the host clock."""
        return HostTimer(lambda: self.synchronize(index))

    def capturing(self, index: int) -> bool:
        """Whether device `index`'s current stream is capturing a graph: measured selection then
        times nothing (a synchronisation would invalidate the capture). The default: never."""
        return False

    def graph_replay(self, index: int, work: Callable[[], object]) -> Callable[[], None]:
        """The replay of `work`'s device work captured once as a graph: an adapter that declares
        `Feature.GRAPHS` implements it (measured selection times replays under
        `TORCHHAL_SELECTION_TIMING=graph`). The default captures nothing."""
        raise NotImplementedError(f"adapter {self.name!r} captures no graphs")

    def allocate(
        self, index: int, torch_device: torch.device, shape: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """Uninitialised memory on the device. Adapters that account memory override this."""
        import torch

        return torch.empty(tuple(shape), dtype=dtype, device=torch_device)

    def copy_(self, index: int, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Copy `src` into `dst` on the device (used to measure copy bandwidth)."""
        return dst.copy_(src)

    def charge_collective(self, index: int, collective: str, nbytes: int, world_size: int) -> None:  # noqa: B027
        """Account a finished collective (`all_reduce`, ..., `barrier`) whose buffer on this rank
        held `nbytes`, over `world_size` ranks. Real devices spent real time and do nothing here;
        a simulated device advances its clock by its model of the transfer. The Communicator
        calls it only for simulated devices."""

    def supports_api(self, version: int = HAL_API_VERSION) -> bool:
        low, high = self.api_versions
        return low <= version <= high


def attribute_problems(adapter: object) -> list[tuple[str, str]]:
    """What is wrong with an adapter's class attributes, as (attribute, problem) pairs; empty when
    nothing is. One set of rules for the plugin loader, which refuses such an adapter, and the
    conformance kit, which fails it: a str priority crashed the sort of every adapter, NaN made the
    order arbitrary, a bool or float API range passed as ints."""
    if not isinstance(adapter, VendorAdapter):
        return [("adapter", f"{adapter!r} is not a VendorAdapter")]
    problems = []
    name = getattr(adapter, "name", None)
    if not isinstance(name, str) or not name or any(ch.isspace() or ch == "," for ch in name):
        rule = "name must be a non-empty string without spaces or commas (a TORCHHAL_PLUGINS entry)"
        problems.append(("name", f"{rule}, got {name!r}"))
    vendor = getattr(adapter, "vendor", None)
    if not isinstance(vendor, str) or not vendor.strip():
        problems.append(("vendor", f"vendor must be a non-empty string, got {vendor!r}"))
    priority = getattr(adapter, "priority", None)
    if not _is_int(priority):
        problems.append(("priority", f"priority must be an int, got {priority!r}"))
    versions = getattr(adapter, "api_versions", None)
    if not (
        isinstance(versions, tuple)
        and len(versions) == 2
        and all(_is_int(v) for v in versions)
        and versions[0] <= versions[1]
    ):
        rule = "api_versions must be an inclusive (low, high) tuple of ints"
        problems.append(("api_versions", f"{rule}, got {versions!r}"))
    elif not versions[0] <= HAL_API_VERSION <= versions[1]:
        problems.append(
            (
                "api_versions",
                f"api_versions {versions} does not cover this torchhal's HAL API version {HAL_API_VERSION}",
            )
        )
    namespace = getattr(adapter, "namespace", None)
    if namespace is not None and (not isinstance(namespace, str) or not namespace or ":" in namespace):
        rule = "namespace must be None or a non-empty string without ':'"
        problems.append(("namespace", f"{rule}, got {namespace!r}"))
    return problems


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ProbedAdapter(VendorAdapter):
    """An adapter whose device actions are its runtime probe's (`runtime_probe`: a `LiveProbe`
    over a torch device module, or a `RecordedProbe`, which refuses them): synchronisation,
    timing events, and graph capture. The vendor adapters share these rather than each
    forwarding them."""

    runtime_probe: Any

    def synchronize(self, index: int) -> None:
        self.runtime_probe.synchronize(index)

    def timer(self, index: int) -> DeviceTimer:
        return EventTimer(lambda: self.runtime_probe.record_event(index))

    def capturing(self, index: int) -> bool:
        return bool(self.runtime_probe.capturing(index))

    def graph_replay(self, index: int, work: Callable[[], object]) -> Callable[[], None]:
        return self.runtime_probe.graph_replay(index, work)  # type: ignore[no-any-return]
