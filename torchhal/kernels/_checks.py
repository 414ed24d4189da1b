"""Argument checks shared by the ops' signature functions. Messages name op, thing and value."""

from __future__ import annotations

import torch

from torchhal.hal_core import InvalidArgumentError, UnsupportedError
from torchhal.hal_core.kernels import is_finite_number

PROVIDER = "torchhal"  # provider name of the built-in candidates


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
        raise InvalidArgumentError(f"{op}: eps must be a finite number >= 0, got {eps!r}")
