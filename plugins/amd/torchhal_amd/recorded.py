"""RecordedRocmProbe: replays facts recorded by `probe.record` (or sourced by hand) from JSON.

It answers exactly what `RocmProbe` answers, so every adapter path runs on a machine without
an AMD GPU; the shared replay logic is `torchhal.hal_core.RecordedProbe`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torchhal.hal_core import RecordedProbe

NOT_RECORDED = {"available": False, "reason": "amdsmi facts were not recorded for this fixture"}


class RecordedRocmProbe(RecordedProbe):
    LIBRARIES: ClassVar[dict[str, Any]] = {"miopen": None, "triton": False}

    def amdsmi(self) -> dict[str, Any]:
        return dict(self.facts.get("amdsmi", NOT_RECORDED))

    def amdsmi_device(self, index: int) -> dict[str, Any] | None:
        return self.device(index).get("amdsmi")

    def amdsmi_health(self, index: int) -> dict[str, Any] | None:
        return self.device(index).get("amdsmi_health")

    def amdsmi_links(self, index: int) -> dict[str, Any] | None:
        return self.device(index).get("amdsmi_links")
