"""PyTorch SDPA pinned to one backend (FlashAttention-2 or cuDNN) as candidates of torchhal's
`attention` op and of its training pair, `attention_forward` and `attention_backward`.

A device offers a backend by listing it in `DeviceCapabilities.kernel_backends`
("flash-attention", "cudnn-attention"); the adapter knows whether its torch build, libraries and
architecture have it (PyTorch's flash and cuDNN attention need sm_80 or newer; cuDNN attention
needs cuDNN 9). The predicates add what each backend computes as the op defines it: fp16/bf16,
equal q/k/v head dims within the backend's limit, unit stride along the head dim, no sliding
window, and causal only when seq_q == seq_k (SDPA's causal mask is top-left aligned, the op's
bottom-right). This module imports only `torchhal.hal_core` (layering rule 3): it reads the op's
signature by its fields (`AttentionShape`).

Training takes ATen's own ops behind SDPA (`_scaled_dot_product_{flash,cudnn}_attention` and their
backwards), which return and take the log-sum-exp that `scaled_dot_product_attention` hides. Their
lse is the op's (natural log, fp32, one per query: cuDNN's has a trailing 1), so any forward pairs
with any backward. The backwards get grad_out and out contiguous: cuDNN's returns wrong gradients,
with no error, when grad_out's strides differ from out's (measured on an H100, cuDNN 9.19).

The direct calls skip what `scaled_dot_product_attention` does first (torch's flash_api.cpp and
sdp_utils.cpp), so the training pair checks it itself: flash takes head dims that are multiples
of 8 only (SDPA pads to them; `flash_training_supports`), and cuDNN is refused while
`torch.are_deterministic_algorithms_enabled()` and for key/value length 1 (`_cudnn_can_run`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torchhal.hal_core import CallDeclined, DeviceCapabilities, KernelRegistry, RejectionReason, Unsupported


class AttentionShape(Protocol):
    """The fields of the `attention` ops' signature (torchhal.kernels.attention) the predicates read."""

    dtype: torch.dtype
    head_dim: int
    v_head_dim: int
    causal: bool
    windowed: bool
    square: bool  # seq_q == seq_k
    unit_stride_dim: bool
    empty: bool
    scale_positive: bool  # scale None or > 0


FLASH_BACKEND = "flash-attention"  # kernel_backends entry of devices with SDPA's flash kernels
CUDNN_BACKEND = "cudnn-attention"
FLASH_MAX_HEAD_DIM = 256
# ATen's flash kernels refuse other head dims ("head_size must be a multiple of 8, this is ensured
# by padding!", flash_api.cpp); SDPA pads to it, the training pair's direct calls do not
FLASH_HEAD_DIM_MULTIPLE = 8
CUDNN_MAX_HEAD_DIM = 128  # 256 needs cuDNN >= 9.10 on sm_90 only; the predicate keeps to what all have
CUDNN_HEAD_DIM_MULTIPLE = 8
LOW_PRECISION = (torch.float16, torch.bfloat16)
Predicate = Callable[[DeviceCapabilities, AttentionShape], "Unsupported | None"]


def _sdpa(
    backend: SDPBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    with sdpa_kernel([backend]):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )


def sdpa_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    window: Sequence[int] | None = None,
) -> torch.Tensor:
    """SDPA with only its FlashAttention backend enabled (it raises rather than use another)."""
    return _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal, scale)


def sdpa_cudnn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    window: Sequence[int] | None = None,
) -> torch.Tensor:
    """SDPA with only its cuDNN backend enabled."""
    return _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal, scale)


def _common(caps: DeviceCapabilities, sig: AttentionShape, backend: str) -> Unsupported | None:
    if backend not in caps.kernel_backends:
        return Unsupported(RejectionReason.FEATURE, f"device does not list kernel backend {backend!r}")
    if sig.dtype not in LOW_PRECISION:
        return Unsupported(RejectionReason.DTYPE, f"{backend} computes fp16 and bf16 only, got {sig.dtype}")
    if sig.head_dim != sig.v_head_dim:
        return Unsupported(RejectionReason.SHAPE, f"head dims differ: qk {sig.head_dim}, v {sig.v_head_dim}")
    if sig.windowed:
        return Unsupported(RejectionReason.SHAPE, "SDPA has no sliding window")
    if sig.causal and not sig.square:
        return Unsupported(
            RejectionReason.SHAPE, "SDPA's causal mask is top-left aligned; needs seq_q == seq_k"
        )
    if sig.causal and not sig.scale_positive:  # flash and cuDNN give NaN there (H100, torch 2.11)
        return Unsupported(
            RejectionReason.SHAPE, "SDPA masks before it scales: a causal mask needs a scale > 0"
        )
    if not sig.unit_stride_dim:
        return Unsupported(RejectionReason.LAYOUT, f"{backend} needs unit stride along the head dim")
    if sig.empty:
        return Unsupported(RejectionReason.SHAPE, f"{backend} needs non-empty sequences")
    return None


def flash_supports(caps: DeviceCapabilities, sig: AttentionShape) -> Unsupported | None:
    verdict = _common(caps, sig, FLASH_BACKEND)
    if verdict is None and sig.head_dim > FLASH_MAX_HEAD_DIM:
        return Unsupported(RejectionReason.SHAPE, f"head dim {sig.head_dim} > {FLASH_MAX_HEAD_DIM}")
    return verdict


def flash_training_supports(caps: DeviceCapabilities, sig: AttentionShape) -> Unsupported | None:
    """`flash_supports` for the training pair, which calls ATen's flash ops without SDPA's padding."""
    verdict = flash_supports(caps, sig)
    if verdict is None and sig.head_dim % FLASH_HEAD_DIM_MULTIPLE:
        return Unsupported(
            RejectionReason.SHAPE,
            f"head dim {sig.head_dim}: ATen's _scaled_dot_product_flash_attention and its backward take "
            f"multiples of {FLASH_HEAD_DIM_MULTIPLE} only (SDPA pads to them; these direct calls do not)",
        )
    return verdict


def cudnn_supports(caps: DeviceCapabilities, sig: AttentionShape) -> Unsupported | None:
    verdict = _common(caps, sig, CUDNN_BACKEND)
    if verdict is None and (sig.head_dim > CUDNN_MAX_HEAD_DIM or sig.head_dim % CUDNN_HEAD_DIM_MULTIPLE):
        return Unsupported(
            RejectionReason.SHAPE,
            f"head dim {sig.head_dim}: cuDNN takes multiples of {CUDNN_HEAD_DIM_MULTIPLE} "
            f"up to {CUDNN_MAX_HEAD_DIM}",
        )
    return verdict


def sdpa_flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    window: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) from SDPA's FlashAttention-2 kernel; it takes GQA/MQA heads as they are."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    out, lse = flash(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out.contiguous(), lse


def sdpa_flash_backward(
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
    """(dq, dk, dv) from FlashAttention-2's backward, GQA gradients summed over each group by it."""
    rng = _unread_rng(q.device)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out.contiguous(), q, k, v, out.contiguous(), lse.contiguous(),
        None, None, q.shape[2], k.shape[2], 0.0, causal, rng, rng, scale=scale,
    )  # fmt: skip
    return _contiguous(grads)


def sdpa_cudnn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    window: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) from SDPA's cuDNN kernel; its lse (batch, heads, seq_q, 1) loses the trailing 1."""
    _cudnn_can_run("sdpa_cudnn_forward", k)
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )[:2]
    return out.contiguous(), lse.reshape(lse.shape[:3]).contiguous()


def sdpa_cudnn_backward(
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
    """(dq, dk, dv) from cuDNN's backward (grad_out laid out as out: see the module docstring)."""
    _cudnn_can_run("sdpa_cudnn_backward", k)
    rng = _unread_rng(q.device)
    grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out.contiguous(), q, k, v, out.contiguous(), lse.contiguous().unsqueeze(-1),
        rng, rng, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale,
    )  # fmt: skip
    return _contiguous(grads)


def _cudnn_can_run(fn: str, k: torch.Tensor) -> None:
    """What torch's SDPA checks before it picks cuDNN and the direct ATen calls do not (sdp_utils.cpp:
    check_cudnn_deterministic, check_cudnn_tensor_shapes): their backward runs non-deterministically
    without a word, and cuDNN has no key/value length 1. Checked per call, not in `cudnn_supports`:
    the attention signature says neither (its seq_bucket is of max(seq_q, seq_k)), and a predicate
    reading the global deterministic flag would be cached per signature and bypassed by the
    dispatch memo. A CallDeclined: the registry runs the next candidate for this call (counted,
    said once) and demotes nothing, so cuDNN serves the signature again once the mode is off, and
    other key/value lengths of its bucket. Stricter than torch, which lets cuDNN run in warn-only
    mode."""
    if torch.are_deterministic_algorithms_enabled():
        raise CallDeclined(
            f"{fn}: cuDNN attention is not deterministic and torch.are_deterministic_algorithms_enabled() "
            "is True (torch's SDPA refuses cuDNN there: check_cudnn_deterministic)"
        )
    if k.shape[2] == 1:
        raise CallDeclined(
            f"{fn}: cuDNN attention needs a key/value sequence length other than 1, got {k.shape[2]} "
            "(torch's check_cudnn_tensor_shapes)"
        )


def _unread_rng(device: torch.device) -> torch.Tensor:
    """The backwards' dropout seed and offset: with dropout 0 neither is read, but each must be a
    tensor. Empty, not zeros: a fill would launch a kernel on every backward."""
    return torch.empty((), dtype=torch.int64, device=device)


def _contiguous(grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = grads
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


def register(registry: KernelRegistry, *, provider: str, priority: float = 15) -> None:
    """Add both as candidates of `attention` and of its training pair `attention_forward` and
    `attention_backward` (after torchhal's kernels defined the ops: plugins register theirs after
    the core's)."""
    ops = ("attention", "attention_forward", "attention_backward")
    # name, the predicate of `attention` (through SDPA), of the training pair (direct ATen calls)
    backends: tuple[tuple[str, Predicate, Predicate, tuple[Callable[..., Any], ...]], ...] = (
        (
            "sdpa_flash",
            flash_supports,
            flash_training_supports,
            (sdpa_flash, sdpa_flash_forward, sdpa_flash_backward),
        ),
        ("sdpa_cudnn", cudnn_supports, cudnn_supports, (sdpa_cudnn, sdpa_cudnn_forward, sdpa_cudnn_backward)),
    )
    for name, plain, training, fns in backends:
        for op, fn in zip(ops, fns, strict=True):
            supports = plain if op == "attention" else training
            registry.register(op, name, fn, provider=provider, supports=supports, priority=priority)
