"""The built-in CPU adapter: always present, one device, gloo collectives."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence

from torchhal.hal_core.adapter import VendorAdapter
from torchhal.hal_core.capabilities import (
    DeviceCapabilities,
    DType,
    Feature,
    HealthReport,
    HealthStatus,
    MemoryInfo,
    ProbeResult,
    Topology,
)


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
                memory_bytes=_physical_memory(),
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
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(
            total_bytes=_physical_memory(),
            free_bytes=os.sysconf("SC_AVPHYS_PAGES") * page,
            used_bytes=_resident_bytes(page),
        )

    def health(self, index: int) -> HealthReport:
        load1, _, _ = os.getloadavg()
        cores = os.cpu_count() or 1
        return HealthReport(
            status=HealthStatus.OK,
            utilization_pct=min(100.0, 100.0 * load1 / cores),
            messages=(f"1-minute load average {load1:.2f} on {cores} cores",),
        )

    def topology(self) -> Topology:
        return Topology(devices=("cpu",))

    def collective_backend(self) -> str:
        return "gloo"


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _resident_bytes(page: int) -> int:
    """This process's resident set, from /proc (Linux); 0 where /proc is absent."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page
    except OSError:
        return 0


def _triton_interpreter() -> bool:
    """Triton runs on the CPU only through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
