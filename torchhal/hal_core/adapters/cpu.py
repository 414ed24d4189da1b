"""The built-in CPU adapter: always present, one device, gloo collectives."""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Sequence
from typing import Any

from torchhal.hal_core import telemetry, torch_flags
from torchhal.hal_core.adapter import VendorAdapter
from torchhal.hal_core.capabilities import (
    DeviceCapabilities,
    DType,
    Feature,
    HealthReport,
    HealthStatus,
    MemoryFigure,
    MemoryInfo,
    ProbeResult,
    Topology,
)

log = telemetry.get_logger("torchhal.cpu")


class CPUAdapter(VendorAdapter):
    name = "cpu"
    vendor = "cpu"
    priority = 0  # every accelerator ranks above the host

    def probe(self) -> ProbeResult:
        return ProbeResult(available=True, reason="the host CPU is always present")

    def discover(self) -> Sequence[DeviceCapabilities]:
        import torch

        isa = torch.backends.cpu.get_cpu_capability()  # e.g. AVX2, AVX512, DEFAULT
        lanes = {"AVX512": 16, "AVX2": 8}.get(isa, 4)  # fp32 lanes of the widest vector unit
        features = {Feature.TRITON} if _triton_interpreter() else set()
        return [
            DeviceCapabilities(
                vendor=self.vendor,
                adapter=self.name,
                device_type="cpu",
                index=0,
                name=f"{platform.machine()} CPU ({isa})",
                arch=platform.machine(),
                compute_units=torch.get_num_threads(),
                simd_width=lanes,
                memory_bytes=_physical_memory() or 0,  # 0: not readable here, logged
                dtypes=frozenset({DType.FP64, DType.FP32, DType.BF16, DType.FP16, DType.INT8}),
                features=frozenset(features),
                collective_backends=("gloo",),
                kernel_backends=("aten",) + (("triton-interpreter",) if features else ()),
            )
        ]

    def device_id(self, index: int, device_type: str) -> str:
        return "cpu"

    def synchronize(self, index: int) -> None:
        """CPU ops complete before they return."""

    def memory_info(self, index: int) -> MemoryInfo:
        """A figure this platform does not give is named in `unknown` (and 0), logged once."""
        page, available = _sysconf("SC_PAGE_SIZE"), _sysconf("SC_AVPHYS_PAGES")
        figures: dict[MemoryFigure, int | None] = {
            "total": _physical_memory(),
            "free": None if available is None or page is None else available * page,
            "used": _resident_bytes(page),
        }
        return MemoryInfo(
            total_bytes=figures["total"] or 0,
            free_bytes=figures["free"] or 0,
            used_bytes=figures["used"] or 0,
            unknown=frozenset(name for name, value in figures.items() if value is None),
        )

    def health(self, index: int) -> HealthReport:
        """OK (the host runs this code) with its load as utilization, where it has one."""
        cores = os.cpu_count() or 1
        load1 = _load_average()
        if load1 is None:
            return HealthReport(
                status=HealthStatus.OK, messages=("utilization unknown: no load average on this platform",)
            )
        return HealthReport(
            status=HealthStatus.OK,
            utilization_pct=min(100.0, 100.0 * load1 / cores),
            messages=(f"1-minute load average {load1:.2f} on {cores} cores",),
        )

    def topology(self) -> Topology:
        return Topology(devices=("cpu",))

    def collective_backend(self) -> str:
        return "gloo"

    def numerics_settings(self) -> dict[str, Any]:
        """torch's oneDNN switches (the CPU's matmuls and convolutions)."""
        return torch_flags.backend_flags(torch_flags.ONEDNN_FLAGS, torch_flags.ONEDNN_LEGACY_FLAGS)


def _physical_memory() -> int | None:
    """The host's memory in bytes, or None where this platform does not say (Windows)."""
    page, pages = _sysconf("SC_PAGE_SIZE"), _sysconf("SC_PHYS_PAGES")
    return None if page is None or pages is None else page * pages


def _sysconf(name: str) -> int | None:
    """os.sysconf(name), or None where this platform has no such figure: Windows has no
    os.sysconf (it failed the CPU adapter's discovery there), macOS no SC_AVPHYS_PAGES."""
    sysconf = getattr(os, "sysconf", None)
    if sysconf is None or name not in getattr(os, "sysconf_names", {}):
        _unreadable(name, "os.sysconf is absent" if sysconf is None else "os.sysconf does not know it")
        return None
    value: int = sysconf(name)
    return value


def _load_average() -> float | None:
    """The 1-minute load average, or None: Windows has no os.getloadavg, and where it cannot
    be obtained it raises OSError."""
    getloadavg = getattr(os, "getloadavg", None)
    if getloadavg is None:
        _unreadable("load average", "os.getloadavg is absent")
        return None
    try:
        load1: float = getloadavg()[0]
    except OSError as exc:
        _unreadable("load average", str(exc))
        return None
    return load1


@functools.cache
def _unreadable(figure: str, why: str) -> None:
    """Say, once per process and figure, that a host figure is reported as unknown."""
    telemetry.count("torchhal.cpu.unreadable", figure=figure)
    log.warning("host figure not readable on this platform; reported as unknown", figure=figure, why=why)


def _resident_bytes(page: int | None) -> int | None:
    """This process's resident set, from /proc (Linux); None where /proc is absent (macOS)."""
    if page is None:
        return None
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page
    except OSError as exc:
        _unreadable("resident set", str(exc))
        return None


def _triton_interpreter() -> bool:
    """Triton runs on the CPU only through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
