"""Per-device simulated state: a clock that ops advance and a ledger of device memory.

Both are shared by the adapter (allocation, copies, timers) and the kernels (op costs), and
both are thread-safe: ops from several threads may charge one device.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import TYPE_CHECKING, NamedTuple

from torchhal.hal_core import DeviceOutOfMemoryError, InvalidArgumentError

if TYPE_CHECKING:
    import torch


class SimulatedClock:
    """Simulated device time in seconds. Only modelled costs move it, so it never goes back."""

    def __init__(self) -> None:
        self._now = 0.0
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        """Add an op's simulated duration; returns the new time."""
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            raise InvalidArgumentError(
                f"simulated clock: can only advance by a finite time >= 0 s, got {seconds!r}"
            )
        with self._lock:
            self._now += seconds
            return self._now


class MemoryLedger:
    """Bytes held on one simulated device. Tensors are charged when made and credited back when
    torch frees their storage (a finalizer on the storage, so views keep the charge alive)."""

    def __init__(self, device: str, capacity: int) -> None:
        self.device = device
        self.capacity = capacity
        self._used = 0
        self._peak = 0
        self._lock = threading.RLock()  # re-entrant: a finalizer may run while this thread holds it
        # the storages charged here, while torch holds them: what is on this device (`holds`)
        self._held: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()

    @property
    def used(self) -> int:
        return self._used

    @property
    def peak(self) -> int:
        return self._peak

    def charge(self, nbytes: int) -> None:
        """Take `nbytes`, or raise DeviceOutOfMemoryError and leave the ledger as it was."""
        if nbytes < 0:
            raise InvalidArgumentError(f"{self.device}: cannot charge a negative size, got {nbytes} bytes")
        with self._lock:
            if self._used + nbytes > self.capacity:
                raise DeviceOutOfMemoryError(self.device, nbytes, self._used, self.capacity)
            self._used += nbytes
            self._peak = max(self._peak, self._used)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._used

    def release_with(self, tensor: torch.Tensor, nbytes: int) -> None:
        """Give `nbytes` back when the tensor's storage is freed; until then the storage is on
        this device (`holds`)."""
        storage = tensor.untyped_storage()
        finalizer = weakref.finalize(storage, self.release, nbytes)
        finalizer.atexit = False  # nothing to give back once the process ends
        with self._lock:
            self._held.add(storage)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether the tensor's storage was charged to this ledger (allocated on this device or
        an op's result there, or a view of one) and is still alive."""
        import torch

        if tensor.layout != torch.strided:
            return False  # no plain storage (sparse, mkldnn): never charged here
        with self._lock:
            return tensor.untyped_storage() in self._held

    def track(self, *tensors: torch.Tensor) -> None:
        """Charge tensors that already exist for their storage: all of them at once, or none
        (DeviceOutOfMemoryError, the ledger as it was)."""
        self.settle(0, *tensors)

    def settle(self, reserved: int, *tensors: torch.Tensor) -> int:
        """Exchange `reserved` bytes, charged before an op ran (so that results beyond capacity
        are refused before they are computed), for its results' storage; returns what they take.
        All at once, or nothing: DeviceOutOfMemoryError (the results do not fit beside what else
        is held) leaves the reservation charged, for the caller to release."""
        sizes = [t.untyped_storage().nbytes() for t in tensors]
        needed = sum(sizes)
        with self._lock:
            if reserved < 0 or reserved > self._used:
                raise InvalidArgumentError(
                    f"{self.device}: a reservation must be between 0 and the {self._used} bytes "
                    f"charged, got {reserved} bytes"
                )
            others = self._used - reserved
            if others + needed > self.capacity:
                raise DeviceOutOfMemoryError(self.device, needed, others, self.capacity)
            self._used = others + needed
            self._peak = max(self._peak, self._used)
            for tensor, nbytes in zip(tensors, sizes, strict=True):
                self.release_with(tensor, nbytes)
        return needed


class SimulatedMark(NamedTuple):
    """A reading of one device's clock: the clock itself travels with it, so two devices' marks
    (or two HALs' devices of one id) are never subtracted."""

    device: str
    clock: SimulatedClock
    seconds: float


class SimulatedTimer:
    """A DeviceTimer whose marks read the simulated clock, so elapsed time is simulated time."""

    def __init__(self, clock: SimulatedClock, device: str) -> None:
        self._clock = clock
        self._device = device

    def mark(self) -> object:
        return SimulatedMark(self._device, self._clock, self._clock.now())

    def elapsed_ms(self, start: object, end: object) -> float:
        if not (isinstance(start, SimulatedMark) and isinstance(end, SimulatedMark)):
            raise InvalidArgumentError(
                f"simulated timer of {self._device}: marks must come from mark(), got "
                f"{type(start).__name__} and {type(end).__name__}"
            )
        for which, mark in (("start", start), ("end", end)):
            if mark.clock is not self._clock:
                whose = f"another {mark.device}'s clock" if mark.device == self._device else mark.device
                raise InvalidArgumentError(
                    f"simulated timer of {self._device}: {which} is a mark of {whose}, not of "
                    f"{self._device}: each device keeps its own simulated time"
                )
        return (end.seconds - start.seconds) * 1e3


class DeviceState(NamedTuple):
    """Everything simulated about one device."""

    device: str
    clock: SimulatedClock
    ledger: MemoryLedger

    @classmethod
    def create(cls, device: str, capacity: int) -> DeviceState:
        return cls(device, SimulatedClock(), MemoryLedger(device, capacity))
