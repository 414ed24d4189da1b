"""IntelAdapter: translates what torch.xpu reports into torchhal's terms.

All reading goes through one probe object (`XpuProbe` live, `RecordedXpuProbe` in tests);
this module holds only the translation: device names to Xe architectures, properties to
dtypes, Xe cores and sub-group width. torch.xpu reports no health readings and no link types,
so health is UNKNOWN and the topology lists devices without links, each said so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchhal.hal_core import (
    DeviceCapabilities,
    DType,
    Feature,
    HealthReport,
    HealthStatus,
    MemoryInfo,
    ProbedAdapter,
    ProbeResult,
    Topology,
    telemetry,
)

from torchhal_intel.probe import XpuProbe

log = telemetry.get_logger("torchhal.intel")

# Product lines by the name the driver reports, to the Xe architecture they are built on.
ARCHITECTURES = (
    ("Data Center GPU Max", "xe-hpc"),  # Ponte Vecchio
    ("Data Center GPU Flex", "xe-hpg"),  # ATS-M
    ("Arc(TM) Pro A", "xe-hpg"),  # Alchemist
    ("Arc(TM) A", "xe-hpg"),
    ("Arc(TM) Pro B", "xe2-hpg"),  # Battlemage
    ("Arc(TM) B", "xe2-hpg"),
)
MATRIX_ENGINES = frozenset({"xe-hpc", "xe-hpg", "xe2-hpg"})  # XMX units, reached through DPAS
NO_HEALTH = "torch.xpu reports no temperature or RAS counters; read them with xpu-smi (Intel XPU Manager)"


def architecture(props: dict[str, Any]) -> str:
    """The Xe architecture of a device, from its name; the PCI device id where the name is unknown."""
    for marker, arch in ARCHITECTURES:
        if marker in props["name"]:
            return arch
    device_id = props.get("device_id")
    return f"intel-gpu-{device_id:#06x}" if device_id is not None else "intel-gpu"


class IntelAdapter(ProbedAdapter):
    name = "intel"
    vendor = "intel"
    priority = 90

    def __init__(self, probe: Any = None) -> None:
        """`probe`: anything with XpuProbe's methods; the live runtime by default. No device work."""
        self.runtime_probe = probe if probe is not None else XpuProbe()

    def probe(self) -> ProbeResult:
        build = self.runtime_probe.runtime()
        if not build["xpu"]:
            return ProbeResult(
                available=False,
                reason=f"torch {build['torch']} was built without XPU support (torch.version.xpu is None): "
                "install an XPU build of torch",
            )
        if not self.runtime_probe.available():
            return ProbeResult(
                available=False,
                reason=f"torch {build['torch']} (XPU {build['xpu']}) sees no GPU: "
                "torch.xpu.is_available() is False (check the driver with sycl-ls, and ZE_AFFINITY_MASK)",
                runtime_version=build["xpu"],
            )
        return ProbeResult(available=True, reason=f"XPU runtime {build['xpu']}", runtime_version=build["xpu"])

    def discover(self) -> Sequence[DeviceCapabilities]:
        count = self.runtime_probe.device_count()
        libraries = self.runtime_probe.libraries()
        return [self._capabilities(i, count, libraries) for i in range(count)]

    def _capabilities(self, index: int, count: int, libraries: dict[str, Any]) -> DeviceCapabilities:
        props = self.runtime_probe.properties(index)
        arch = architecture(props)
        if arch.startswith("intel-gpu"):
            log.info(
                "unknown Intel GPU product line, arch named by PCI device id", name=props["name"], arch=arch
            )
        # DPAS drives the matrix engines; torch.xpu.is_tf32_supported() asks the same property.
        dpas = props.get("has_subgroup_matrix_multiply_accumulate", arch in MATRIX_ENGINES)
        dtypes = {DType.FP32, DType.BF16, DType.INT8}  # bf16: torch computes it on every XPU
        dtypes |= {DType.FP16} if props.get("has_fp16") else set()
        dtypes |= {DType.FP64} if props.get("has_fp64") else set()
        dtypes |= {DType.TF32} if dpas else set()
        peers = any(self.runtime_probe.can_access_peer(index, j) for j in range(count) if j != index)
        features = {Feature.DEVICE_EVENTS}
        features |= {Feature.TENSOR_CORES} if dpas else set()
        features |= {Feature.GRAPHS} if libraries["graphs"] else set()
        features |= {Feature.P2P} if peers else set()
        features |= {Feature.TRITON} if libraries["triton"] else set()
        return DeviceCapabilities(
            vendor=self.vendor,
            adapter=self.name,
            device_type="xpu",
            index=index,
            name=props["name"],
            arch=arch,
            compute_units=props.get("gpu_subslice_count") or props["max_compute_units"],  # Xe cores
            simd_width=max(props["sub_group_sizes"]),
            memory_bytes=props["total_memory"],
            dtypes=frozenset(dtypes),
            features=frozenset(features),
            collective_backends=("xccl", "gloo"),
            kernel_backends=("onednn",) + (("triton",) if libraries["triton"] else ()),
            shared_memory_per_block_bytes=props.get("local_mem_size"),
            l2_cache_bytes=props.get("last_level_cache_size") or None,
            uuid=props.get("uuid"),
            driver_version=props.get("driver_version"),
        )

    def memory_info(self, index: int) -> MemoryInfo:
        memory = self.runtime_probe.memory(index)
        return MemoryInfo(
            total_bytes=memory["total"], free_bytes=memory["free"], used_bytes=memory["allocated"]
        )

    def health(self, index: int) -> HealthReport:
        return HealthReport(status=HealthStatus.UNKNOWN, messages=(NO_HEALTH,))

    def topology(self) -> Topology:
        count = self.runtime_probe.device_count()
        log.debug("no links: torch.xpu reports peer access but not link types", devices=count)
        return Topology(devices=tuple(self.device_id(i, "xpu") for i in range(count)))

    def collective_backend(self) -> str:
        return "xccl"
