"""NvidiaAdapter: translates what the CUDA runtime and NVML report into torchhal's terms.

All reading goes through one probe object (`CudaProbe` live, `RecordedCudaProbe` in tests);
this module holds only the translation: compute capability to arch, dtypes and features,
NVML readings to health, links to a topology, device names to datasheet peaks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from torchhal.hal_core import (
    DeviceCapabilities,
    DType,
    Feature,
    HealthReport,
    HealthStatus,
    KernelRegistry,
    Link,
    MemoryInfo,
    ProbedAdapter,
    ProbeResult,
    Topology,
    telemetry,
    torch_flags,
)

from torchhal_nvidia import topology
from torchhal_nvidia.datasheets import sku_for
from torchhal_nvidia.probe import CudaProbe

log = telemetry.get_logger("torchhal.nvidia")

WARP = 32  # every NVIDIA architecture so far; used where torch does not report warp_size
TF32_BF16_FROM = (8, 0)  # Ampere
FP8_FROM = (8, 9)  # Ada and Hopper: OCP e4m3/e5m2, not the fnuz variants
TENSOR_CORES_FROM = (7, 0)  # Volta
# ...but not the Turing TU116 and TU117 chips: sm_75 without tensor cores (NVIDIA's GTX 1660 Ti
# launch: "Turing shaders", no RT or Tensor Cores; dedicated FP16 units instead). The compute
# capability cannot tell them from TU102-TU106, so their products are named: GeForce GTX 16xx
# (TU116, TU117), GeForce MX450 and MX550, the T400/T500/T550/T600/T1000/T1200 and Quadro
# T1000/T2000 (all TU117). Word bounds keep "Tesla T4" (TU104, tensor cores) out.
NO_TENSOR_CORES_SM75 = re.compile(r"\b(GTX 16\d\d|MX[45]50|T(400|500|550|600|1000|1200|2000))\b")
NVML_ECC_ENABLED = 1
SDPA_ATTENTION_FROM = (8, 0)  # PyTorch's flash and cuDNN attention kernels need Ampere or newer
CUDNN_ATTENTION_VERSION = 90000  # cuDNN 9: the fused attention graphs SDPA's cuDNN backend builds


class NvidiaAdapter(ProbedAdapter):
    name = "nvidia"
    vendor = "nvidia"
    priority = 100

    def __init__(self, probe: Any = None) -> None:
        """`probe`: anything with CudaProbe's methods; the live runtime by default. No device work."""
        self.runtime_probe = probe if probe is not None else CudaProbe()

    def register_kernels(self, registry: KernelRegistry) -> None:
        """PyTorch SDPA pinned to its flash and cuDNN backends as attention candidates; each device
        offers them through `kernel_backends` (see `_attention_backends`)."""
        from torchhal_nvidia import sdpa

        sdpa.register(registry, provider=self.name)

    def probe(self) -> ProbeResult:
        build = self.runtime_probe.runtime()
        if build["hip"]:
            return ProbeResult(
                available=False,
                reason=f"torch.version.hip is set ({build['hip']}): this is a ROCm build, "
                "handled by the amd adapter",
            )
        if not build["cuda"]:
            return ProbeResult(available=False, reason=f"torch {build['torch']} was built without CUDA")
        if not self.runtime_probe.available():
            return ProbeResult(
                available=False,
                reason=f"torch {build['torch']} (CUDA {build['cuda']}) sees no GPU: "
                "torch.cuda.is_available() is False (check nvidia-smi and CUDA_VISIBLE_DEVICES)",
                runtime_version=build["cuda"],
            )
        return ProbeResult(
            available=True, reason=f"CUDA {build['cuda']} runtime", runtime_version=build["cuda"]
        )

    def discover(self) -> Sequence[DeviceCapabilities]:
        count = self.runtime_probe.device_count()
        libraries = self.runtime_probe.libraries()
        nvml = self.runtime_probe.nvml()
        devices = [self._capabilities(i, count, libraries, nvml) for i in range(count)]
        # An ECC mode not read is not declared: say so, as a requirement on ECC now refuses the device
        unread = {self._id(i): why for i in range(count) if (why := self._ecc_unread(i)) is not None}
        if not nvml["available"]:
            log.warning(
                "NVML unavailable: no uuid, ECC mode or health readings; ECC is not declared",
                reason=nvml["reason"],
            )
            telemetry.count("torchhal.nvml.unavailable", adapter=self.name)
        elif unread:
            log.warning("ECC mode unread: ECC is not declared for these devices", devices=unread)
        if unread:
            telemetry.count("torchhal.nvml.ecc_unread", len(unread), adapter=self.name)
        return devices

    def _ecc_unread(self, index: int) -> str | None:
        """Why device `index` declares no ECC though ECC may be on; None where NVML read its ECC mode."""
        nvml = self.runtime_probe.nvml()
        if not nvml["available"]:
            return f"NVML unavailable: {nvml['reason']}"
        facts = self.runtime_probe.nvml_device(index)
        if facts is None:
            return "NVML knows no device of this UUID, or could not identify it"
        return None if facts.get("ecc_mode_current") is not None else "NVML did not report the ECC mode"

    def _capabilities(
        self, index: int, count: int, libraries: dict[str, Any], nvml: dict[str, Any]
    ) -> DeviceCapabilities:
        props = self.runtime_probe.properties(index)
        cc = (props["major"], props["minor"])
        management = self.runtime_probe.nvml_device(index) or {}
        sku = sku_for(props["name"])
        peers = any(self.runtime_probe.can_access_peer(index, j) for j in range(count) if j != index)
        features = {Feature.GRAPHS, Feature.DEVICE_EVENTS}
        tensor_cores = cc >= TENSOR_CORES_FROM and not (
            cc == (7, 5) and NO_TENSOR_CORES_SM75.search(props["name"])
        )
        features |= {Feature.TENSOR_CORES} if tensor_cores else set()
        features |= {Feature.FP8} if cc >= FP8_FROM else set()
        features |= {Feature.P2P} if peers else set()
        features |= {Feature.TRITON} if libraries["triton"] else set()
        features |= {Feature.ECC} if management.get("ecc_mode_current") == NVML_ECC_ENABLED else set()
        kernels = (
            ("cublas",)
            + (("cudnn",) if libraries["cudnn"] else ())
            + (("triton",) if libraries["triton"] else ())
            + _attention_backends(cc, libraries)
        )
        return DeviceCapabilities(
            vendor=self.vendor,
            adapter=self.name,
            device_type="cuda",
            index=index,
            name=props["name"],
            arch=f"sm_{cc[0]}{cc[1]}",
            compute_units=props["multi_processor_count"],
            simd_width=props.get("warp_size", WARP),
            memory_bytes=props["total_memory"],
            dtypes=_dtypes(cc),
            features=frozenset(features),
            collective_backends=("nccl", "gloo"),
            kernel_backends=kernels,
            shared_memory_per_block_bytes=props.get("shared_memory_per_block_optin")
            or props.get("shared_memory_per_block"),
            l2_cache_bytes=props.get("L2_cache_size") or None,
            declared_peaks=sku.peaks if sku else None,
            uuid=management.get("uuid") or (f"GPU-{props['uuid']}" if "uuid" in props else None),
            pci_bus_id=management.get("pci_bus_id") or topology.torch_bus_id(props),
            driver_version=nvml.get("driver_version"),
        )

    def memory_info(self, index: int) -> MemoryInfo:
        memory = self.runtime_probe.memory(index)
        return MemoryInfo(
            total_bytes=memory["total"], free_bytes=memory["free"], used_bytes=memory["allocated"]
        )

    def health(self, index: int) -> HealthReport:
        """NVML's readings; the messages also say why ECC is not declared where its mode went unread."""
        readings = self.runtime_probe.nvml_health(index)
        unread = self._ecc_unread(index)
        ecc_note = () if unread is None else (f"ECC not declared, its mode unread: {unread}",)
        if readings is None:
            nvml = self.runtime_probe.nvml()
            reason = "NVML knows no device of this UUID" if nvml["available"] else nvml["reason"]
            messages = (f"no health readings: {reason}", *ecc_note)
            return HealthReport(status=HealthStatus.UNKNOWN, messages=messages)
        static = self.runtime_probe.nvml_device(index) or {}
        report = HealthReport.from_readings(
            "NVML",
            temperature=("temperature", readings["temperature_c"]),
            limit=("slowdown threshold", static.get("slowdown_temperature_c")),
            ecc=("uncorrected ECC", readings["ecc_uncorrected_volatile"]),
            utilization_pct=readings["utilization_gpu_pct"],
        )
        return report.model_copy(update={"messages": (*report.messages, *ecc_note)})

    def topology(self) -> Topology:
        count = self.runtime_probe.device_count()
        devices = tuple(self._id(i) for i in range(count))
        per_link = self._nvlink_per_link_gbps(count)
        nvml = [self.runtime_probe.nvml_device(i) for i in range(count)]
        if all(facts is not None for facts in nvml):
            links, unread = topology.links_from_nvml(nvml, self._id, per_link)
            if not unread:
                return Topology(devices=devices, links=tuple(links))
            # NVML's answer for these pairs may understate them (an NVLink pair as PCIe, or unlinked):
            # nvidia-smi reads every pair from the driver, so its matrix is preferred where it answers
            telemetry.count("torchhal.topology.unread_links", len(unread), adapter=self.name)
            smi = self.runtime_probe.nvidia_smi_topology()
            if smi["topo"] is None:
                log.warning(
                    "NVML left these pairs' links unread and nvidia-smi did not answer: they keep "
                    "what NVML did report (a PCIe level, or no link)",
                    pairs=unread,
                    nvidia_smi=smi["reason"],
                )
                return Topology(devices=devices, links=tuple(links))
            reason = f"NVML left the links of these pairs unread: {unread}"
        else:
            nvml_status = self.runtime_probe.nvml()
            unknown = [self._id(i) for i, facts in enumerate(nvml) if facts is None]
            reason = (
                f"NVML knows no device of the UUID of, or could not identify, {unknown}"
                if nvml_status["available"]
                else nvml_status["reason"]
            )
            smi = self.runtime_probe.nvidia_smi_topology()
        log.warning("topology from nvidia-smi instead of NVML", reason=reason)
        telemetry.count("torchhal.topology.fallbacks", adapter=self.name, source="nvidia-smi")
        return Topology(devices=devices, links=tuple(self._smi_links(count, per_link, smi)))

    def _smi_links(self, count: int, per_link: float | None, smi: dict[str, Any]) -> list[Link]:
        """Links from what `nvidia-smi topo -m` printed (`smi`: the probe's nvidia_smi_topology())."""
        if smi["topo"] is None:
            log.warning("no topology: neither NVML nor nvidia-smi answered", reason=smi["reason"])
            telemetry.count("torchhal.topology.fallbacks", adapter=self.name, source="none")
            return []
        by_bus = {topology.torch_bus_id(self.runtime_probe.properties(i)): i for i in range(count)}
        smi_bus = self._readable_bus_ids(smi["bus_ids"])
        to_torch = {k: by_bus[v] for k, v in smi_bus.items() if v in by_bus}
        cells = topology.parse_topo_matrix(smi["topo"])
        smi_index = {torch_index: k for k, torch_index in to_torch.items()}
        unread = [
            f"{self._id(a)}-{self._id(b)}"
            for a in range(count)
            for b in range(a + 1, count)
            if (smi_index.get(a), smi_index.get(b)) not in cells
        ]
        if unread:  # no matrix in the output, or GPUs torch reports no PCI bus id for
            log.warning(
                "nvidia-smi topo -m says nothing about these pairs, left unlinked",
                pairs=unread,
                matrix_found=bool(cells),
                matched_by_bus_id=[self._id(i) for i in sorted(smi_index)],
            )
            telemetry.count("torchhal.topology.unread_pairs", len(unread), adapter=self.name)
        return topology.links_from_smi(cells, to_torch, self._id, per_link)

    def _readable_bus_ids(self, listed: Mapping[str, str]) -> dict[int, str]:
        """nvidia-smi's index -> bus id rows, in NVML's form; a row that does not parse is left
        out, logged and counted (one bad row dropped every link of the adapter)."""
        out = {}
        for index, text in listed.items():
            try:
                out[int(index)] = topology.bus_id(text)
            except ValueError as exc:
                log.warning(
                    "nvidia-smi row unreadable, that GPU left unlinked",
                    index=index,
                    bus_id=text,
                    error=str(exc),
                )
                telemetry.count("torchhal.topology.unread_bus_ids", adapter=self.name)
        return out

    def _nvlink_per_link_gbps(self, count: int) -> float | None:
        """Declared per-link bandwidth when every device is one SKU with a sourced NVLink figure."""
        names = {self.runtime_probe.properties(i)["name"] for i in range(count)}
        sku = sku_for(names.pop()) if len(names) == 1 else None
        return sku.nvlink_per_link_gbps() if sku else None

    def _id(self, index: int) -> str:
        return self.device_id(index, "cuda")

    def collective_backend(self) -> str:
        return "nccl"

    def numerics_settings(self) -> dict[str, Any]:
        """torch's CUDA-API switches (TF32, reduced-precision reductions, cuDNN's autotuning)."""
        return torch_flags.backend_flags(torch_flags.CUDA_API_FLAGS, torch_flags.CUDA_API_LEGACY_FLAGS)


def _dtypes(cc: tuple[int, int]) -> frozenset[DType]:
    dtypes = {DType.FP64, DType.FP32, DType.FP16, DType.INT8}
    if cc >= TF32_BF16_FROM:
        dtypes |= {DType.TF32, DType.BF16}
    if cc >= FP8_FROM:
        dtypes |= {DType.FP8_E4M3, DType.FP8_E5M2}
    return frozenset(dtypes)


def _attention_backends(cc: tuple[int, int], libraries: dict[str, Any]) -> tuple[str, ...]:
    """SDPA's fused attention kernels this device can run: FlashAttention where the torch build has
    it (`flash_attention`; recordings made before it was read lack the key and get none), cuDNN
    attention with cuDNN 9 or newer."""
    if cc < SDPA_ATTENTION_FROM:
        return ()
    flash = ("flash-attention",) if libraries.get("flash_attention") else ()
    cudnn = ("cudnn-attention",) if (libraries.get("cudnn") or 0) >= CUDNN_ATTENTION_VERSION else ()
    return flash + cudnn
