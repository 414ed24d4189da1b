"""RecordedProbe: the base of every adapter's replay probe, for tests on machines without the hardware.

A vendor's live probe reads its runtime (torch's device properties, a management library) into
plain dicts; a recording is those dicts as JSON. Replaying them exercises every path of an
adapter's translation logic on a CPU-only machine. What was not recorded is reported absent,
never filled in (a fact no adapter can do without, such as `available`, is an error naming it);
actions that need a real device (synchronize, timing events) are refused.
Subclasses add their management library's readers and name the `LIBRARIES` defaults.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from torchhal.hal_core.errors import InvalidArgumentError, UnsupportedError

P = TypeVar("P", bound="RecordedProbe")


class RecordedProbe:
    LIBRARIES: ClassVar[dict[str, Any]] = {"triton": False}  # when the recording names none

    def __init__(self, facts: dict[str, Any]) -> None:
        self.facts = facts
        self.source = str(facts.get("source", "unnamed recording"))

    @classmethod
    def from_file(cls: type[P], path: str | Path) -> P:
        try:
            facts = json.loads(Path(path).read_text())
        except ValueError as exc:
            raise InvalidArgumentError(f"recorded probe {str(path)!r}: not JSON: {exc}") from None
        if not isinstance(facts, dict):
            raise InvalidArgumentError(
                f"recorded probe {str(path)!r}: must hold a JSON object, got {type(facts).__name__}"
            )
        return cls(facts)

    def _recorded(self, facts: dict[str, Any], key: str, where: str = "") -> Any:
        """`facts[key]`, or an error naming the recording and the fact it lacks: facts an
        adapter cannot do without (is the runtime there, its version, a device's properties)."""
        try:
            return facts[key]
        except KeyError:
            raise InvalidArgumentError(
                f"recorded probe {self.source!r}: no {key!r} recorded{where}"
            ) from None

    def device(self, index: int) -> dict[str, Any]:
        devices = self.facts.get("devices", [])
        if not 0 <= index < len(devices):
            raise InvalidArgumentError(
                f"recorded probe {self.source!r}: no device {index}; it has {len(devices)}"
            )
        return dict(devices[index])

    def runtime(self) -> dict[str, Any]:
        return dict(self._recorded(self.facts, "runtime"))

    def available(self) -> bool:
        return bool(self._recorded(self.facts, "available"))

    def libraries(self) -> dict[str, Any]:
        return dict(self.facts.get("libraries", self.LIBRARIES))

    def device_count(self) -> int:
        return len(self.facts.get("devices", []))

    def properties(self, index: int) -> dict[str, Any]:
        return dict(self._recorded(self.device(index), "properties", f" for device {index}"))

    def can_access_peer(self, index: int, peer: int) -> bool:
        return [index, peer] in self.facts.get("peer_access", [])

    def memory(self, index: int) -> dict[str, int]:
        memory = self.device(index).get("memory")
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

    def capturing(self, index: int) -> bool:
        """A replay of facts runs nothing, so captures nothing."""
        return False

    def graph_replay(self, index: int, work: Callable[[], object]) -> Callable[[], None]:
        raise UnsupportedError(
            f"recorded probe {self.source!r}: replays facts; device {index} captures no graphs"
        )
