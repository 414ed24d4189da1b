"""XpuProbe: the only code that reads Intel's XPU runtime (torch.xpu, over SYCL and Level Zero).

Every method returns plain data named as torch reports it (`torch.xpu.get_device_properties`
field names), so the adapter's translation can be tested on recorded facts. The torch.xpu
readings are hal_core's LiveProbe; this module does not import torch at import time:
`python -m torchhal_intel.probe` records a machine's facts as a JSON fixture on an XPU host with
torch and torchhal-intel installed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from typing import Any

from torchhal.hal_core import LiveProbe, record_probe


class XpuProbe(LiveProbe):
    """Live facts from torch.xpu."""

    DEVICE_MODULE = "xpu"
    GRAPH_CLASS = "XPUGraph"  # torch.xpu.graph takes no capture_error_mode

    def runtime(self) -> dict[str, Any]:
        """How torch was built; reads no device."""
        import torch

        return {"torch": torch.__version__, "xpu": getattr(torch.version, "xpu", None)}

    def libraries(self) -> dict[str, Any]:
        """Whether Triton is installed and this torch can capture XPU graphs."""
        import torch

        return {
            "triton": importlib.util.find_spec("triton") is not None,
            "graphs": hasattr(torch.xpu, "XPUGraph"),
        }


def record(probe: Any, source: str) -> dict[str, Any]:
    """Every fact `probe` reports, in the shape `RecordedXpuProbe` replays."""
    return record_probe(probe, source)


if __name__ == "__main__":  # python -m torchhal_intel.probe "where this recording was made"
    json.dump(record(XpuProbe(), " ".join(sys.argv[1:]) or "live recording"), sys.stdout, indent=1)
    print()
