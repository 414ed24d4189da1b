"""layer_norm(x, weight, bias, eps) over the last dimension, and its backward: references, Triton.

y = (x - mean) / sqrt(var + eps) * weight + bias with the biased variance, as
`torch.nn.functional.layer_norm` computes it, in fp32 (fp64 for fp64 inputs) and rounded once.
Training runs `layer_norm_forward -> (y, mean, rstd)`, the statistics per row in the compute
dtype, and `layer_norm_backward(dy, x, weight, mean, rstd) -> (dx, dweight, dbias)` takes them
back, as PyTorch's own layer_norm does: the backward then needs one reduction round a row, not
two. Layout rules are those of rms_norm: the Triton candidates take tensors they can index as
(rows, hidden) with unit column stride, unit-stride weight and bias, and contiguous statistics.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from torchhal.hal_core import DeviceCapabilities, InvalidArgumentError, KernelRegistry, Unsupported
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


class LayerNormSignature(NamedTuple):
    dtype: torch.dtype
    hidden: int
    rows: bool  # every row tensor indexes as (rows, hidden); weight and bias have unit stride


def _check(op: str, x: torch.Tensor, eps: float | None, **params: torch.Tensor) -> None:
    """x (..., hidden) and 1-D parameters (weight, and bias for the forward) of length hidden; eps
    where the op takes one."""
    if eps is not None:
        require_eps(op, eps)
    require_tensor(op, "x", x)
    for name, p in params.items():
        require_tensor(op, name, p)
        require_rank(op, name, p, 1)
    weight = params["weight"]
    require_min_rank(op, "x", x, 1)
    if x.shape[-1] != weight.shape[0]:
        raise InvalidArgumentError(
            f"{op}: x's last dimension must equal weight's length {weight.shape[0]}, "
            f"got x shape {tuple(x.shape)}"
        )
    require_floating(op, "x", x)
    require_same(op, "weight and bias lengths", **{k: p.shape[0] for k, p in params.items()})
    require_same(op, "dtypes", x=x.dtype, **{k: p.dtype for k, p in params.items()})
    require_same(op, "devices", x=x.device, **{k: p.device for k, p in params.items()})


def _layout(params: Sequence[torch.Tensor], rows: Sequence[torch.Tensor]) -> bool:
    return all(unit_stride(p) for p in params) and all(row_stride(t) is not None for t in rows)


def signature(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> LayerNormSignature:
    _check("layer_norm", x, eps, weight=weight, bias=bias)
    return LayerNormSignature(x.dtype, weight.shape[0], _layout((weight, bias), (x,)))


def backward_signature(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> LayerNormSignature:
    op = "layer_norm_backward"
    _check(op, x, None, weight=weight)
    require_tensor(op, "dy", dy)
    require_same(op, "dy and x shapes", dy=tuple(dy.shape), x=tuple(x.shape))
    require_same(op, "dtypes", dy=dy.dtype, x=x.dtype)
    for name, stat in (("mean", mean), ("rstd", rstd)):
        require_tensor(op, name, stat)
        if tuple(stat.shape) != tuple(x.shape[:-1]) or stat.dtype != compute_dtype(x.dtype):
            raise InvalidArgumentError(
                f"{op}: {name} must be layer_norm_forward's statistics, shape {tuple(x.shape[:-1])} "
                f"and dtype {compute_dtype(x.dtype)} for x {tuple(x.shape)} {x.dtype}; "
                f"got shape {tuple(stat.shape)}, dtype {stat.dtype}"
            )
    require_same(op, "devices", dy=dy.device, x=x.device, mean=mean.device, rstd=rstd.device)
    rows = _layout((weight,), (x, dy)) and mean.is_contiguous() and rstd.is_contiguous()
    return LayerNormSignature(x.dtype, weight.shape[0], rows)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """torch.nn.functional.layer_norm in fp32 (fp64 for fp64), returning x's dtype."""
    ct = compute_dtype(x.dtype)
    y = torch.nn.functional.layer_norm(x.to(ct), (x.shape[-1],), weight.to(ct), bias.to(ct), eps)
    return y.to(x.dtype).contiguous()


def reference_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd): the statistics per row, in the compute dtype, as the backward takes them."""
    ct = compute_dtype(x.dtype)
    x32 = x.to(ct)
    mean = x32.mean(-1)
    rstd = torch.rsqrt((x32 - mean.unsqueeze(-1)).pow(2).mean(-1) + eps)
    return reference(x, weight, bias, eps), mean, rstd


def reference_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * weight; row sums for dweight, dbias."""
    ct = compute_dtype(x.dtype)
    x32, dy32 = x.to(ct), dy.to(ct)
    rstd = rstd.to(ct).unsqueeze(-1)
    xhat = (x32 - mean.to(ct).unsqueeze(-1)) * rstd
    g = dy32 * weight.to(ct)
    dx = (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd
    dweight = as_rows(dy32 * xhat).sum(0)
    dbias = as_rows(dy32).sum(0)
    return dx.to(x.dtype).contiguous(), dweight.to(weight.dtype), dbias.to(weight.dtype)


def recorded_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference backward with the row statistics as functions of x, for autograd to record
    (create_graph=True): saved, they are constants, and the second-order terms through them were
    lost. eps is not saved, so rstd keeps its saved value and takes x's derivative through the
    variance, as rstd = (var + eps)^-1/2 with eps = rstd^-2 - var does."""
    x32 = x.to(compute_dtype(x.dtype))
    live_mean = x32.mean(-1)
    var = (x32 - live_mean.unsqueeze(-1)).pow(2).mean(-1)
    live_rstd = torch.rsqrt(var - var.detach() + rstd.to(var.dtype).pow(-2))
    return reference_backward(dy, x, weight, live_mean, live_rstd)


def triton_supports(caps: DeviceCapabilities, sig: LayerNormSignature) -> Unsupported | None:
    verdict = triton_unsupported(caps, sig.dtype) or block_unsupported(sig.hidden)
    return verdict or layout_unsupported(sig.rows)


def _triton_forward(caps: DeviceCapabilities) -> Callable[..., torch.Tensor]:
    from torchhal.kernels import triton_norms

    return functools.partial(triton_norms.layer_norm_forward, RowLaunch.from_caps(caps))


def _triton_forward_with_stats(caps: DeviceCapabilities) -> Callable[..., tuple[torch.Tensor, ...]]:
    from torchhal.kernels import triton_norms

    return functools.partial(triton_norms.layer_norm_forward_with_stats, RowLaunch.from_caps(caps))


def _triton_backward(caps: DeviceCapabilities) -> Callable[..., tuple[torch.Tensor, ...]]:
    from torchhal.kernels import triton_norms

    return functools.partial(triton_norms.layer_norm_backward, RowLaunch.from_caps(caps))


def _forward_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(
        "layer_norm", x, eps, weight=weight, bias=bias
    )  # under torch.compile the fake meets bad input first
    ct = compute_dtype(x.dtype)
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=ct), x.new_empty(x.shape[:-1], dtype=ct)


def _backward_fake(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _context(inputs: Sequence[Any], results: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    x, weight, _bias, _eps = inputs
    _y, mean, rstd = results
    return x, weight, mean, rstd


AUTOGRAD = AutogradSpec(
    op="layer_norm",
    forward="layer_norm_forward",
    backward="layer_norm_backward",
    forward_fake=_forward_fake,
    backward_fake=_backward_fake,
    differentiable=(0, 1, 2),
    context=_context,
    autocast_fp32=(0, 1, 2),  # as torch's autocast runs F.layer_norm on CUDA and XPU
    aten_op="aten::layer_norm",
    backward_reference=recorded_backward,
)


def register(registry: KernelRegistry) -> None:
    registry.define_op("layer_norm", reference, signature=signature, doc="LayerNorm over the last dimension")
    registry.register(
        "layer_norm", "triton", unbound, provider=PROVIDER, supports=triton_supports, priority=20,
        bind=_triton_forward,
    )  # fmt: skip
    registry.define_op(
        "layer_norm_forward",
        reference_forward,
        signature=signature,  # errors name layer_norm, the op its callers called
        doc="(y, mean, rstd) of layer_norm, the statistics for its backward",
    )
    registry.register(
        "layer_norm_forward", "triton", unbound, provider=PROVIDER, supports=triton_supports, priority=20,
        bind=_triton_forward_with_stats,
    )  # fmt: skip
    registry.define_op(
        "layer_norm_backward",
        reference_backward,
        signature=backward_signature,
        doc="(dx, dweight, dbias) of layer_norm",
    )
    registry.register(
        "layer_norm_backward", "triton", unbound, provider=PROVIDER, supports=triton_supports, priority=20,
        bind=_triton_backward,
    )  # fmt: skip
