"""RecordedXpuProbe: replays facts recorded by `probe.record` (or sourced by hand) from JSON.

It answers exactly what `XpuProbe` answers, so every adapter path runs on a machine without
an Intel GPU; the shared replay logic is `torchhal.hal_core.RecordedProbe`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torchhal.hal_core import RecordedProbe


class RecordedXpuProbe(RecordedProbe):
    LIBRARIES: ClassVar[dict[str, Any]] = {"triton": False, "graphs": False}
