"""Measured selection: time the valid candidates once per (device, signature), keep the winner.

Used where timing is real and cheap to get right (devices with timing events that are not
simulated, unless told otherwise). Winners persist on disk per device fingerprint, beside the
measured profiles, so a new process does not measure again.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from torchhal.hal_core import telemetry
from torchhal.hal_core.capabilities import Feature

if TYPE_CHECKING:
    from torchhal.hal_core.device import Device

log = telemetry.get_logger("torchhal.tuning")
TuneMode = Literal["off", "on", "auto"]
BATCHES, CALLS_PER_BATCH = 3, 5


class Tuner:
    def __init__(self, cache_dir: Path | None, mode: TuneMode = "auto") -> None:
        self.mode = mode
        self._dir = None if cache_dir is None else cache_dir / "selections"
        self._winners: dict[str, dict[str, str]] = {}  # fingerprint -> key -> qualified name
        self._lock = threading.Lock()

    def wants(self, device: Device) -> bool:
        if self.mode == "auto":
            caps = device.capabilities
            return Feature.DEVICE_EVENTS in caps.features and not caps.simulated
        return self.mode == "on"

    def recall(self, device: Device, op: str, sig: Hashable) -> str | None:
        return self._table(device).get(_key(op, sig))

    def remember(self, device: Device, op: str, sig: Hashable, winner: str) -> None:
        from torchhal.hal_core.profile import fingerprint, write_cached

        with self._lock:
            table = self._table(device)
            table[_key(op, sig)] = winner
            if self._dir is not None:
                write_cached(
                    self._dir / f"{fingerprint(device)}.json", json.dumps(table, indent=1, sort_keys=True)
                )

    def measure(
        self,
        device: Device,
        candidates: Sequence[tuple[str, Callable[..., Any]]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> list[tuple[str, float]]:
        """Milliseconds per call for each candidate, fastest first; one that raises gets inf."""
        timings = []
        for name, fn in candidates:
            try:
                timings.append((name, _ms_per_call(device, fn, args, kwargs)))
            except Exception as exc:
                log.warning("candidate raised while being measured", candidate=name, error=repr(exc))
                timings.append((name, math.inf))
        return sorted(timings, key=lambda t: t[1])

    def _table(self, device: Device) -> dict[str, str]:
        from torchhal.hal_core.profile import fingerprint

        fp = fingerprint(device)
        if fp not in self._winners:
            path = None if self._dir is None else self._dir / f"{fp}.json"
            self._winners[fp] = _read_winners(path) if path is not None and path.exists() else {}
        return self._winners[fp]


def _read_winners(path: Path) -> dict[str, str]:
    """The persisted winners, or none where the file is unusable (torn, hand-edited): then every
    selection is measured again and the file rewritten, which is logged, never a crash."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    else:
        if isinstance(table, dict) and all(isinstance(v, str) for v in table.values()):
            return table
        reason = "not an object of op|signature -> candidate names"
    log.warning("cached kernel selections unusable; measuring again", path=str(path), reason=reason)
    return {}


def _key(op: str, sig: Hashable) -> str:
    return f"{op}|{sig!r}"


def _ms_per_call(
    device: Device, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> float:
    fn(*args, **kwargs)  # warm-up: compilation and autotuning stay out of the figure
    timer = device.timer()
    best = math.inf
    for _ in range(BATCHES):
        start = timer.mark()
        for _ in range(CALLS_PER_BATCH):
            fn(*args, **kwargs)
        best = min(best, timer.elapsed_ms(start, timer.mark()) / CALLS_PER_BATCH)
    return best
