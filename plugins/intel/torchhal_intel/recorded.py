"""RecordedXpuProbe: replays facts recorded by `probe.record` (or sourced by hand) from JSON.

It answers exactly what `XpuProbe` answers, so every adapter path runs on a machine without
an Intel GPU. What was not recorded is reported absent, never filled in; actions that need a
device (synchronize, timing events) are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torchhal.hal_core import InvalidArgumentError, UnsupportedError


class RecordedXpuProbe:
    def __init__(self, facts: dict[str, Any]) -> None:
        self.facts = facts
        self.source = str(facts.get("source", "unnamed recording"))

    @classmethod
    def from_file(cls, path: str | Path) -> RecordedXpuProbe:
        return cls(json.loads(Path(path).read_text()))

    def _device(self, index: int) -> dict[str, Any]:
        devices = self.facts.get("devices", [])
        if not 0 <= index < len(devices):
            raise InvalidArgumentError(
                f"recorded probe {self.source!r}: no device {index}; it has {len(devices)}"
            )
        return dict(devices[index])

    def runtime(self) -> dict[str, Any]:
        return dict(self.facts["runtime"])

    def available(self) -> bool:
        return bool(self.facts["available"])

    def libraries(self) -> dict[str, Any]:
        return dict(self.facts.get("libraries", {"triton": False, "graphs": False}))

    def device_count(self) -> int:
        return len(self.facts.get("devices", []))

    def properties(self, index: int) -> dict[str, Any]:
        return dict(self._device(index)["properties"])

    def can_access_peer(self, index: int, peer: int) -> bool:
        return [index, peer] in self.facts.get("peer_access", [])

    def memory(self, index: int) -> dict[str, int]:
        memory = self._device(index).get("memory")
        if memory is None:
            raise UnsupportedError(
                f"recorded probe {self.source!r}: memory of device {index} was not recorded"
            )
        return dict(memory)

    def synchronize(self, index: int) -> None:
        raise UnsupportedError(
            f"recorded probe {self.source!r}: replays facts; device {index} cannot synchronize"
        )

    def record_event(self, index: int) -> Any:
        raise UnsupportedError(
            f"recorded probe {self.source!r}: replays facts; device {index} records no events"
        )
