"""matmul(a, b): the reference is torch.matmul; adapters add device-specific candidates."""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchhal.hal_core import KernelRegistry
from torchhal.kernels._checks import require_same, require_tensor


class MatmulSignature(NamedTuple):
    dtype: torch.dtype
    a_dims: int
    b_dims: int


def signature(a: torch.Tensor, b: torch.Tensor) -> MatmulSignature:
    require_tensor("matmul", "a", a)
    require_tensor("matmul", "b", b)
    require_same("matmul", "dtypes", a=a.dtype, b=b.dtype)
    require_same("matmul", "devices", a=a.device, b=b.device)
    if a.dim() < 1 or b.dim() < 1 or a.shape[-1] != b.shape[-2 if b.dim() > 1 else 0]:
        from torchhal.hal_core import InvalidArgumentError

        raise InvalidArgumentError(
            f"matmul: inner dimensions must agree, got a {tuple(a.shape)} and b {tuple(b.shape)}"
        )
    return MatmulSignature(a.dtype, a.dim(), b.dim())


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


def register(registry: KernelRegistry) -> None:
    registry.define_op("matmul", reference, signature=signature, doc="a @ b, as torch.matmul")
