"""Argument rules the Communicator, Islands and group creation share: below all three, so no cycle."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch
import torch.distributed as dist

from torchhal.hal_core.errors import InvalidArgumentError

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _not_differentiable(collective: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run `collective` under torch.no_grad() when its tensor requires grad (the rule is in the
    Communicator docstring). Other tensors skip it: entering no_grad costs microseconds a call,
    and autograd records nothing for them anyway."""

    @functools.wraps(collective)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        tensor = args[1] if len(args) > 1 else kwargs.get("tensor")  # args[0] is self
        if getattr(tensor, "requires_grad", False) and torch.is_grad_enabled():
            with torch.no_grad():
                return collective(*args, **kwargs)
        return collective(*args, **kwargs)

    return run


def as_integer(value: object) -> int | None:
    """`value` as an int where it is an integer (numpy's and one-element tensors too, through
    operator.index), else None. Bools are refused: they pass as 0 and 1 but are never meant as
    ranks or sizes."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]  # any object: TypeError is the answer
    except TypeError:
        return None


def _check_op(name: str, op: str, tensor: torch.Tensor) -> None:
    if not isinstance(op, str) or op not in _REDUCE_OPS:  # op=[]: "unhashable type" from the lookup
        raise InvalidArgumentError(f"{name}: op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    if op == "avg" and not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        raise InvalidArgumentError(
            f"{name}: op 'avg' needs a floating-point tensor (an integer mean would be truncated), "
            f"got {tensor.dtype}"
        )
