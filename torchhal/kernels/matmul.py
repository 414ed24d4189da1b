"""matmul(a, b) and its backward: the references are torch.matmul and the gradients torch's
autograd gives it; adapters add device-specific candidates.

The backward is a registry op like every other op's, so a device that charges or implements its
ops (the simulated ASIC) sees the two gradient matmuls, not only the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from torchhal.hal_core import InvalidArgumentError, KernelRegistry
from torchhal.kernels._checks import require_min_rank, require_same, require_tensor
from torchhal.kernels.autograd import AutogradSpec


class MatmulSignature(NamedTuple):
    dtype: torch.dtype
    a_dims: int
    b_dims: int


def signature(a: torch.Tensor, b: torch.Tensor) -> MatmulSignature:
    return _check("matmul", a, b)


def backward_signature(grad_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> MatmulSignature:
    sig = _check("matmul_backward", a, b)
    require_tensor("matmul_backward", "grad_out", grad_out)
    require_same("matmul_backward", "dtypes", grad_out=grad_out.dtype, a=a.dtype)
    require_same("matmul_backward", "devices", grad_out=grad_out.device, a=a.device)
    expected = output_shape(a.shape, b.shape)
    if tuple(grad_out.shape) != expected:
        raise InvalidArgumentError(
            f"matmul_backward: grad_out must have the product's shape {expected}, got {tuple(grad_out.shape)}"
        )
    return sig


def _check(op: str, a: torch.Tensor, b: torch.Tensor) -> MatmulSignature:
    require_tensor(op, "a", a)
    require_tensor(op, "b", b)
    require_same(op, "dtypes", a=a.dtype, b=b.dtype)
    require_same(op, "devices", a=a.device, b=b.device)
    require_min_rank(op, "a", a, 1)
    require_min_rank(op, "b", b, 1)
    if a.shape[-1] != b.shape[-2 if b.dim() > 1 else 0]:
        raise InvalidArgumentError(
            f"{op}: inner dimensions must agree, got a {tuple(a.shape)} and b {tuple(b.shape)}"
        )
    try:
        output_shape(a.shape, b.shape)
    except RuntimeError:
        raise InvalidArgumentError(
            f"{op}: batch dimensions must broadcast, got a {tuple(a.shape)} and b {tuple(b.shape)}"
        ) from None
    return MatmulSignature(a.dtype, a.dim(), b.dim())


def output_shape(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """The shape of torch.matmul(a, b) (inner dimensions already checked)."""
    if len(b) == 1:
        return tuple(a[:-1])
    if len(a) == 1:
        return (*b[:-2], b[-1])
    # torch.broadcast_shapes is unannotated
    batch = torch.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2]))  # type: ignore[no-untyped-call]
    return (*batch, a[-2], b[-1])


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


def reference_backward(
    grad_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db): grad_out @ bᵀ and aᵀ @ grad_out, with torch.matmul's vector operands and
    broadcast batch dimensions reduced back to a's and b's shapes (written out: a custom op's
    implementation runs below autograd, so it cannot ask autograd)."""
    if a.dim() == 1 and b.dim() == 1:  # a dot product
        da, db = grad_out * b, grad_out * a
    elif b.dim() == 1:  # (..., m, k) @ (k,)
        da = grad_out.unsqueeze(-1) * b
        db = a.flatten(0, -2).mT @ grad_out.reshape(-1)
    elif a.dim() == 1:  # (k,) @ (..., k, n)
        g = grad_out.unsqueeze(-2)
        da = (g @ b.mT).flatten(0, -2).sum(0)
        db = a.unsqueeze(-1) * g
    else:
        da = (grad_out @ b.mT).sum_to_size(a.shape)
        if b.dim() == 2:  # a's batch dims fold into its rows
            db = a.flatten(0, -2).mT @ grad_out.flatten(0, -2)
        else:
            db = (a.mT @ grad_out).sum_to_size(b.shape)
    return da.contiguous(), db.contiguous()


def _fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check("matmul", a, b)  # under torch.compile the fake meets bad input first
    return a.new_empty(output_shape(a.shape, b.shape))


def _backward_fake(
    grad_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return a.new_empty(a.shape), b.new_empty(b.shape)


def _context(inputs: Sequence[Any], results: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    a, b = inputs
    return a, b


AUTOGRAD = AutogradSpec(
    op="matmul",
    forward="matmul",
    backward="matmul_backward",
    forward_fake=_fake,
    backward_fake=_backward_fake,
    differentiable=(0, 1),
    autocast=(0, 1),  # autocast casts them, as it does torch.matmul's inputs
    aten_op="aten::matmul",
    context=_context,
    backward_reference=reference_backward,
)


def register(registry: KernelRegistry) -> None:
    registry.define_op("matmul", reference, signature=signature, doc="a @ b, as torch.matmul")
    registry.define_op(
        "matmul_backward", reference_backward, signature=backward_signature, doc="(da, db) of matmul"
    )
