"""What every check shares: the adapter, its probe and discovery outcomes, its devices, randomness.

Probe, discovery, a first synchronize and kernel registration run at most once per conformance
run; their outcome (value or exception) is cached so the check that owns a step reports its
failure, and the checks that depend on it report "not applicable: blocked" instead of failing
again.
"""

from __future__ import annotations

import random
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from torchhal.hal_core import Device, DeviceCapabilities, KernelRegistry, VendorAdapter
from torchhal.hal_core.kernels import REFERENCE

if TYPE_CHECKING:
    import torch

    from torchhal.hal_core import ProbeResult
    from torchhal.hal_core.kernels import Candidate

T = TypeVar("T")


class NotApplicable(Exception):
    """Raised by a check that does not apply here; the message is the reason."""


class CheckFailed(Exception):
    """Raised by a check that found the adapter non-conforming; the message is the reason."""


class StepUnfinished(Exception):
    """A step asked for while an earlier call of it has not returned (its check ran out of time)."""


# What adapter code may raise that is its failure, not the run's end: a vendor runtime calling
# exit() is reported like any error (KeyboardInterrupt still stops the run).
ADAPTER_ERRORS = (Exception, SystemExit)


class _Once(Generic[T]):
    """Runs a step once and replays its value or its exception; while a first call hangs (its
    check timed out and left it running) later callers get StepUnfinished, not a second hang."""

    def __init__(self, step: Callable[[], T], name: str) -> None:
        self._step = step
        self._name = name  # the adapter call, as reasons name it: "discover()"
        self._started = False
        self._done = False
        self._value: T | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # a timed-out check's thread may reach the step with the next check

    def get(self) -> T:
        with self._lock:
            first = not self._started
            self._started = True
        if first:
            try:
                self._value = self._step()
            except ADAPTER_ERRORS as exc:
                self._error = exc
            self._done = True
        if not self._done:
            raise StepUnfinished(f"{self._name}: it has not returned (a call left running past a time limit)")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def failed(self) -> BaseException | None:
        try:
            self.get()
        except ADAPTER_ERRORS as exc:
            return exc
        return None


def describe(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit: {exc} (adapter code must not exit the process)"
    return f"{type(exc).__name__}: {exc}"


def where(exc: BaseException, depth: int = 3) -> str:
    """The innermost frames of a traceback outside the kit: where an adapter author should look."""
    return where_in(traceback.extract_tb(exc.__traceback__), depth)


_KIT = str(Path(__file__).parent)


def where_in(frames: Sequence[traceback.FrameSummary], depth: int = 3) -> str:
    """The innermost `depth` frames outside the kit, innermost first (all frames if none is outside)."""
    outside = [f for f in frames if not f.filename.startswith(_KIT)]
    where = " < ".join(f"{f.filename}:{f.lineno} in {f.name}" for f in reversed((outside or frames)[-depth:]))
    return f"at {where}" if outside else f"inside the conformance kit, at {where}"


def stuck_in(frames: Sequence[traceback.FrameSummary]) -> str:
    """The call the kit made that has not returned (the first frame below the kit's innermost),
    and where it is now: what a check past its time limit reports. The check thread's start-up
    frames (threading, above the kit's first) are left out: blocked in a C call the kit made
    itself, they were the only frames "outside the kit" and were named as the place to look."""
    first = next((i for i, f in enumerate(frames) if f.filename.startswith(_KIT)), 0)
    frames = frames[first:]
    below = [i + 1 for i, f in enumerate(frames) if f.filename.startswith(_KIT) and i + 1 < len(frames)]
    entry = frames[below[-1]].name if below else frames[-1].name
    return f"in {entry}() {where_in(frames)}"


class AdapterUnderTest:
    """One adapter being certified, with the outcomes of its probe, discovery and kernel registration."""

    def __init__(self, adapter: VendorAdapter, seed: int) -> None:
        self.adapter = adapter
        self.seed = seed
        self._probe = _Once(adapter.probe, "probe()")
        self._discovered = _Once(lambda: list(adapter.discover()), "discover()")
        self._synchronized = _Once(
            lambda: each_device(self.devices(), lambda device: device.synchronize()), "synchronize()"
        )
        self._kernels = _Once(self._register_kernels, "register_kernels()")

    # -- probe and discovery ------------------------------------------------------------------

    def probe(self) -> ProbeResult:
        """The adapter's first probe result; raises what probe() raised."""
        return self._probe.get()

    def require_available(self) -> ProbeResult:
        """The probe result when it says available; NotApplicable (absent or blocked) otherwise."""
        error = self._probe.failed()
        if error is not None:
            raise NotApplicable(f"blocked: probe() raised {describe(error)} (see adapter.probe)")
        result = self.probe()
        if not getattr(result, "available", False):
            raise NotApplicable(
                f"the adapter reports its runtime absent: {getattr(result, 'reason', result)!r}"
            )
        return result

    def discovered(self) -> list[Any]:
        """What discover() returned, unvalidated; raises what discover() raised."""
        self.require_available()
        return self._discovered.get()

    def devices(self) -> tuple[Device, ...]:
        """A Device per well-formed capability record, first of each id (duplicates fail adapter.discover)."""
        self.require_available()
        error = self._discovered.failed()
        if error is not None:
            raise NotApplicable(f"blocked: discover() raised {describe(error)} (see adapter.discover)")
        devices: dict[str, Device] = {}
        for caps in self.discovered():
            if isinstance(caps, DeviceCapabilities):
                device = Device(self.adapter, caps)
                devices.setdefault(device.id, device)
        if not devices:
            raise NotApplicable(
                "blocked: discover() returned no valid DeviceCapabilities (see adapter.discover)"
            )
        return tuple(devices.values())

    def device_summaries(self) -> list[dict[str, Any]]:
        """What the report lists per device; empty when discovery is absent or blocked."""
        try:
            devices = self.devices()
        except NotApplicable:
            return []
        return [
            {
                "id": d.id,
                "name": d.capabilities.name,
                "arch": d.capabilities.arch,
                "device_type": d.capabilities.device_type,
                "simulated": d.simulated,
            }
            for d in devices
        ]

    # -- synchronize -------------------------------------------------------------------------

    def synchronize_once(self) -> None:
        """synchronize() on every device, the first time asked; raises CheckFailed naming each
        device whose synchronize raised (device.synchronize reports it)."""
        self._synchronized.get()

    def require_synchronize(self) -> None:
        """For checks that wait on their devices' work: NotApplicable (blocked) when synchronize()
        failed, so a broken synchronize fails its own check and not every check that waits."""
        self.devices()
        error = self._synchronized.failed()
        if error is not None:
            raise NotApplicable(f"blocked: synchronize() failed: {error} (see device.synchronize)")

    # -- kernels -----------------------------------------------------------------------------

    def _register_kernels(self) -> KernelRegistry:
        """A fresh registry with the core ops (copied from a plugin-free HAL) plus this adapter's kernels."""
        from torchhal.hal_core.hal import HardwareAbstractionLayer
        from torchhal.hal_core.settings import Settings

        core = HardwareAbstractionLayer(
            settings=Settings.from_env().model_copy(update={"disable_plugin_autoload": True})
        )
        core.devices()  # discovery registers the core ops
        registry = KernelRegistry()
        for name in core.kernels.ops():
            opdef = core.kernels.op(name)
            registry.define_op(
                name,
                opdef.reference,
                signature=opdef.signature,
                doc=opdef.doc,
                memoize=opdef.memoize,
                examples=opdef.examples,
                reads_values_on=opdef.reads_values_on,
            )
        self.devices()
        self.adapter.register_kernels(registry)
        return registry

    def kernel_registry(self) -> KernelRegistry:
        """The registry after register_kernels; raises what register_kernels raised."""
        self.devices()
        return self._kernels.get()

    def kernel_candidates(self) -> list[Candidate]:
        """Every candidate the adapter registered (all non-reference candidates of the fresh registry)."""
        registry = self.kernel_registry()
        return [c for op in registry.ops() for c in registry.candidates(op) if c.name != REFERENCE]

    # -- randomness --------------------------------------------------------------------------

    def generator(self, salt: str, device: torch.device | None = None) -> torch.Generator:
        """A generator (on `device`, default the host) seeded from the run's seed and `salt`:
        fresh per run, replayable from the report's seed."""
        import torch

        seed = random.Random(f"{self.seed}:{salt}").getrandbits(63)
        return torch.Generator(device=device or "cpu").manual_seed(seed)


def each_device(devices: Sequence[Device], check: Callable[[Device], str | None]) -> str:
    """Run `check` on every device; fail listing every device's problem, else join the notes.

    A device the check does not apply to is a note and the next device is still checked (raising
    at once dropped the failures found before it and skipped the devices after); the check is
    not applicable only when it applies to no device."""
    problems, notes, not_applicable = [], [], []
    for device in devices:
        try:
            note = check(device)
        except CheckFailed as exc:
            problems.append(f"{device.id}: {exc}")
        except NotApplicable as exc:
            reason = str(exc) if str(exc).startswith(device.id) else f"{device.id}: {exc}"
            not_applicable.append(reason)
            notes.append(f"not applicable: {reason}")
        except ADAPTER_ERRORS as exc:
            problems.append(f"{device.id}: raised {describe(exc)} ({where(exc)})")
        else:
            if note:
                notes.append(f"{device.id}: {note}")
    if problems:
        raise CheckFailed("; ".join(problems))
    if devices and len(not_applicable) == len(devices):
        raise NotApplicable("; ".join(not_applicable))
    return "; ".join(notes)
