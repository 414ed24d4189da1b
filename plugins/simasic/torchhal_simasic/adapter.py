"""SimASICAdapter: the simulated systolic-array accelerator as a torchhal vendor adapter.

Devices are `simasic:0`, `simasic:1`, ... Their tensors live in host memory (device type
`cpu`): numerics are torch's on the CPU, while time and memory come from the cost model and
the per-device ledger. The HAL routes CPU tensors to a simasic device inside `hal.use(...)`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from itertools import combinations
from typing import TYPE_CHECKING, Any

from torchhal.hal_core import (
    DeclaredPeaks,
    DeviceCapabilities,
    DeviceNotFoundError,
    DType,
    Feature,
    HealthReport,
    HealthStatus,
    InvalidArgumentError,
    KernelRegistry,
    Link,
    LinkType,
    MemoryInfo,
    ProbeResult,
    Topology,
    UnsupportedError,
    VendorAdapter,
    telemetry,
    torch_flags,
)

from torchhal_simasic import __version__
from torchhal_simasic.cost import collective_time_s, copy_time_s, transfer_time_s
from torchhal_simasic.kernels import register_simasic_kernels
from torchhal_simasic.spec import SimASICSpec, spec_from_env
from torchhal_simasic.state import DeviceState, SimulatedTimer

if TYPE_CHECKING:
    import torch

log = telemetry.get_logger("torchhal_simasic.adapter")


class SimASICAdapter(VendorAdapter):
    """One simulated machine: `spec.devices` identical arrays, each with its own clock and ledger.

    Without an explicit spec, the spec comes from TORCHHAL_SIMASIC_SPEC and
    TORCHHAL_SIMASIC_DEVICES, read on first use (so constructing the adapter is free).
    """

    name = "simasic"
    vendor = "simulated"
    priority = 10
    namespace = "simasic"

    def __init__(self, spec: SimASICSpec | None = None) -> None:
        self._spec = spec
        self._states: tuple[DeviceState, ...] | None = None
        self._lock = threading.Lock()
        self._warned_no_link = False  # collectives uncharged: said once per adapter
        self._warned_unlinked_transfer = False  # host transfers without the link's time: said once

    @property
    def spec(self) -> SimASICSpec:
        with self._lock:
            if self._spec is None:
                self._spec = spec_from_env()
            return self._spec

    @property
    def states(self) -> tuple[DeviceState, ...]:
        """Every device's clock and ledger, made once so that rediscovery keeps them."""
        spec = self.spec
        with self._lock:
            if self._states is None:
                self._states = tuple(
                    DeviceState.create(self.device_id(i, "cpu"), spec.memory_bytes)
                    for i in range(spec.devices)
                )
            return self._states

    def state(self, index: int) -> DeviceState:
        states = self.states
        if not 0 <= index < len(states):
            raise DeviceNotFoundError(self.device_id(index, "cpu"), (s.device for s in states))
        return states[index]

    def probe(self) -> ProbeResult:
        """A simulator is present wherever its spec is valid; a bad spec raises ConfigurationError."""
        spec = self.spec
        return ProbeResult(
            available=True,
            # the count is the loader's to say ("1 device(s); ..."): it was said twice
            reason=f"simulated ASIC spec {spec.name!r}: time and memory modelled",
            runtime_version=__version__,
        )

    def discover(self) -> Sequence[DeviceCapabilities]:
        spec = self.spec
        peaks = DeclaredPeaks(
            source=f"simulated spec {spec.name}",
            tflops={dtype: spec.peak_flops_per_s(dtype) / 1e12 for dtype in spec.macs_per_cell_per_cycle},
            memory_bandwidth_gbps=spec.memory_bandwidth_bytes_per_s / 1e9,
        )
        return [
            DeviceCapabilities(
                vendor=self.vendor,
                adapter=self.name,
                device_type="cpu",  # tensors live in host memory; see the module docstring
                index=state_index,
                name=f"Simulated ASIC {spec.name}",
                arch=f"systolic-{spec.rows}x{spec.cols}",
                compute_units=1,  # one systolic array per device
                simd_width=spec.cols,
                memory_bytes=spec.memory_bytes,
                dtypes=spec.dtypes,
                features=frozenset({Feature.SIMULATED, Feature.DEVICE_EVENTS}),
                collective_backends=("gloo",),
                kernel_backends=("aten",),  # numerics are ATen's, on the host
                declared_peaks=peaks,
                uuid=f"simasic-{spec.fingerprint()}-{state_index}",
                driver_version=f"torchhal-simasic {__version__}",
            )
            for state_index in range(len(self.states))
        ]

    def synchronize(self, index: int) -> None:
        """Nothing to wait for: every simulated op completes, and charges its time, before it returns."""
        self.state(index)

    def timer(self, index: int) -> SimulatedTimer:
        state = self.state(index)
        return SimulatedTimer(state.clock, state.device)

    def memory_info(self, index: int) -> MemoryInfo:
        ledger = self.state(index).ledger
        used = ledger.used
        return MemoryInfo(
            total_bytes=ledger.capacity, free_bytes=ledger.capacity - used, used_bytes=used, simulated=True
        )

    def charge_collective(self, index: int, collective: str, nbytes: int, world_size: int) -> None:
        """Advance the clock by the collective's transfer over the declared host links. A spec
        without `host_link_bytes_per_s` has no transfer cost: said once, counted every time."""
        state = self.state(index)
        seconds = collective_time_s(self.spec, collective, nbytes, world_size)
        if seconds is None:
            if not self._warned_no_link:
                self._warned_no_link = True
                log.warning(
                    "simulated collectives cost no time: the spec declares no host_link_bytes_per_s",
                    spec=self.spec.name,
                    device=state.device,
                )
            telemetry.count("torchhal.simasic.uncharged_collectives", collective=collective)
            return
        state.clock.advance(seconds)

    def health(self, index: int) -> HealthReport:
        self.state(index)
        return HealthReport(
            status=HealthStatus.OK,
            messages=("simulated device: no sensors to read; it cannot overheat or fail",),
        )

    def topology(self) -> Topology:
        spec = self.spec
        ids = tuple(state.device for state in self.states)
        bandwidth = None if spec.host_link_bytes_per_s is None else spec.host_link_bytes_per_s / 1e9
        links = tuple(
            Link(
                a=a,
                b=b,
                type=LinkType.HOST,
                bandwidth_gbps=bandwidth,
                source=f"declared by simulated spec {spec.name}",
            )
            for a, b in combinations(ids, 2)
        )
        return Topology(devices=ids, links=links)

    def collective_backend(self) -> str:
        return "gloo"

    def numerics_settings(self) -> dict[str, Any]:
        """torch's oneDNN switches (the simulated device computes on the host CPU with torch, so these
        change its numbers as they change the CPU's)."""
        return torch_flags.backend_flags(torch_flags.ONEDNN_FLAGS, torch_flags.ONEDNN_LEGACY_FLAGS)

    def register_kernels(self, registry: KernelRegistry) -> None:
        register_simasic_kernels(registry, self.name, self.spec, self.states)

    def allocate(
        self, index: int, torch_device: torch.device, shape: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """Host memory, charged to the device's ledger before it is allocated (an over-capacity
        request fails without touching host memory) and credited back when torch frees it. The
        spec's dtypes are the formats the device computes in; integer and bool tensors (labels,
        indices, masks) are stored whatever they are, as an accelerator that computes in bf16 or
        int8 still holds its batch's int64 targets."""
        import torch

        ledger = self.state(index).ledger
        if torch_device.type != "cpu":
            raise InvalidArgumentError(
                f"{ledger.device}: tensors live in host memory (cpu), got {torch_device}"
            )
        declared = DType.from_torch(dtype)
        stored = declared is None and not (dtype.is_floating_point or dtype.is_complex)
        if not stored and declared not in self.spec.dtypes:
            supported = sorted(d.value for d in self.spec.dtypes)
            raise UnsupportedError(
                f"allocation on {ledger.device}: dtype {dtype} is not in the spec's dtypes {supported}"
                + ("" if declared is not None else ", nor integer or bool storage")
            )
        if not all(isinstance(size, int) and size >= 0 for size in shape):
            raise InvalidArgumentError(
                f"allocation on {ledger.device}: sizes must be integers >= 0, got {tuple(shape)}"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        ledger.charge(nbytes)
        try:
            tensor = torch.empty(tuple(shape), dtype=dtype, device=torch_device)
        except BaseException:
            ledger.release(nbytes)
            raise
        ledger.release_with(tensor, nbytes)
        return tensor

    def copy_(self, index: int, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Copy and charge the clock. Never converts dtype or shape.

        Where both tensors are on this device's ledger (made by `Device.empty`, an op or
        `to_device` here, or views of those), a copy within device memory: 2 × bytes / memory
        bandwidth (read and write) plus the launch overhead (`cost.copy_time_s`). Otherwise the
        bytes cross the host link: an upload (`Device.to_device` copies a host tensor this way)
        or a download, bytes / min(host link, memory bandwidth) plus the launch overhead
        (`cost.transfer_time_s`). A spec without `host_link_bytes_per_s` charges such a
        transfer only its device-memory side: said once per adapter, counted each time
        (`torchhal.simasic.unlinked_transfers`)."""
        state = self.state(index)
        if dst.dtype != src.dtype or dst.shape != src.shape:
            raise InvalidArgumentError(
                f"copy on {state.device}: dst and src must have the same dtype and shape, got "
                f"dst {dst.dtype} {tuple(dst.shape)} and src {src.dtype} {tuple(src.shape)}"
            )
        nbytes = src.numel() * src.element_size()
        src_here, dst_here = state.ledger.holds(src), state.ledger.holds(dst)
        if src_here and dst_here:
            seconds = copy_time_s(self.spec, nbytes)
        else:
            seconds = transfer_time_s(self.spec, nbytes)
            if self.spec.host_link_bytes_per_s is None:
                self._say_unlinked_transfer(state.device, "download" if src_here else "upload")
        dst.copy_(src)
        state.clock.advance(seconds)
        return dst

    def _say_unlinked_transfer(self, device: str, direction: str) -> None:
        telemetry.count("torchhal.simasic.unlinked_transfers", device=device, direction=direction)
        if not self._warned_unlinked_transfer:
            self._warned_unlinked_transfer = True
            log.warning(
                "simulated host transfers are charged only their device-memory side: the spec "
                "declares no host_link_bytes_per_s",
                spec=self.spec.name,
                device=device,
                direction=direction,
            )
