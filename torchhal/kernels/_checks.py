"""Argument checks shared by the ops' signature functions. Messages name op, thing and value."""

from __future__ import annotations

import math

import torch

from torchhal.hal_core import InvalidArgumentError, UnsupportedError

PROVIDER = "torchhal"  # provider name of the built-in candidates


def require_tensor(op: str, name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if value.is_nested:  # torch's own error for its missing sizes names neither op nor argument
        raise UnsupportedError(f"{op}: {name} is a nested tensor; the op takes strided tensors only")
    return value


def require_rank(op: str, name: str, t: torch.Tensor, rank: int) -> None:
    if t.dim() != rank:
        raise InvalidArgumentError(f"{op}: {name} must have {rank} dimensions, got shape {tuple(t.shape)}")


def require_same(op: str, what: str, **values: object) -> None:
    distinct = set(values.values())
    if len(distinct) > 1:
        seen = ", ".join(f"{k}={v}" for k, v in values.items())
        raise InvalidArgumentError(f"{op}: {what} must agree, got {seen}")


def require_eps(op: str, eps: object) -> None:
    """A norm's epsilon: a finite number >= 0 (a tensor here would lose its gradient)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not _finite_and_not_negative(eps):
        raise InvalidArgumentError(f"{op}: eps must be a finite number >= 0, got {eps!r}")


def _finite_and_not_negative(value: float) -> bool:
    try:
        return math.isfinite(value) and value >= 0
    except OverflowError:  # an int beyond the float range
        return False
