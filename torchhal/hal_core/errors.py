"""The exception hierarchy. Every message names the thing, the constraint and the value seen."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError
    from pydantic_core import ErrorDetails

# what pydantic reads as a bool, said where a value was not one
BOOL_WORDS = " (on: 1, true, yes, on; off: 0, false, no, off)"


class TorchHALError(Exception):
    """Base of every error torchhal raises on purpose."""


class ConfigurationError(TorchHALError, ValueError):
    """A setting (environment variable, argument, spec file) has an invalid value."""

    @classmethod
    def from_validation(
        cls, what: str, exc: ValidationError, seen: Callable[[ErrorDetails], str]
    ) -> ConfigurationError:
        """pydantic's refusal as one line: `seen(error)` names the field and the value, pydantic's
        message what it must be (its own text spreads over lines and ends with a URL)."""
        problems = "; ".join(
            f"{seen(err)}: {err['msg'].removeprefix('Value error, ')}"
            + (BOOL_WORDS if err["type"] == "bool_parsing" else "")
            for err in exc.errors()
        )
        return cls(f"{what}: {problems}")


def _plugin_failure(plugin: str, stage: str, reason: str) -> str:
    return f"plugin {plugin!r} failed at {stage}: {reason}"


class PluginError(TorchHALError):
    """A plugin could not be used. Raised only in strict mode; otherwise recorded in diagnostics."""

    def __init__(self, plugin: str, stage: str, reason: str) -> None:
        self.plugin, self.stage, self.reason = plugin, stage, reason
        super().__init__(_plugin_failure(plugin, stage, reason))


class DeviceNotFoundError(TorchHALError, LookupError):
    """A device id that no adapter discovered. `failed_plugins` (plugin, stage, reason) are named
    in the message: a plugin that failed (a bad setting of its own) is why its devices are missing."""

    def __init__(
        self, requested: str, available: Iterable[str], failed_plugins: Iterable[tuple[str, str, str]] = ()
    ) -> None:
        self.requested, self.available = requested, tuple(available)
        self.failed_plugins = tuple(failed_plugins)
        listing = ", ".join(self.available) or "none"
        message = f"no device {requested!r}; devices found: {listing}"
        if self.failed_plugins:
            failures = "; ".join(_plugin_failure(*failed) for failed in self.failed_plugins)
            message += f"; a failed plugin's devices are missing: {failures}"
        super().__init__(message)


class NoDeviceMatchesError(TorchHALError, LookupError):
    """No device meets a DeviceRequirements; `failures` maps device id to what it failed."""

    def __init__(self, requirements: object, failures: Mapping[str, Iterable[str]]) -> None:
        self.requirements = requirements
        self.failures = {dev: tuple(reasons) for dev, reasons in failures.items()}
        lines = [f"  {dev}: {'; '.join(reasons)}" for dev, reasons in self.failures.items()]
        super().__init__(
            f"no device meets the requirements ({requirements}):\n"
            + ("\n".join(lines) or "  (no devices found)")
        )


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
