"""RecordedCudaProbe: replays facts recorded by `probe.record` (or sourced by hand) from JSON.

It answers exactly what `CudaProbe` answers, so every adapter path runs on a machine without
a GPU; the shared replay logic is `torchhal.hal_core.RecordedProbe`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torchhal.hal_core import RecordedProbe

NOT_RECORDED = {"available": False, "reason": "NVML facts were not recorded for this fixture"}


class RecordedCudaProbe(RecordedProbe):
    LIBRARIES: ClassVar[dict[str, Any]] = {"cudnn": None, "triton": False}

    def nvml(self) -> dict[str, Any]:
        return dict(self.facts.get("nvml", NOT_RECORDED))

    def nvml_device(self, index: int) -> dict[str, Any] | None:
        return self.device(index).get("nvml")

    def nvml_health(self, index: int) -> dict[str, Any] | None:
        return self.device(index).get("nvml_health")

    def nvidia_smi_topology(self) -> dict[str, Any]:
        return dict(self.facts.get("nvidia_smi", {"topo": None, "bus_ids": {}, "reason": "not recorded"}))
