"""The exception hierarchy. Every message names the thing, the constraint and the value seen."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class TorchHALError(Exception):
    """Base of every error torchhal raises on purpose."""


class ConfigurationError(TorchHALError, ValueError):
    """A setting (environment variable, argument, spec file) has an invalid value."""


class PluginError(TorchHALError):
    """A plugin could not be used. Raised only in strict mode; otherwise recorded in diagnostics."""

    def __init__(self, plugin: str, stage: str, reason: str) -> None:
        self.plugin, self.stage, self.reason = plugin, stage, reason
        super().__init__(f"plugin {plugin!r} failed at {stage}: {reason}")


class DeviceNotFoundError(TorchHALError, LookupError):
    """A device id that no adapter discovered."""

    def __init__(self, requested: str, available: Iterable[str]) -> None:
        self.requested, self.available = requested, tuple(available)
        listing = ", ".join(self.available) or "none"
        super().__init__(f"no device {requested!r}; devices found: {listing}")


class NoDeviceMatchesError(TorchHALError, LookupError):
    """No device meets a DeviceRequirements; `failures` maps device id to what it failed."""

    def __init__(self, requirements: object, failures: Mapping[str, Iterable[str]]) -> None:
        self.requirements = requirements
        self.failures = {dev: tuple(reasons) for dev, reasons in failures.items()}
        lines = [f"  {dev}: {'; '.join(reasons)}" for dev, reasons in self.failures.items()]
        super().__init__(f"no device meets {requirements}:\n" + ("\n".join(lines) or "  (no devices found)"))


class InvalidArgumentError(TorchHALError, ValueError):
    """Arguments that violate an op's contract (rank, shapes, dtypes that must agree)."""


class UnsupportedError(TorchHALError, TypeError):
    """An op, dtype, layout or device that nothing available supports."""


class CallDeclined(UnsupportedError):
    """A candidate's refusal of one call for a reason its signature cannot show (a process-wide mode
    such as torch's deterministic algorithms, a size the signature buckets with others): the
    registry runs the next candidate for that call, counted and said once, and demotes nothing."""


class UnknownOpError(TorchHALError, LookupError):
    """An op name the kernel registry does not define."""

    def __init__(self, op: str, known: Iterable[str]) -> None:
        self.op = op
        # an op name is a string; anything else (a tensor passed where the name goes) is named by
        # its type, not printed whole
        named = repr(op) if isinstance(op, str) else f"of type {type(op).__name__} (op names are strings)"
        super().__init__(f"unknown op {named}; defined ops: {', '.join(sorted(known)) or 'none'}")


class KernelFailedError(TorchHALError, RuntimeError):
    """Every candidate of an op raised, the reference included."""


class DeviceOutOfMemoryError(TorchHALError, MemoryError):
    """An allocation beyond a device's capacity."""

    def __init__(self, device: str, requested: int, used: int, capacity: int) -> None:
        self.device, self.requested, self.used, self.capacity = device, requested, used, capacity
        super().__init__(
            f"{device}: out of memory: requested {requested} bytes with {used} of "
            f"{capacity} bytes in use ({capacity - used} free)"
        )


class CollectiveError(TorchHALError, RuntimeError):
    """A collective failed, timed out or was given inconsistent arguments."""
