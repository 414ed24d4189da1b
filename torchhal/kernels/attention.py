"""attention(q, k, v, causal, scale, window): reference and PyTorch SDPA as a candidate.

Layout as scaled_dot_product_attention takes it: q (batch, heads_q, seq_q, dim), k and v
(batch, heads_kv, seq_k, dim). With `causal`, query i sees keys j <= i + seq_k - seq_q
(bottom-right aligned, as FlashAttention does); `window=(left, right)` further limits j to
[i + seq_k - seq_q - left, i + seq_k - seq_q + right]. A query that sees no key outputs zeros.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from torchhal.hal_core import (
    DeviceCapabilities,
    InvalidArgumentError,
    KernelRegistry,
    RejectionReason,
    Unsupported,
)
from torchhal.kernels._checks import PROVIDER, require_rank, require_same, require_tensor


class AttentionSignature(NamedTuple):
    dtype: torch.dtype
    head_dim: int
    v_head_dim: int
    grouped: bool  # heads_q > heads_kv (GQA/MQA)
    causal: bool
    windowed: bool
    square: bool  # seq_q == seq_k: top-left and bottom-right causal masks coincide


def signature(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
) -> AttentionSignature:
    for name, t in (("q", q), ("k", k), ("v", v)):
        require_tensor("attention", name, t)
        require_rank("attention", name, t, 4)
    require_same("attention", "dtypes", q=q.dtype, k=k.dtype, v=v.dtype)
    require_same("attention", "devices", q=q.device, k=k.device, v=v.device)
    require_same("attention", "batch sizes", q=q.shape[0], k=k.shape[0], v=v.shape[0])
    require_same("attention", "key and value heads", k=k.shape[1], v=v.shape[1])
    require_same("attention", "key and value lengths", k=k.shape[2], v=v.shape[2])
    require_same("attention", "query and key head dims", q=q.shape[3], k=k.shape[3])
    if q.shape[1] % k.shape[1] != 0:
        raise InvalidArgumentError(
            f"attention: heads_q must be a multiple of heads_kv, got {q.shape[1]} and {k.shape[1]}"
        )
    if window is not None and (len(window) != 2 or min(window) < 0):
        raise InvalidArgumentError(f"attention: window must be (left, right) with both >= 0, got {window}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise InvalidArgumentError(f"attention: scale must be a finite number, got {scale!r}")
    return AttentionSignature(
        q.dtype,
        q.shape[3],
        v.shape[3],
        q.shape[1] != k.shape[1],
        bool(causal),
        window is not None,
        q.shape[2] == k.shape[2],
    )


def allowed_keys(
    seq_q: int, seq_k: int, causal: bool, window: tuple[int, int] | None, device: torch.device
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
        mask &= (j >= i - window[0]) & (j <= i + window[1])
    return mask


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Softmax(q k^T * scale) v, computed in fp32 with explicit masks; returns q's dtype."""
    groups = q.shape[1] // k.shape[1]
    k32 = k.float().repeat_interleave(groups, dim=1)
    v32 = v.float().repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.float(), k32.transpose(-1, -2)) * scale
    mask = allowed_keys(q.shape[2], k.shape[2], causal, window, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:
        probs = probs.nan_to_num(0.0)  # rows with no visible key
    return torch.matmul(probs, v32).to(q.dtype)


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
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
    if sig.head_dim != sig.v_head_dim:
        return Unsupported(RejectionReason.SHAPE, f"head dims differ: qk {sig.head_dim}, v {sig.v_head_dim}")
    return None


def register(registry: KernelRegistry) -> None:
    registry.define_op(
        "attention", reference, signature=signature, doc="softmax(q k^T * scale) v, SDPA layout"
    )
    registry.register("attention", "sdpa", sdpa, provider=PROVIDER, supports=sdpa_supports, priority=10)
