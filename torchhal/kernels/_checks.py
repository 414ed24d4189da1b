"""Argument checks shared by the ops' signature functions. Messages name op, thing and value."""

from __future__ import annotations

import numbers
from collections.abc import Callable

import torch

from torchhal.hal_core import InvalidArgumentError, UnsupportedError, telemetry
from torchhal.hal_core.kernels import is_finite_number

PROVIDER = "torchhal"  # provider name of the built-in candidates

log = telemetry.get_logger("torchhal.kernels.checks")
# Device types whose value checks `queue_device_assert` leaves to the host -> whether that read
# costs a sync (counted): the CPU's is free; a device type found without torch._assert_async is added.
HOST_READ: dict[str, bool] = {"cpu": False}
ASSERT_MESSAGE_LIMIT = 254  # characters: CUDA's torch._assert_async refuses a longer message


def require_tensor(op: str, name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if value.is_nested:  # torch's own error for its missing sizes names neither op nor argument
        raise UnsupportedError(f"{op}: {name} is a nested tensor; the op takes strided tensors only")
    if value.layout is not torch.strided:  # sparse or mkldnn: no strides for the kernels to read
        raise UnsupportedError(f"{op}: {name} has layout {value.layout}; the op takes strided tensors only")
    return value


def require_rank(op: str, name: str, t: torch.Tensor, rank: int) -> None:
    if t.dim() != rank:
        raise InvalidArgumentError(f"{op}: {name} must have {rank} dimensions, got shape {tuple(t.shape)}")


def require_min_rank(op: str, name: str, t: torch.Tensor, rank: int) -> None:
    if t.dim() < rank:
        dims = "dimension" if rank == 1 else "dimensions"
        raise InvalidArgumentError(
            f"{op}: {name} must have at least {rank} {dims}, got shape {tuple(t.shape)}"
        )


def require_same(op: str, what: str, **values: object) -> None:
    """All values equal (compared, not hashed: under torch.compile sizes are SymInts, which do not hash)."""
    first, *rest = values.values()
    if any(v != first for v in rest):
        seen = ", ".join(f"{k}={v}" for k, v in values.items())
        raise InvalidArgumentError(f"{op}: {what} must agree, got {seen}")


def require_eps(op: str, eps: object) -> None:
    """A norm's epsilon: a finite number >= 0 (a tensor here would lose its gradient)."""
    if not is_finite_number(eps) or eps < 0:  # type: ignore[operator]
        raise InvalidArgumentError(
            f"{op}: eps must be a finite Python float or int >= 0, got {seen_number(eps)}"
        )


def seen_number(value: object) -> str:
    """`value` as an error shows it, with the conversion a number of another library needs (a
    numpy float is a real number, but the ops take Python's, as their kernels' arguments)."""
    if isinstance(value, numbers.Real) and not isinstance(value, (int, float)):
        kind = type(value)
        return f"{value!r} (a {kind.__module__}.{kind.__qualname__}: pass float() or int() of it)"
    return repr(value)


def queue_device_assert(
    device: torch.device, condition: Callable[[], torch.Tensor], message: str, counter: str
) -> bool:
    """Check tensor values without a host sync: queue `condition()` (a one-element tensor, nonzero
    when the values are valid) as `torch._assert_async(ok, message)` (message cut to the length
    CUDA takes), which fails at the next synchronisation as a device-side assert, and return True.
    Return False where the caller must read the values on the host instead (and can name the bad
    one): on the CPU, where that read is free, and on a device type without `_assert_async`
    (warned once, each read counted as `counter`)."""
    kind = device.type
    if kind not in HOST_READ:
        ok = condition()
        try:
            torch._assert_async(ok, message[:ASSERT_MESSAGE_LIMIT])
            return True
        except NotImplementedError as exc:
            HOST_READ[kind] = True
            log.warning(
                "no asynchronous device assert for this device type: tensor values are checked on the "
                "host (a sync per call, counted)",
                device_type=kind,
                counter=counter,
                error=repr(exc),
            )
    if HOST_READ[kind]:
        telemetry.count(counter, device_type=kind)
    return False
