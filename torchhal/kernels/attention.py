"""attention(q, k, v, causal, scale, window): reference, PyTorch SDPA and Triton FlashAttention.

Layout as scaled_dot_product_attention takes it: q (batch, heads_q, seq_q, dim), k and v
(batch, heads_kv, seq_k, dim), heads_q a multiple of heads_kv (GQA/MQA). With `causal`, query i
sees keys j <= i + seq_k - seq_q (bottom-right aligned, as FlashAttention does);
`window=(left, right)` further limits j to [i + seq_k - seq_q - left, i + seq_k - seq_q + right].
A query that sees no key outputs zeros. `scale` is any number finite in the compute dtype (fp32,
fp64 for fp64): 0 averages the values, a negative one favours the least similar keys, as SDPA
computes them; inf and NaN are refused (SDPA returns NaN for them).

Large logits (scale * q.k, whatever makes them large): the Triton backward recomputes the
probabilities as exp(s - lse) from the fp32 lse, as FlashAttention does, so its error grows with
|logits| * 2^-24: gradients ~10% off at logits ~1e7, inf or NaN from ~1e9 (a scale of 1e8 or
more on unit-sized q and k). The reference divides each row by its own sum and stays accurate.

Three registry ops: `attention` (no gradient needed), `attention_forward` -> (out, lse) for
training, and `attention_backward(grad_out, q, k, v, out, lse, ...) -> (dq, dk, dv)`. `lse` is
the natural-log log-sum-exp of each query's scaled scores, fp32 (batch, heads_q, seq_q), -inf
for a query that sees no key; the backward recomputes the probabilities from it as
FlashAttention does. Every candidate takes any strides; forward and backward return contiguous
tensors. Arguments after v are positional-or-keyword so autograd glue can pass them in order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from torchhal.hal_core import (
    DeviceCapabilities,
    InvalidArgumentError,
    KernelRegistry,
    RejectionReason,
    Unsupported,
)
from torchhal.hal_core.kernels import is_finite_number
from torchhal.kernels import triton_attention
from torchhal.kernels._checks import PROVIDER, require_rank, require_same, require_tensor
from torchhal.kernels.autograd import AutogradSpec
from torchhal.kernels.triton_rows import compute_dtype, require_floating, unit_stride

LOG2E = 1.4426950408889634
"""log2(e): the Triton kernels compute softmax with exp2 of scores scaled by scale * LOG2E."""


class AttentionSignature(NamedTuple):
    dtype: torch.dtype
    head_dim: int
    v_head_dim: int
    grouped: bool  # heads_q > heads_kv (GQA/MQA)
    causal: bool
    windowed: bool
    square: bool  # seq_q == seq_k: top-left and bottom-right causal masks coincide
    seq_bucket: int  # bit length of max(seq_q, seq_k): which kernel is fastest depends on it
    unit_stride_dim: bool  # q, k and v have unit stride along the head dim
    empty: bool  # some size is 0: nothing to compute
    # bit length of (heads_q // heads_kv) * seq_q - 1, the query rows of one kv head's group as a
    # power of two: a decoding step (a few rows) and a prefill of one cache length differ here
    group_rows_bucket: int
    # scale None or > 0: SDPA's causal mask is applied before its scale, so with a scale <= 0 the
    # masked scores become NaN or +inf (NaN from torch 2.13's default CPU kernel and, on an H100,
    # from flash and cuDNN; benchmarks/probe_sdpa_causal_scale.py)
    scale_positive: bool


def _check(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None,
    window: Sequence[int] | None,
) -> None:
    check_qkv(op, q, k, v, causal, scale, rank=4)
    require_same(op, "batch sizes", q=q.shape[0], k=k.shape[0], v=v.shape[0])
    require_same(op, "key and value lengths", k=k.shape[2], v=v.shape[2])
    if window is not None and (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in window)
    ):
        raise InvalidArgumentError(f"{op}: window must be (left, right), two ints >= 0, got {window!r}")


def check_qkv(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None,
    *,
    rank: int,
) -> None:
    """The checks attention and attention_varlen share: both layouts hold heads on dim 1 and the
    head dim last; each checks its own batch and token axes after."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        require_tensor(op, name, t)
        require_rank(op, name, t, rank)
    require_floating(op, "q", q)
    require_same(op, "dtypes", q=q.dtype, k=k.dtype, v=v.dtype)
    require_same(op, "devices", q=q.device, k=k.device, v=v.device)
    require_same(op, "key and value heads", k=k.shape[1], v=v.shape[1])
    require_same(op, "query and key head dims", q=q.shape[-1], k=k.shape[-1])
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise InvalidArgumentError(
            f"{op}: heads_q must be a multiple of heads_kv, got {q.shape[1]} and {k.shape[1]}"
        )
    if not isinstance(causal, bool):  # SDPA's kernels refuse 0 and 1; a tensor would be keyed by layout
        raise InvalidArgumentError(f"{op}: causal must be a bool, got {type(causal).__name__} {causal!r}")
    if scale is not None and not is_finite_number(scale):
        raise InvalidArgumentError(f"{op}: scale must be a finite number, got {scale!r}")
    if scale is not None and abs(scale) > (most := torch.finfo(ct := compute_dtype(q.dtype)).max / LOG2E):
        # the Triton kernels scale by |scale| * log2(e) in the compute dtype (exp2 of the scores):
        # above this it is inf, and every score NaN; the other candidates take the same bound
        raise InvalidArgumentError(
            f"{op}: scale must be finite in the compute dtype {ct} once multiplied by log2(e) "
            f"(|scale| <= {most:.4g}), got {scale!r}"
        )
    if q.shape[-1] == 0:  # the default scale is 1/sqrt(head dim)
        raise InvalidArgumentError(f"{op}: the head dim must be >= 1, got q shape {tuple(q.shape)}")


def _summary(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None,
    window: Sequence[int] | None,
) -> AttentionSignature:
    return AttentionSignature(
        q.dtype,
        q.shape[3],
        v.shape[3],
        q.shape[1] != k.shape[1],
        bool(causal),
        window is not None,
        q.shape[2] == k.shape[2],
        max(q.shape[2], k.shape[2]).bit_length(),
        all(unit_stride(t) for t in (q, k, v)),
        0 in q.shape or 0 in k.shape or 0 in v.shape,
        group_rows_bucket(q.shape[1], k.shape[1], q.shape[2]),
        scale is None or scale > 0,
    )


def group_rows_bucket(heads_q: int, heads_kv: int, seq_q: int) -> int:
    """Bit length of (heads_q // heads_kv) * seq_q - 1: a kv head's query rows as a power of two."""
    return max(0, heads_q // max(1, heads_kv) * seq_q - 1).bit_length()


def signature(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    window: Sequence[int] | None = None,
) -> AttentionSignature:
    _check("attention", q, k, v, causal, scale, window)
    return _summary(q, k, v, causal, scale, window)


def forward_signature(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    window: Sequence[int] | None = None,
) -> AttentionSignature:
    _check("attention_forward", q, k, v, causal, scale, window)
    return _summary(q, k, v, causal, scale, window)


def backward_signature(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    window: Sequence[int] | None = None,
) -> AttentionSignature:
    op = "attention_backward"
    _check(op, q, k, v, causal, scale, window)
    check_saved(op, q, v, grad_out, out, lse, lse_shape=(q.shape[0], q.shape[1], q.shape[2]))
    return _summary(q, k, v, causal, scale, window)


def check_saved(
    op: str,
    q: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    lse_shape: tuple[int, ...],
) -> None:
    """The backward's grad_out, out and lse must be what the forward of these q and v returns."""
    out_shape = (*q.shape[:-1], v.shape[-1])
    for name, t in (("grad_out", grad_out), ("out", out), ("lse", lse)):
        require_tensor(op, name, t)
        require_same(op, f"devices of q and {name}", q=q.device, **{name: t.device})
    require_same(
        op, "output shapes", expected=out_shape, grad_out=tuple(grad_out.shape), out=tuple(out.shape)
    )
    require_same(op, "output dtypes", q=q.dtype, grad_out=grad_out.dtype, out=out.dtype)
    require_same(op, "lse shape", expected=lse_shape, lse=tuple(lse.shape))
    require_same(op, "lse dtype", expected=torch.float32, lse=lse.dtype)


def allowed_keys(
    seq_q: int, seq_k: int, causal: bool, window: Sequence[int] | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean (seq_q, seq_k) mask of visible keys, or None when every key is visible."""
    if not causal and window is None:
        return None
    offset = seq_k - seq_q
    i = torch.arange(seq_q, device=device).unsqueeze(1) + offset
    j = torch.arange(seq_k, device=device).unsqueeze(0)
    mask = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    if causal:
        mask &= j <= i
    if window is not None:
        limit = seq_q + seq_k  # a wider band masks nothing more; clamped, i + right cannot overflow int64
        mask &= (j >= i - min(window[0], limit)) & (j <= i + min(window[1], limit))
    return mask


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    scale: float | None,
    window: Sequence[int] | None,
) -> tuple[torch.Tensor, float]:
    """Scaled, masked scores in the compute dtype (keys repeated per query group), and the scale."""
    ct = compute_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.to(ct), k.to(ct).repeat_interleave(groups, dim=1).transpose(-1, -2)) * scale
    mask = allowed_keys(q.shape[2], k.shape[2], causal, window, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores, scale


def reference_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    window: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in fp32 (fp64 for fp64 inputs) with explicit masks; out in q's dtype."""
    scores, _ = _scores(q, k, causal, scale, window)
    lse = torch.logsumexp(scores, dim=-1)
    probs = _softmax(scores)
    groups = q.shape[1] // k.shape[1]
    out = torch.matmul(probs, v.to(scores.dtype).repeat_interleave(groups, dim=1))
    return out.to(q.dtype).contiguous(), lse.float().contiguous()


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    window: Sequence[int] | None = None,
) -> torch.Tensor:
    """Softmax(q k^T * scale) v, computed in fp32 (fp64 for fp64) with explicit masks; q's dtype."""
    return reference_forward(q, k, v, causal, scale, window)[0]


def reference_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    window: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax's backward in plain PyTorch, dS = P * (dP - rowsum(P * dP)), with P recomputed in
    the compute dtype. The saved out and lse are validated, not read: lse is fp32, which would cap
    an fp64 reference at fp32's precision, and FlashAttention's rowsum(dO * O) sums in another
    order than dP, so where P is one-hot (large logits) dP - rowsum leaves rounding, ~1e-3 in dq
    where autograd's is exact."""
    scores, scale = _scores(q, k, causal, scale, window)
    ct = scores.dtype
    probs = _softmax(scores)
    groups = q.shape[1] // k.shape[1]
    v_rep = v.to(ct).repeat_interleave(groups, dim=1)
    do = grad_out.to(ct)
    dv = torch.matmul(probs.transpose(-1, -2), do)
    d_probs = torch.matmul(do, v_rep.transpose(-1, -2))
    d_scores = probs * (d_probs - (probs * d_probs).sum(-1, keepdim=True))
    dq = torch.matmul(d_scores, k.to(ct).repeat_interleave(groups, dim=1)) * scale
    dk = torch.matmul(d_scores.transpose(-1, -2), q.to(ct)) * scale
    return dq.to(q.dtype).contiguous(), _sum_groups(dk, k), _sum_groups(dv, v)


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the keys, 0 for a query that sees none (torch's gives NaN there). Each row is
    divided by its own sum, which is >= 1 where a key is seen (its peak adds exp(0)), not
    multiplied by exp(-lse): an lse rounded at logits in the thousands scales its whole row, about
    300x PyTorch's error in fp32 at logits ~4000."""
    if scores.shape[-1] == 0:  # no keys at all: nothing to weigh, and amax refuses an empty dim
        return scores
    peak = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - peak.masked_fill(peak == float("-inf"), 0.0))
    return weights / weights.sum(-1, keepdim=True).clamp_min(1.0)


def _sum_groups(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-query-head gradients summed over each kv head's group, in `like`'s dtype."""
    b, hq, s, d = grad.shape
    return grad.view(b, like.shape[1], hq // like.shape[1], s, d).sum(2).to(like.dtype).contiguous()


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    window: Sequence[int] | None = None,
) -> torch.Tensor:
    """PyTorch's scaled_dot_product_attention; predicates keep it to cases it computes alike."""
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def sdpa_supports(caps: DeviceCapabilities, sig: AttentionSignature) -> Unsupported | None:
    if sig.windowed:
        return Unsupported(RejectionReason.SHAPE, "SDPA has no sliding window")
    if sig.causal and not sig.square:
        return Unsupported(
            RejectionReason.SHAPE, "SDPA's causal mask is top-left aligned; needs seq_q == seq_k"
        )
    if sig.causal and not sig.scale_positive:
        return Unsupported(RejectionReason.SHAPE, SDPA_CAUSAL_SCALE)
    if sig.head_dim != sig.v_head_dim:
        return Unsupported(RejectionReason.SHAPE, f"head dims differ: qk {sig.head_dim}, v {sig.v_head_dim}")
    return None


SDPA_CAUSAL_SCALE = "SDPA masks before it scales: a causal mask with a scale <= 0 gives NaN"


def _forward_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None,
    window: Sequence[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check("attention", q, k, v, causal, scale, window)  # under torch.compile the fake meets bad input first
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, q.new_empty(q.shape[:-1], dtype=torch.float32)


def _backward_fake(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float | None,
    window: Sequence[int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _context(inputs: Sequence[Any], results: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    q, k, v, causal, scale, window = inputs
    out, lse = results
    return q, k, v, out, lse, causal, scale, window


AUTOGRAD = AutogradSpec(
    op="attention",
    forward="attention_forward",
    backward="attention_backward",
    forward_fake=_forward_fake,
    backward_fake=_backward_fake,
    differentiable=(0, 1, 2),
    autocast=(0, 1, 2),  # autocast casts them, as it does SDPA's inputs
    aten_op="aten::scaled_dot_product_attention",
    context=_context,
    backward_reference=reference_backward,
)


def register(registry: KernelRegistry) -> None:
    registry.define_op(
        "attention", reference, signature=signature, doc="softmax(q k^T * scale) v, SDPA layout"
    )
    registry.register("attention", "sdpa", sdpa, provider=PROVIDER, supports=sdpa_supports, priority=10)
    triton_attention.register(registry, "attention", triton_attention.bind_attention)
    triton_attention.register_decode(registry, "attention", triton_attention.bind_decode_attention)
    registry.define_op(
        "attention_forward", reference_forward, signature=forward_signature, doc="(out, lse) of attention"
    )
    triton_attention.register(registry, "attention_forward", triton_attention.bind_forward)
    triton_attention.register_decode(registry, "attention_forward", triton_attention.bind_decode_forward)
    registry.define_op(
        "attention_backward",
        reference_backward,
        signature=backward_signature,
        doc="(dq, dk, dv) of attention",
    )
    triton_attention.register(registry, "attention_backward", triton_attention.bind_backward)
