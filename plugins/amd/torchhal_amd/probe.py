"""RocmProbe: the only code that reads the ROCm runtime (through torch.cuda) and amdsmi.

Every method returns plain data named and measured as the source reports it (torch's
`get_device_properties` field names, amdsmi's dictionaries and units), so the adapter's
translation can be tested on recorded facts. The torch.cuda readings are hal_core's LiveProbe;
this module imports neither torch nor amdsmi at import time: `python -m torchhal_amd.probe`
records a machine's facts as a JSON fixture on a host with torch and torchhal-amd installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any

from torchhal.hal_core import LiveProbe, record_probe, telemetry

log = telemetry.get_logger("torchhal.amd")

AMDSMI_EXTRA = "pip install 'torchhal-amd[amdsmi]' (amdsmi must match the installed ROCm)"
WGP_MODE_ENV = "GPU_ENABLE_WGP_MODE"  # HIP's switch between WGP and CU mode on RDNA


def pci_address(props: dict[str, Any]) -> str | None:
    """A device's PCI address in amdsmi's form (`0000:2d:00.0`) from torch's pci_* properties."""
    try:
        return f"{props['pci_domain_id']:04x}:{props['pci_bus_id']:02x}:{props['pci_device_id']:02x}.0"
    except KeyError:
        return None


class RocmProbe(LiveProbe):
    """Live facts from torch.cuda on a ROCm build of torch, and from amdsmi (optional)."""

    DEVICE_MODULE = "cuda"  # ROCm builds of torch answer through torch.cuda
    GRAPH_CLASS = "CUDAGraph"  # HIP graphs
    CAPTURE_ERROR_MODE = "thread_local"

    def __init__(self) -> None:
        self._smi: Any = None
        self._smi_status: dict[str, Any] | None = None
        self._lacking: set[str] = set()  # amdsmi names the installed release lacks, said once each

    # -- torch: how it was built and its libraries (device facts: LiveProbe) ----------------
    def runtime(self) -> dict[str, Any]:
        """How torch was built, and HIP's WGP-mode setting; reads no device."""
        import torch

        return {
            "torch": torch.__version__,
            "hip": torch.version.hip,
            "cuda": torch.version.cuda,
            WGP_MODE_ENV: os.environ.get(WGP_MODE_ENV),
        }

    def libraries(self) -> dict[str, Any]:
        """MIOpen's version (torch reports it through its cudnn API on ROCm), whether Triton is installed."""
        import torch

        miopen = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return {"miopen": miopen, "triton": importlib.util.find_spec("triton") is not None}

    # -- amdsmi -----------------------------------------------------------------------------
    def amdsmi(self) -> dict[str, Any]:
        """Whether amdsmi answers, and why not when it does not."""
        if self._smi_status is None:
            self._smi_status = self._init_smi()
        return self._smi_status

    def _init_smi(self) -> dict[str, Any]:
        """amdsmi's Python wrapper loads libamd_smi.so when imported, so an installed amdsmi that
        does not match the ROCm library fails with whatever that raised (OSError, KeyError,
        AttributeError on a missing symbol): any failure is amdsmi unavailable, with the reason."""
        try:
            import amdsmi
        except Exception as exc:
            if isinstance(exc, ModuleNotFoundError) and exc.name == "amdsmi":
                return {"available": False, "reason": f"amdsmi is not installed ({AMDSMI_EXTRA})"}
            return {
                "available": False,
                "reason": f"amdsmi failed to load: {_described(exc)}; {AMDSMI_EXTRA}",
            }
        try:
            amdsmi.amdsmi_init()
        except Exception as exc:
            return {"available": False, "reason": f"amdsmi did not initialise: {_described(exc)}"}
        self._smi = amdsmi
        return {"available": True, "reason": "amdsmi initialised"}

    def _handle(self, index: int) -> Any:
        """amdsmi's handle for torch's device `index`, matched by PCI address; None when torch
        reports no address or amdsmi has no device there."""
        address = pci_address(self.properties(index))
        return None if address is None else self._value("amdsmi_get_processor_handle_from_bdf", address)

    def _value(self, name: str, *args: Any) -> Any:
        """amdsmi's `name(*args)`, or None where this GPU, driver or amdsmi release does not answer
        (looked up here, not by the caller: older releases lack some functions)."""
        fn = getattr(self._smi, name, None)
        if fn is None:
            self._lacks(name)
            return None
        try:
            value = fn(*args)
        except self._smi.AmdSmiException:
            return None
        return None if value == "N/A" else value

    def _member(self, enum: str, *names: str) -> Any:
        """The first of `names` that amdsmi's `enum` has (releases renamed members), None if none."""
        members = getattr(self._smi, enum, None)
        found = next((getattr(members, name) for name in names if hasattr(members, name)), None)
        if found is None:
            self._lacks(f"{enum}.{'/'.join(names)}")
        return found

    def _lacks(self, what: str) -> None:
        """Say once that the installed amdsmi lacks `what`: the readings that need it stay unread."""
        if what not in self._lacking:
            self._lacking.add(what)
            log.warning("the installed amdsmi lacks this: readings that need it are unread", missing=what)
            telemetry.count("torchhal.amdsmi.missing_api", adapter="amd", missing=what)

    def _hotspot_temperature(self, handle: Any, metric: str) -> Any:
        """amdsmi_get_temp_metric of the hotspot sensor (JUNCTION in releases before HOTSPOT)."""
        sensor = self._member("AmdSmiTemperatureType", "HOTSPOT", "JUNCTION")
        which = self._member("AmdSmiTemperatureMetric", metric)
        if sensor is None or which is None:
            return None
        return self._value("amdsmi_get_temp_metric", handle, sensor, which)

    def amdsmi_device(self, index: int) -> dict[str, Any] | None:
        """Static amdsmi facts of one device; None when amdsmi is unavailable or has no such device.

        Temperatures are amdsmi_get_temp_metric's raw integers: its documentation says
        millidegrees Celsius, while releases have returned degrees; the adapter tells them apart.
        """
        handle = self._handle(index) if self.amdsmi()["available"] else None
        if handle is None:
            return None
        driver = self._value("amdsmi_get_gpu_driver_info", handle) or {}
        return {
            "uuid": self._value("amdsmi_get_gpu_device_uuid", handle),
            "bdf": self._value("amdsmi_get_gpu_device_bdf", handle),
            "driver_version": driver.get("driver_version"),
            "temperature_hotspot_critical": self._hotspot_temperature(handle, "CRITICAL"),
            # a bit mask of amdsmi_gpu_block_t; unsupported on a VM guest (None)
            "ecc_enabled_blocks": self._value("amdsmi_get_gpu_ecc_enabled", handle),
        }

    def amdsmi_health(self, index: int) -> dict[str, Any] | None:
        """Readings that change while the device runs; None when amdsmi is unavailable or lacks the device."""
        handle = self._handle(index) if self.amdsmi()["available"] else None
        if handle is None:
            return None
        ecc = self._value("amdsmi_get_gpu_total_ecc_count", handle) or {}
        activity = self._value("amdsmi_get_gpu_activity", handle) or {}
        gfx = activity.get("gfx_activity")
        return {
            "temperature_hotspot": self._hotspot_temperature(handle, "CURRENT"),
            "ecc_uncorrectable": ecc.get("uncorrectable_count"),
            "ecc_correctable": ecc.get("correctable_count"),
            "gfx_activity_pct": gfx if isinstance(gfx, (int, float)) else None,
        }

    def amdsmi_links(self, index: int) -> dict[str, Any] | None:
        """How amdsmi says `index` reaches each other device, keyed by the peer's torch index."""
        handle = self._handle(index) if self.amdsmi()["available"] else None
        if handle is None:
            return None
        links = {}
        for peer in range(self.device_count()):
            other = None if peer == index else self._handle(peer)
            if other is None:
                continue
            kind = self._value("amdsmi_topo_get_link_type", handle, other) or {}
            bandwidth = self._value("amdsmi_get_minmax_bandwidth_between_processors", handle, other) or {}
            links[str(peer)] = {
                "type_name": _link_type_name(self._smi, kind.get("type")),
                "hops": kind.get("hops"),
                "weight": self._value("amdsmi_topo_get_link_weight", handle, other),
                "max_bandwidth_mb_s": bandwidth.get("max_bandwidth"),
            }
        return links


def _link_type_name(smi: Any, value: Any) -> str | None:
    """The link type's name under the installed amdsmi's own enum (the numbering changed
    between releases: AmdSmiLinkType in newer ones, AmdSmiIoLinkType before)."""
    if value is None:
        return None
    enum = getattr(smi, "AmdSmiLinkType", None) or getattr(smi, "AmdSmiIoLinkType", None)
    try:
        return str(enum(int(value)).name) if enum is not None else f"UNKNOWN_{value}"
    except ValueError:
        return f"UNKNOWN_{value}"


def _described(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def record(probe: Any, source: str) -> dict[str, Any]:
    """Every fact `probe` reports, in the shape `RecordedRocmProbe` replays."""
    return record_probe(
        probe,
        source,
        system={"amdsmi": probe.amdsmi},
        device={
            "amdsmi": probe.amdsmi_device,
            "amdsmi_health": probe.amdsmi_health,
            "amdsmi_links": probe.amdsmi_links,
        },
    )


if __name__ == "__main__":  # python -m torchhal_amd.probe "where this recording was made"
    json.dump(record(RocmProbe(), " ".join(sys.argv[1:]) or "live recording"), sys.stdout, indent=1)
    print()
