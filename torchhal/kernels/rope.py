"""rope(q, k, cos, sin) -> (q', k'): rotary position embedding, Hugging Face's rotate-half convention.

q (batch, heads_q, seq, dim) and k (batch, heads_k, seq, dim) may have different head counts
(GQA/MQA); cos and sin are broadcastable to (batch, 1, seq, dim) and shared by both:
x' = x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x[..., dim/2:], x[..., :dim/2]).
Computed in fp32 (fp64 when an input is fp64), rounded once to q's dtype. cos/sin may be in
another floating dtype than q (e.g. fp32 tables with bf16 activations).
`rope_backward(dq_out, dk_out, cos, sin) -> (dq, dk)` applies the transposed rotation; cos and
sin get no gradient (they are position tables). The Triton candidate addresses every tensor
through its strides, so it takes any layout; outputs keep their input's memory layout
(`output_like`).
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
    UnsupportedError,
)
from torchhal.kernels._checks import PROVIDER, require_rank, require_same, require_tensor
from torchhal.kernels.autograd import AutogradSpec
from torchhal.kernels.triton_rows import (
    ARITHMETIC_FLOATS,
    TRITON_DTYPES,
    RowLaunch,
    block_unsupported,
    compute_dtype,
    require_floating,
    triton_unsupported,
    unbound,
)


class RopeSignature(NamedTuple):
    dtype: torch.dtype
    table_dtype: torch.dtype  # cos and sin
    head_dim: int


def _check(
    op: str, names: tuple[str, str], q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> RopeSignature:
    qn, kn = names
    for name, t in ((qn, q), (kn, k), ("cos", cos), ("sin", sin)):
        require_tensor(op, name, t)
    require_rank(op, qn, q, 4)
    require_rank(op, kn, k, 4)
    require_floating(op, qn, q)
    if cos.dtype not in ARITHMETIC_FLOATS:  # float8 has no type promotion with q's dtype
        raise UnsupportedError(
            f"{op}: cos and sin must be float64, float32, bfloat16 or float16, got dtype {cos.dtype}"
        )
    require_same(op, "batch sizes", **{qn: q.shape[0], kn: k.shape[0]})
    require_same(op, "sequence lengths", **{qn: q.shape[2], kn: k.shape[2]})
    require_same(op, "head dims", **{qn: q.shape[3], kn: k.shape[3]})
    require_same(op, "dtypes", **{qn: q.dtype, kn: k.dtype})
    require_same(op, "cos and sin dtypes", cos=cos.dtype, sin=sin.dtype)
    require_same(op, "cos and sin shapes", cos=tuple(cos.shape), sin=tuple(sin.shape))
    require_same(op, "devices", **{qn: q.device, kn: k.device, "cos": cos.device, "sin": sin.device})
    batch, _, seq, dim = q.shape
    if dim % 2:
        raise InvalidArgumentError(f"{op}: head dim must be even (rotate-half pairs its halves), got {dim}")
    target = (batch, 1, seq, dim)
    if cos.dim() > 4 or any(
        c not in (1, t) for c, t in zip(cos.shape[::-1], target[4 - cos.dim() :][::-1], strict=True)
    ):
        raise InvalidArgumentError(
            f"{op}: cos and sin must be broadcastable to (batch, 1, seq, dim) = {target}, "
            f"got {tuple(cos.shape)}"
        )
    return RopeSignature(q.dtype, cos.dtype, dim)


def signature(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> RopeSignature:
    return _check("rope", ("q", "k"), q, k, cos, sin)


def backward_signature(
    dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> RopeSignature:
    return _check("rope_backward", ("dq_out", "dk_out"), dq_out, dk_out, cos, sin)


def output_like(x: torch.Tensor) -> torch.Tensor:
    """A fresh tensor laid out in memory as x is, when x's last dim has unit stride, else contiguous.

    Projections viewed (batch, heads, seq, dim) stay (batch, seq, heads, dim) in memory, as eager's
    element-wise ops keep them, so a kernel stores each position's heads as contiguously as it
    loads them (a contiguous output scatters them a (seq x dim) stride apart). The kernels, the
    references and the fake implementations all lay outputs out through this one function."""
    out = torch.empty_like(x)
    if out.shape[-1] > 1 and out.stride(-1) != 1:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _tables(
    q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.dtype, torch.Tensor, torch.Tensor]:
    ct = compute_dtype(torch.promote_types(q.dtype, cos.dtype))
    return ct, cos.to(ct), sin.to(ct)


def reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x * cos + rotate_half(x) * sin for x in (q, k), as Hugging Face's apply_rotary_pos_emb."""
    ct, c, s = _tables(q, cos, sin)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(ct)
        return output_like(x).copy_(x32 * c + _rotate_half(x32) * s)

    return rotate(q), rotate(k)


def reference_backward(
    dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The transposed rotation: dx = g * cos - rotate_half(g * sin)."""
    ct, c, s = _tables(dq_out, cos, sin)

    def unrotate(g: torch.Tensor) -> torch.Tensor:
        g32 = g.to(ct)
        return output_like(g).copy_(g32 * c - _rotate_half(g32 * s))

    return unrotate(dq_out), unrotate(dk_out)


def triton_supports(caps: DeviceCapabilities, sig: RopeSignature) -> Unsupported | None:
    verdict = triton_unsupported(caps, sig.dtype) or block_unsupported(sig.head_dim)
    if verdict is None and sig.table_dtype not in TRITON_DTYPES:
        return Unsupported(RejectionReason.DTYPE, f"cos/sin dtype {sig.table_dtype}: not fp32, bf16 or fp16")
    return verdict


def _triton_forward(caps: DeviceCapabilities) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    from torchhal.kernels import triton_rope

    return functools.partial(triton_rope.rope, RowLaunch.from_caps(caps))


def _triton_backward(caps: DeviceCapabilities) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    from torchhal.kernels import triton_rope

    return functools.partial(triton_rope.rope_backward, RowLaunch.from_caps(caps))


def _fake(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _check("rope", ("q", "k"), q, k, cos, sin)  # under torch.compile the fake meets bad input first
    return output_like(q), output_like(k)


def _backward_fake(
    dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return output_like(dq_out), output_like(dk_out)


def _context(inputs: Sequence[Any], results: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    _q, _k, cos, sin = inputs
    return cos, sin


AUTOGRAD = AutogradSpec(
    op="rope",
    forward="rope",
    backward="rope_backward",
    forward_fake=_fake,
    backward_fake=_backward_fake,
    differentiable=(0, 1),
    context=_context,
    outputs=2,
    backward_reference=reference_backward,
)


def register(registry: KernelRegistry) -> None:
    registry.define_op("rope", reference, signature=signature, doc="rotary embedding, rotate-half convention")
    registry.register(
        "rope", "triton", unbound, provider=PROVIDER, supports=triton_supports, priority=20,
        bind=_triton_forward,
    )  # fmt: skip
    registry.define_op(
        "rope_backward", reference_backward, signature=backward_signature, doc="(dq, dk) of rope"
    )
    registry.register(
        "rope_backward", "triton", unbound, provider=PROVIDER, supports=triton_supports, priority=20,
        bind=_triton_backward,
    )  # fmt: skip
