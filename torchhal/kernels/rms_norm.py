"""rms_norm(x, weight, eps) over the last dimension, and its backward: references, ATen, Triton.

y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 (fp64 for fp64 inputs) and rounded once
to x's dtype. The backward op `rms_norm_backward(dy, x, weight, eps) -> (dx, dweight)` recomputes
the row statistics from x, so the forward saves nothing but its inputs.

Layout: the Triton candidates index x (and dy) as (rows, hidden) with one row stride and unit
column stride, and need a unit-stride weight; other layouts are turned down (reason LAYOUT) and
the next candidate computes them. Outputs are always fresh contiguous tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from torchhal.hal_core import (
    DeviceCapabilities,
    InvalidArgumentError,
    KernelRegistry,
    RejectionReason,
    Unsupported,
)
from torchhal.kernels._checks import (
    PROVIDER,
    require_eps,
    require_min_rank,
    require_rank,
    require_same,
    require_tensor,
)
from torchhal.kernels.autograd import AutogradSpec
from torchhal.kernels.triton_rows import (
    RowLaunch,
    as_rows,
    block_unsupported,
    compute_dtype,
    layout_unsupported,
    require_floating,
    row_stride,
    triton_unsupported,
    unbound,
    unit_stride,
)


class RMSNormSignature(NamedTuple):
    dtype: torch.dtype
    hidden: int
    rows: bool  # every row tensor indexes as (rows, hidden) and weight has unit stride


def _check(op: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    require_eps(op, eps)
    require_tensor(op, "x", x)
    require_tensor(op, "weight", weight)
    require_rank(op, "weight", weight, 1)
    require_min_rank(op, "x", x, 1)
    if x.shape[-1] != weight.shape[0]:
        raise InvalidArgumentError(
            f"{op}: x's last dimension must equal weight's length {weight.shape[0]}, "
            f"got x shape {tuple(x.shape)}"
        )
    require_floating(op, "x", x)
    require_same(op, "dtypes", x=x.dtype, weight=weight.dtype)
    require_same(op, "devices", x=x.device, weight=weight.device)


def _layout(weight: torch.Tensor, *rows: torch.Tensor) -> bool:
    return unit_stride(weight) and all(row_stride(t) is not None for t in rows)


def signature(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> RMSNormSignature:
    _check("rms_norm", x, weight, eps)
    return RMSNormSignature(x.dtype, weight.shape[0], _layout(weight, x))


def backward_signature(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> RMSNormSignature:
    _check("rms_norm_backward", x, weight, eps)
    require_tensor("rms_norm_backward", "dy", dy)
    require_same("rms_norm_backward", "dy and x shapes", dy=tuple(dy.shape), x=tuple(x.shape))
    require_same("rms_norm_backward", "dtypes", dy=dy.dtype, x=x.dtype)
    require_same("rms_norm_backward", "devices", dy=dy.device, x=x.device)
    return RMSNormSignature(x.dtype, weight.shape[0], _layout(weight, x, dy))


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Normalise and scale in fp32 (fp64 for fp64), return x's dtype."""
    ct = compute_dtype(x.dtype)
    x32 = x.to(ct)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(ct)).to(x.dtype).contiguous()


def reference_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * weight; dweight = sum over rows of dy * xhat."""
    ct = compute_dtype(x.dtype)
    x32, dy32 = x.to(ct), dy.to(ct)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    xhat = x32 * rstd
    g = dy32 * weight.to(ct)
    dx = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd
    dweight = as_rows(dy32 * xhat).sum(0)
    return dx.to(x.dtype).contiguous(), dweight.to(weight.dtype)


def aten(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """PyTorch's fused rms_norm (torch >= 2.4), computing in fp32 as the reference does."""
    ct = compute_dtype(x.dtype)
    y = torch.nn.functional.rms_norm(x.to(ct), (weight.shape[0],), weight.to(ct), eps)
    return y.to(x.dtype).contiguous()


def aten_supports(caps: DeviceCapabilities, sig: RMSNormSignature) -> Unsupported | None:
    if not hasattr(torch.nn.functional, "rms_norm"):
        return Unsupported(RejectionReason.FEATURE, f"torch {torch.__version__} has no F.rms_norm")
    return None


def triton_supports(caps: DeviceCapabilities, sig: RMSNormSignature) -> Unsupported | None:
    verdict = triton_unsupported(caps, sig.dtype) or block_unsupported(sig.hidden)
    return verdict or layout_unsupported(sig.rows)


def _triton_forward(caps: DeviceCapabilities) -> Callable[..., torch.Tensor]:
    from torchhal.kernels import triton_norms

    return functools.partial(triton_norms.rms_norm_forward, RowLaunch.from_caps(caps))


def _triton_backward(caps: DeviceCapabilities) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    from torchhal.kernels import triton_norms

    return functools.partial(triton_norms.rms_norm_backward, RowLaunch.from_caps(caps))


def _fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check("rms_norm", x, weight, eps)  # under torch.compile the fake meets bad input first
    return x.new_empty(x.shape)


def _backward_fake(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _context(inputs: Sequence[Any], results: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    x, weight, eps = inputs
    return x, weight, eps


AUTOGRAD = AutogradSpec(
    op="rms_norm",
    forward="rms_norm",
    backward="rms_norm_backward",
    forward_fake=_fake,
    backward_fake=_backward_fake,
    differentiable=(0, 1),
    context=_context,
    autocast_fp32=(0, 1),  # as torch's autocast runs F.rms_norm on CUDA and XPU (torch 2.13; not 2.11)
    aten_op="aten::rms_norm",
    backward_reference=reference_backward,
)


def register(registry: KernelRegistry) -> None:
    registry.define_op("rms_norm", reference, signature=signature, doc="RMSNorm over the last dimension")
    registry.register("rms_norm", "aten", aten, provider=PROVIDER, supports=aten_supports, priority=10)
    registry.register(
        "rms_norm", "triton", unbound, provider=PROVIDER, supports=triton_supports, priority=20,
        bind=_triton_forward,
    )  # fmt: skip
    registry.define_op(
        "rms_norm_backward", reference_backward, signature=backward_signature, doc="(dx, dweight) of rms_norm"
    )
    registry.register(
        "rms_norm_backward", "triton", unbound, provider=PROVIDER, supports=triton_supports, priority=20,
        bind=_triton_backward,
    )  # fmt: skip
