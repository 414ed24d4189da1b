"""AmdAdapter: translates what ROCm (through torch.cuda) and amdsmi report into torchhal's terms.

All reading goes through one probe object (`RocmProbe` live, `RecordedRocmProbe` in tests);
this module holds only the translation: the gfx target to dtypes, wavefront and features,
HIP's WGP counting to compute units, amdsmi readings to health and xGMI links.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from torchhal.hal_core import (
    DeclaredPeaks,
    DeviceCapabilities,
    DType,
    Feature,
    HealthReport,
    HealthStatus,
    InvalidArgumentError,
    Link,
    LinkType,
    MemoryInfo,
    ProbedAdapter,
    ProbeResult,
    Topology,
    UnsupportedError,
    telemetry,
    torch_flags,
)

from torchhal_amd.datasheets import sku_for
from torchhal_amd.probe import WGP_MODE_ENV, RocmProbe, pci_address

log = telemetry.get_logger("torchhal.amd")

_GFX = re.compile(r"gfx(\d{1,2})([0-9a-f])([0-9a-f])$")
HOST_HOPS = 3  # amdsmi hop count 3: the path crosses both CPU sockets
_SPEED = (LinkType.HOST, LinkType.PCIE, LinkType.XGMI)  # slowest first
MILLI = 1000  # amdsmi temperatures at or above this are millidegrees (no GPU runs at 1000 C)
ECC_BLOCK_UMC = 1  # amdsmi_gpu_block_t's UMC: the memory controllers, whose ECC covers HBM/VRAM


class GfxTarget:
    """A gfx target such as gfx942 or gfx1100, and what that generation computes with."""

    def __init__(self, gcn_arch_name: str, device: str | None = None) -> None:
        """`device`: whose target this is, named by the error for a name that is not one."""
        self.name = gcn_arch_name.split(":")[0]  # gfx942:sramecc+:xnack- -> gfx942
        match = _GFX.match(self.name)
        if match is None:
            whose = f"{device}: " if device else ""
            raise UnsupportedError(
                f"amd adapter: {whose}gcnArchName {gcn_arch_name!r} is not a gfx target it knows: "
                "expected gfx<major><minor><stepping>[:features], such as gfx90a or gfx942:sramecc+:xnack-"
            )
        self.major, self.minor = int(match.group(1)), int(match.group(2), 16)

    @property
    def rdna(self) -> bool:
        """gfx10, gfx11 and gfx12 are RDNA: wave32, and HIP counts work-group processors."""
        return self.major >= 10

    @property
    def matrix_cores(self) -> bool:
        """MFMA on CDNA (gfx908, gfx90a, gfx94x, gfx950); WMMA on RDNA3 and RDNA4."""
        return self.name in ("gfx908", "gfx90a") or (self.major == 9 and self.minor >= 4) or self.major >= 11

    def dtypes(self) -> frozenset[DType]:
        dtypes = {DType.FP64, DType.FP32, DType.FP16, DType.INT8}
        if self.matrix_cores:  # bf16 MFMA from CDNA1 (gfx908's v_mfma_f32_*bf16), WMMA from RDNA3
            dtypes.add(DType.BF16)
        if self.major == 9 and self.minor == 4:  # CDNA3: xf32 matrix ops, fp8 in the fnuz encoding
            dtypes |= {DType.TF32, DType.FP8_E4M3_FNUZ, DType.FP8_E5M2_FNUZ}
        if (self.major == 9 and self.minor == 5) or self.major == 12:  # CDNA4 and RDNA4: OCP fp8
            dtypes |= {DType.FP8_E4M3, DType.FP8_E5M2}
        return frozenset(dtypes)


class AmdAdapter(ProbedAdapter):
    name = "amd"
    vendor = "amd"
    priority = 100

    def __init__(self, probe: Any = None) -> None:
        """`probe`: anything with RocmProbe's methods; the live runtime by default. No device work."""
        self.runtime_probe = probe if probe is not None else RocmProbe()

    def probe(self) -> ProbeResult:
        build = self.runtime_probe.runtime()
        if not build["hip"]:
            built = f"a CUDA build (CUDA {build['cuda']})" if build["cuda"] else "built without ROCm"
            return ProbeResult(
                available=False,
                reason=f"torch {build['torch']} is {built}: AMD GPUs need a ROCm build of torch "
                "(NVIDIA GPUs are the nvidia adapter's)",
            )
        if not self.runtime_probe.available():
            return ProbeResult(
                available=False,
                reason=f"torch {build['torch']} (HIP {build['hip']}) sees no GPU: torch.cuda.is_available() "
                "is False (check amd-smi and HIP_VISIBLE_DEVICES)",
                runtime_version=build["hip"],
            )
        return ProbeResult(
            available=True, reason=f"ROCm/HIP {build['hip']} runtime", runtime_version=build["hip"]
        )

    def discover(self) -> Sequence[DeviceCapabilities]:
        count = self.runtime_probe.device_count()
        smi = self.runtime_probe.amdsmi()
        devices = [self._capabilities(i, count) for i in range(count)]
        # ECC whose state was not read is not declared: say so, as a requirement on ECC now refuses the device
        unread = {self._id(i): why for i in range(count) if (why := self._ecc_unread(i)) is not None}
        if not smi["available"]:
            log.warning(
                "amdsmi unavailable: no uuid, ECC state, health or xGMI readings; ECC is not declared",
                reason=smi["reason"],
            )
            telemetry.count("torchhal.amdsmi.unavailable", adapter=self.name)
        elif unread:
            log.warning("ECC state unread: ECC is not declared for these devices", devices=unread)
        if unread:
            telemetry.count("torchhal.amdsmi.ecc_unread", len(unread), adapter=self.name)
        return devices

    def _ecc_unread(self, index: int) -> str | None:
        """Why device `index` declares no ECC though ECC may be on; None where amdsmi read its ECC state."""
        smi = self.runtime_probe.amdsmi()
        if not smi["available"]:
            return f"amdsmi unavailable: {smi['reason']}"
        management = self.runtime_probe.amdsmi_device(index)
        if management is None:
            return "amdsmi has no device at this device's PCI address"
        if management.get("ecc_enabled_blocks") is None:
            return "amdsmi did not report the ECC-enabled blocks (it does not on a VM guest)"
        return None

    def _capabilities(self, index: int, count: int) -> DeviceCapabilities:
        props = self.runtime_probe.properties(index)
        target = GfxTarget(props["gcnArchName"], f"{self._id(index)} in {_source(self.runtime_probe)}")
        libraries = self.runtime_probe.libraries()
        management = self.runtime_probe.amdsmi_device(index) or {}
        dtypes = target.dtypes()
        peers = any(self.runtime_probe.can_access_peer(index, j) for j in range(count) if j != index)
        ecc = (management.get("ecc_enabled_blocks") or 0) & ECC_BLOCK_UMC
        features = {Feature.GRAPHS, Feature.DEVICE_EVENTS}
        features |= {Feature.TENSOR_CORES} if target.matrix_cores else set()
        features |= {Feature.FP8} if any("fp8" in d.value for d in dtypes) else set()
        features |= {Feature.P2P} if peers else set()
        features |= {Feature.TRITON} if libraries["triton"] else set()
        features |= {Feature.ECC} if ecc else set()
        kernels = (
            ("rocblas",)
            + (("miopen",) if libraries["miopen"] else ())
            + (("triton",) if libraries["triton"] else ())
        )
        compute_units = self._compute_units(index, props, target)
        return DeviceCapabilities(
            vendor=self.vendor,
            adapter=self.name,
            device_type="cuda",  # ROCm builds of torch expose HIP devices as "cuda"
            index=index,
            name=props["name"],
            arch=target.name,
            compute_units=compute_units,
            simd_width=props.get("warp_size", 32 if target.rdna else 64),
            memory_bytes=props["total_memory"],
            dtypes=dtypes,
            features=frozenset(features),
            collective_backends=("nccl", "gloo"),  # torch's backend name "nccl" is RCCL on ROCm
            kernel_backends=kernels,
            shared_memory_per_block_bytes=props.get("shared_memory_per_block"),
            l2_cache_bytes=props.get("L2_cache_size") or None,
            declared_peaks=self._declared_peaks(index, props["name"], compute_units),
            uuid=management.get("uuid") or props.get("uuid"),
            pci_bus_id=management.get("bdf") or pci_address(props),
            driver_version=management.get("driver_version"),
        )

    def _declared_peaks(self, index: int, name: str, compute_units: int) -> DeclaredPeaks | None:
        """The data sheet's peaks where this device is the whole SKU they were printed for. A
        partition (MI300X in CPX mode: 38 CUs of one XCD, the same name) has a share of them that
        no sheet prints, so it declares none, as NVIDIA's MIG instances (whose names no entry
        matches) do."""
        sku = sku_for(name)
        if sku is None or compute_units == sku.compute_units:
            return sku.peaks if sku else None
        log.info(
            "no declared peaks: the device's compute units are not those its data sheet counts "
            "(a partition, e.g. MI300X in CPX mode, or an MI250 GCD under ROCm's 'MI250X/MI250')",
            device=self._id(index),
            name=name,
            compute_units=compute_units,
            data_sheet_compute_units=sku.compute_units,
        )
        return None

    def _compute_units(self, index: int, props: dict[str, Any], target: GfxTarget) -> int:
        """HIP counts work-group processors (2 CUs each) on RDNA unless WGP mode is switched off."""
        count = int(props["multi_processor_count"])
        if not target.rdna:
            return count
        runtime = self.runtime_probe.runtime()
        if WGP_MODE_ENV not in runtime:  # the live probe always reads it; a recording may lack it
            raise InvalidArgumentError(
                f"amd adapter: {self._id(index)} in {_source(self.runtime_probe)} is RDNA ({target.name}), "
                f"whose compute units HIP counts by {WGP_MODE_ENV}, and its runtime facts have no "
                f"{WGP_MODE_ENV} (record it as HIP saw it, null where it was unset)"
            )
        return 2 * count if runtime[WGP_MODE_ENV] != "0" else count

    def memory_info(self, index: int) -> MemoryInfo:
        memory = self.runtime_probe.memory(index)
        return MemoryInfo(
            total_bytes=memory["total"], free_bytes=memory["free"], used_bytes=memory["allocated"]
        )

    def health(self, index: int) -> HealthReport:
        """amdsmi's readings; the messages also say why ECC is not declared where its state went unread."""
        readings = self.runtime_probe.amdsmi_health(index)
        unread = self._ecc_unread(index)
        ecc_note = () if unread is None else (f"ECC not declared, its state unread: {unread}",)
        if readings is None:
            smi = self.runtime_probe.amdsmi()
            reason = (
                "amdsmi has no device at this device's PCI address" if smi["available"] else smi["reason"]
            )
            messages = (f"no health readings: {reason}", *ecc_note)
            return HealthReport(status=HealthStatus.UNKNOWN, messages=messages)
        static = self.runtime_probe.amdsmi_device(index) or {}
        report = HealthReport.from_readings(
            "amdsmi",
            temperature=("hotspot temperature", _celsius(readings["temperature_hotspot"])),
            limit=("critical temperature", _celsius(static.get("temperature_hotspot_critical"))),
            ecc=("uncorrectable ECC", readings["ecc_uncorrectable"]),
            utilization_pct=readings["gfx_activity_pct"],
        )
        return report.model_copy(update={"messages": (*report.messages, *ecc_note)})

    def topology(self) -> Topology:
        count = self.runtime_probe.device_count()
        devices = tuple(self._id(i) for i in range(count))
        smi = self.runtime_probe.amdsmi()
        if not smi["available"]:
            log.warning("no links: amdsmi is unavailable", reason=smi["reason"])
            telemetry.count("torchhal.topology.fallbacks", adapter=self.name, source="none")
            return Topology(devices=devices)
        # A device amdsmi has no handle for has no facts (None), and its peers none towards it:
        # only the pairs it is in go unlinked.
        facts = [self.runtime_probe.amdsmi_links(i) or {} for i in range(count)]
        links, unread = [], []
        for a in range(count):
            for b in range(a + 1, count):
                there, back = facts[a].get(str(b)), facts[b].get(str(a))
                if there is None or back is None:
                    unread.append(f"{self._id(a)}-{self._id(b)}")
                    continue
                link = self._link(a, b, there, back)
                if link is not None:
                    links.append(link)
        if unread:
            log.warning(
                "amdsmi has no link facts for these pairs (no amdsmi device at the PCI address torch "
                "reports), left unlinked",
                pairs=unread,
            )
            telemetry.count("torchhal.topology.unread_pairs", len(unread), adapter=self.name)
        return Topology(devices=devices, links=tuple(links))

    def _link(self, a: int, b: int, there: dict[str, Any], back: dict[str, Any]) -> Link | None:
        kind, reverse = _link_type(there), _link_type(back)
        if kind != reverse:
            log.warning(
                "amdsmi link types differ by direction, keeping the slower", a=a, b=b, types=(kind, reverse)
            )
            kind = min((k for k in (kind, reverse) if k is not None), key=_SPEED.index, default=None)
        if kind is None:
            log.warning("amdsmi link type not understood, pair left unlinked", a=a, b=b, facts=there)
            telemetry.count(
                "torchhal.topology.unknown_codes", adapter=self.name, code=str(there.get("type_name"))
            )
            return None
        mb_s = there.get("max_bandwidth_mb_s")
        bandwidth = mb_s / 1000 if kind is LinkType.XGMI and mb_s else None
        return Link(a=self._id(a), b=self._id(b), type=kind, bandwidth_gbps=bandwidth, source="amdsmi")

    def _id(self, index: int) -> str:
        return self.device_id(index, "cuda")

    def collective_backend(self) -> str:
        return "nccl"

    def numerics_settings(self) -> dict[str, Any]:
        """torch's CUDA-API switches (TF32, reduced-precision reductions, MIOpen's autotuning through
        torch's cudnn switches), which a ROCm build answers as a CUDA one does)."""
        return torch_flags.backend_flags(torch_flags.CUDA_API_FLAGS, torch_flags.CUDA_API_LEGACY_FLAGS)


def _link_type(facts: dict[str, Any]) -> LinkType | None:
    name = (facts.get("type_name") or "").upper()
    if "XGMI" in name:
        return LinkType.XGMI
    if "PCI" in name:
        hops = facts.get("hops") or 0
        return LinkType.HOST if hops >= HOST_HOPS else LinkType.PCIE
    return None


def _source(probe: Any) -> str:
    """Where a probe's facts come from, for errors about them: a recording's source, or the runtime."""
    source = getattr(probe, "source", None)
    return "the live ROCm runtime" if source is None else f"the recording {source!r}"


def _celsius(raw: float | None) -> float | None:
    if raw is None:
        return None
    return raw / 1000 if raw >= MILLI else float(raw)
