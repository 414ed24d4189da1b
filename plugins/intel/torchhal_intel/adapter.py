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
    InvalidArgumentError,
    MemoryInfo,
    ProbedAdapter,
    ProbeResult,
    Topology,
    telemetry,
    torch_flags,
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
# Whether DPAS takes tf32 inputs, as torch reports the driver's OpenCL extension. Xe-HPG's XMX
# (Arc A, Flex) computes fp16/bf16/int8 only, while Xe-HPC's (Max) computes tf32 too; but Max
# drivers leave the extension unreported (False on a Max 1100, torch-xpu-ops and Triton's Intel
# backend record), so the architecture declares it there.
TF32_DPAS = "has_subgroup_matrix_multiply_accumulate_tensor_float32"
TF32_MATRIX_ENGINES = frozenset({"xe-hpc"})
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
        # DPAS drives the matrix engines (torch.xpu.is_tf32_supported() asks only this; see TF32_DPAS)
        dpas = props.get("has_subgroup_matrix_multiply_accumulate", arch in MATRIX_ENGINES)
        dtypes = {DType.FP32, DType.BF16, DType.INT8}  # bf16: torch computes it on every XPU
        dtypes |= {DType.FP16} if props.get("has_fp16") else set()
        dtypes |= {DType.FP64} if props.get("has_fp64") else set()
        dtypes |= {DType.TF32} if dpas and self._tf32_dpas(index, props, arch) else set()
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
            simd_width=self._widest_sub_group(index, props),
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

    def _tf32_dpas(self, index: int, props: dict[str, Any], arch: str) -> bool:
        """Whether the matrix engines take tf32: where torch reports the driver's tf32 DPAS, or the
        architecture has it (TF32_MATRIX_ENGINES); a torch that reports neither way decides by the
        architecture alone, said and counted."""
        reported = props.get(TF32_DPAS)
        if reported is None:
            log.warning(
                f"torch does not report {TF32_DPAS}: tf32 declared from the architecture",
                device=self._id(index),
                arch=arch,
                tf32=arch in TF32_MATRIX_ENGINES,
            )
            telemetry.count("torchhal.intel.tf32_from_architecture", adapter=self.name)
        return bool(reported) or arch in TF32_MATRIX_ENGINES

    def _widest_sub_group(self, index: int, props: dict[str, Any]) -> int:
        """The SIMD width: the widest sub-group size torch reports, or an error naming the device
        and its source where it reports none (a hand-sourced recording may lack the field)."""
        sizes = props.get("sub_group_sizes")
        if not sizes:
            raise InvalidArgumentError(
                f"intel adapter: {self._id(index)} in {_source(self.runtime_probe)} has sub_group_sizes "
                f"{sizes!r}: its simd width is the widest sub-group, so at least one size is needed"
            )
        return int(max(sizes))

    def memory_info(self, index: int) -> MemoryInfo:
        memory = self.runtime_probe.memory(index)
        return MemoryInfo(
            total_bytes=memory["total"], free_bytes=memory["free"], used_bytes=memory["allocated"]
        )

    def health(self, index: int) -> HealthReport:
        return HealthReport(status=HealthStatus.UNKNOWN, messages=(NO_HEALTH,))

    def topology(self) -> Topology:
        """The devices without links: torch.xpu reports peer access but no link types, so devices
        joined by Xe Link (the stacks of one Max card, too) look unconnected; said and counted."""
        count = self.runtime_probe.device_count()
        if count > 1:
            log.warning("no links: torch.xpu reports peer access but not link types", devices=count)
            telemetry.count("torchhal.topology.fallbacks", adapter=self.name, source="none")
        return Topology(devices=tuple(self._id(i) for i in range(count)))

    def _id(self, index: int) -> str:
        return self.device_id(index, "xpu")

    def collective_backend(self) -> str:
        return "xccl"

    def numerics_settings(self) -> dict[str, Any]:
        """torch's oneDNN switches (oneDNN computes XPU matmuls and convolutions)."""
        return torch_flags.backend_flags(torch_flags.ONEDNN_FLAGS, torch_flags.ONEDNN_LEGACY_FLAGS)


def _source(probe: Any) -> str:
    """Where a probe's facts come from, for errors about them: a recording's source, or the runtime."""
    source = getattr(probe, "source", None)
    return "the live XPU runtime" if source is None else f"the recording {source!r}"
