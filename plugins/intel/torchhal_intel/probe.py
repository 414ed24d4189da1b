"""XpuProbe: the only code that reads Intel's XPU runtime (torch.xpu, over SYCL and Level Zero).

Every method returns plain data named as torch reports it (`torch.xpu.get_device_properties`
field names), so the adapter's translation can be tested on recorded facts. This module
imports neither torchhal nor (at import time) torch: `python -m torchhal_intel.probe` records
a machine's facts as a JSON fixture on a host that has nothing but torch installed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import uuid
from typing import Any


def torch_properties(props: object) -> dict[str, Any]:
    """A torch device-properties object as a JSON-able dict, under torch's own field names."""
    out: dict[str, Any] = {}
    for key in dir(props):
        if key.startswith("_"):
            continue
        value = getattr(props, key)
        if key == "uuid":  # 16 raw bytes on XPU; the canonical 8-4-4-4-12 text is what repr shows
            out[key] = str(uuid.UUID(bytes=bytes(value))) if isinstance(value, (bytes, list)) else str(value)
        elif isinstance(value, (bool, int, float, str)):
            out[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
            out[key] = list(value)
    return out


class XpuProbe:
    """Live facts from torch.xpu."""

    def runtime(self) -> dict[str, Any]:
        """How torch was built; reads no device."""
        import torch

        return {"torch": torch.__version__, "xpu": getattr(torch.version, "xpu", None)}

    def available(self) -> bool:
        import torch

        return bool(torch.xpu.is_available())

    def libraries(self) -> dict[str, Any]:
        """Whether Triton is installed and this torch can capture XPU graphs."""
        import torch

        return {
            "triton": importlib.util.find_spec("triton") is not None,
            "graphs": hasattr(torch.xpu, "XPUGraph"),
        }

    def device_count(self) -> int:
        import torch

        return int(torch.xpu.device_count())

    def properties(self, index: int) -> dict[str, Any]:
        import torch

        return torch_properties(torch.xpu.get_device_properties(index))

    def can_access_peer(self, index: int, peer: int) -> bool:
        """Peer access as torch reports it; torch releases without the query report none."""
        import torch

        query = getattr(torch.xpu, "can_device_access_peer", None)
        return bool(query(index, peer)) if query is not None else False

    def memory(self, index: int) -> dict[str, int]:
        """Device-wide free and total bytes, and this process's live allocations (not the allocator cache)."""
        import torch

        free, total = torch.xpu.mem_get_info(index)
        return {"free": int(free), "total": int(total), "allocated": int(torch.xpu.memory_allocated(index))}

    # -- actions on the device (not facts; a recorded probe refuses them) -------------------
    def synchronize(self, index: int) -> None:
        import torch

        torch.xpu.synchronize(index)

    def record_event(self, index: int) -> Any:
        """A timing event recorded on the device's current queue."""
        import torch

        event = torch.xpu.Event(enable_timing=True)
        event.record(torch.xpu.current_stream(index))
        return event


def record(probe: Any, source: str) -> dict[str, Any]:
    """Every fact `probe` reports, in the shape `RecordedXpuProbe` replays."""
    facts: dict[str, Any] = {"source": source, "runtime": probe.runtime(), "available": probe.available()}
    if not facts["available"]:
        return facts
    count = probe.device_count()
    facts["libraries"] = probe.libraries()
    facts["devices"] = [{"properties": probe.properties(i), "memory": probe.memory(i)} for i in range(count)]
    facts["peer_access"] = [
        [i, j] for i in range(count) for j in range(count) if i != j and probe.can_access_peer(i, j)
    ]
    return facts


if __name__ == "__main__":  # python -m torchhal_intel.probe "where this recording was made"
    json.dump(record(XpuProbe(), " ".join(sys.argv[1:]) or "live recording"), sys.stdout, indent=1)
    print()
