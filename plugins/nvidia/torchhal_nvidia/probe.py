"""CudaProbe: the only code that reads the CUDA runtime, NVML and nvidia-smi.

Every method returns plain data named and measured as the source reports it (torch's
`get_device_properties` field names, NVML's units), so the adapter's translation can be
tested on recorded facts. The torch.cuda readings are hal_core's LiveProbe; this module imports
neither torch nor NVML at import time: `python -m torchhal_nvidia.probe` records a machine's
facts as a JSON fixture on a GPU host with torch and torchhal-nvidia installed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from typing import Any

from torchhal.hal_core import LiveProbe, record_probe, telemetry

log = telemetry.get_logger("torchhal.nvidia")

NVML_EXTRA = "pip install 'torchhal-nvidia[nvml]'"
SMI_TIMEOUT_S = 5.0
# nvmlNvLinkDeviceType values (nvml.h): what sits at the far end of an NVLink.
NVLINK_REMOTE = {0: "gpu", 1: "ibmnpu", 2: "switch"}


class CudaProbe(LiveProbe):
    """Live facts from torch.cuda, NVML (optional, imported on first use) and nvidia-smi."""

    DEVICE_MODULE = "cuda"
    GRAPH_CLASS = "CUDAGraph"
    CAPTURE_ERROR_MODE = "thread_local"

    def __init__(self) -> None:
        self._nvml: Any = None
        self._nvml_status: dict[str, Any] | None = None
        self._static: dict[int, dict[str, Any] | None] = {}  # nvml_device answers; they do not change

    # -- torch: how it was built and its libraries (device facts: LiveProbe) ----------------
    def runtime(self) -> dict[str, Any]:
        """How torch was built; reads no device."""
        import torch

        return {"torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip}

    def libraries(self) -> dict[str, Any]:
        """Kernel libraries this process could use: cuDNN's version, whether Triton is installed,
        whether this torch build has its FlashAttention kernels."""
        import torch

        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return {
            "cudnn": cudnn,
            "triton": importlib.util.find_spec("triton") is not None,
            "flash_attention": bool(torch.backends.cuda.is_flash_attention_available()),
        }

    # -- NVML -------------------------------------------------------------------------------
    def nvml(self) -> dict[str, Any]:
        """Whether NVML answers, why not when it does not, and the driver version."""
        if self._nvml_status is None:
            self._nvml_status = self._init_nvml()
        return self._nvml_status

    def _init_nvml(self) -> dict[str, Any]:
        try:
            import pynvml
        except ImportError:
            return {"available": False, "reason": f"pynvml is not installed ({NVML_EXTRA})"}
        try:
            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
        except pynvml.NVMLError as exc:
            return {"available": False, "reason": f"NVML did not initialise: {exc}"}
        self._nvml = pynvml
        return {"available": True, "reason": "NVML initialised", "driver_version": driver}

    def _handle(self, index: int) -> Any:
        """NVML's handle for torch's device `index`, matched by UUID (indices can differ);
        None when NVML has no device of that UUID."""
        return self._value(self._nvml.nvmlDeviceGetHandleByUUID, f"GPU-{self.properties(index)['uuid']}")

    def _value(self, fn: Callable[..., Any], *args: Any) -> Any:
        """An NVML reading, or None where this GPU or driver does not support it."""
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    def nvml_device(self, index: int) -> dict[str, Any] | None:
        """Static NVML facts of one device and its links; None when NVML is unavailable or does
        not know the device."""
        if index not in self._static:
            self._static[index] = self._device_facts(index) if self.nvml()["available"] else None
        return self._static[index]

    def _device_facts(self, index: int) -> dict[str, Any] | None:
        nv, handle = self._nvml, self._handle(index)
        if handle is None:
            return None
        uuid = self._value(nv.nvmlDeviceGetUUID, handle)
        pci = self._value(nv.nvmlDeviceGetPciInfo, handle)
        if uuid is None or pci is None:  # e.g. the GPU is lost: only it goes without NVML facts
            unread = [what for what, value in (("UUID", uuid), ("PCI info", pci)) if value is None]
            log.warning("NVML could not identify this GPU: it has no NVML facts", device=index, unread=unread)
            telemetry.count("torchhal.nvml.unidentified_devices", adapter="nvidia")
            return None
        ecc = self._value(nv.nvmlDeviceGetEccMode, handle)
        peers = {j: self._handle(j) for j in range(self.device_count()) if j != index}
        peers = {j: peer for j, peer in peers.items() if peer is not None}
        return {
            "uuid": _text(uuid),
            "pci_bus_id": _text(pci.busId),
            "ecc_mode_current": None if ecc is None else int(ecc[0]),
            "slowdown_temperature_c": self._value(
                nv.nvmlDeviceGetTemperatureThreshold, handle, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
            ),
            "nvlinks": self._nvlinks(handle),
            "p2p_status_nvlink": {
                str(j): self._value(nv.nvmlDeviceGetP2PStatus, handle, peer, nv.NVML_P2P_CAPS_INDEX_NVLINK)
                for j, peer in peers.items()
            },
            "topology_common_ancestor": {
                str(j): self._value(nv.nvmlDeviceGetTopologyCommonAncestor, handle, peer)
                for j, peer in peers.items()
            },
        }

    def _nvlinks(self, handle: Any) -> list[dict[str, Any]]:
        nv, links = self._nvml, []
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            state = self._value(nv.nvmlDeviceGetNvLinkState, handle, link)
            if state is None:  # no such link on this GPU
                continue
            remote = self._value(nv.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
            kind = self._value(nv.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
            links.append(
                {
                    "link": link,
                    "active": bool(state),
                    "version": self._value(nv.nvmlDeviceGetNvLinkVersion, handle, link),
                    "remote_pci_bus_id": None if remote is None else _text(remote.busId),
                    "remote_device_type": NVLINK_REMOTE.get(kind, "unknown") if kind is not None else None,
                }
            )
        return links

    def nvml_health(self, index: int) -> dict[str, Any] | None:
        """Readings that change while the device runs; None when NVML is unavailable or does not
        know the device."""
        handle = self._handle(index) if self.nvml()["available"] else None
        if handle is None:
            return None
        nv = self._nvml
        util = self._value(nv.nvmlDeviceGetUtilizationRates, handle)
        return {
            "temperature_c": self._value(nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU),
            "ecc_uncorrected_volatile": self._value(
                nv.nvmlDeviceGetTotalEccErrors,
                handle,
                nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nv.NVML_VOLATILE_ECC,
            ),
            "ecc_corrected_volatile": self._value(
                nv.nvmlDeviceGetTotalEccErrors,
                handle,
                nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                nv.NVML_VOLATILE_ECC,
            ),
            "utilization_gpu_pct": None if util is None else util.gpu,
        }

    # -- nvidia-smi (the topology fallback when NVML is absent) -----------------------------
    def nvidia_smi_topology(self) -> dict[str, Any]:
        """`nvidia-smi topo -m` as printed, and each nvidia-smi index's PCI bus id."""
        import shutil
        import subprocess  # here, not at module level: only this fallback runs programs

        exe = shutil.which("nvidia-smi")
        if exe is None:
            return {"topo": None, "bus_ids": {}, "reason": "nvidia-smi is not on PATH"}
        try:
            topo = _run([exe, "topo", "-m"])
            ids = _run([exe, "--query-gpu=index,pci.bus_id", "--format=csv,noheader"])
        except (OSError, subprocess.SubprocessError) as exc:
            return {"topo": None, "bus_ids": {}, "reason": f"nvidia-smi failed: {exc}"}
        bus_ids: dict[str, str] = {}
        for line in ids.splitlines():  # "0, 00000000:00:06.0"
            index, _, bus = line.partition(",")
            if bus:
                bus_ids[index.strip()] = bus.strip()
        return {"topo": topo, "bus_ids": bus_ids, "reason": "nvidia-smi topo -m"}


def _text(value: str | bytes) -> str:
    """NVML strings arrive as bytes from older nvidia-ml-py releases."""
    return value.decode() if isinstance(value, bytes) else value


def _run(argv: list[str]) -> str:
    import subprocess

    done = subprocess.run(argv, capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=True)
    return done.stdout


def record(probe: Any, source: str) -> dict[str, Any]:
    """Every fact `probe` reports, in the shape `RecordedCudaProbe` replays."""
    facts = record_probe(
        probe,
        source,
        system={"nvml": probe.nvml},
        device={"nvml": probe.nvml_device, "nvml_health": probe.nvml_health},
    )
    if facts["available"]:
        facts["nvidia_smi"] = probe.nvidia_smi_topology()
    return facts


if __name__ == "__main__":  # python -m torchhal_nvidia.probe "where this recording was made"
    json.dump(record(CudaProbe(), " ".join(sys.argv[1:]) or "live recording"), sys.stdout, indent=1)
    print()
