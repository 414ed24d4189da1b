"""PyTorch SDPA pinned to one backend (FlashAttention-2 or cuDNN) as extra `attention` candidates.

Vendor-neutral in form: they use only `torch.nn.attention`. A device offers a backend by
listing it in `DeviceCapabilities.kernel_backends` ("flash-attention", "cudnn-attention"); its
adapter knows whether its torch build, libraries and architecture have it (PyTorch's flash and
cuDNN attention need sm_80 or newer; cuDNN attention needs cuDNN 9). The predicates add what each backend
computes as the `attention` op defines it: fp16/bf16, equal q/k/v head dims within the
backend's limit, unit stride along the head dim, no sliding window, and causal only when
seq_q == seq_k (SDPA's causal mask is top-left aligned, the op's bottom-right). They serve the
no-gradient `attention` op: SDPA does not return the log-sum-exp that `attention_backward` takes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchhal.hal_core import DeviceCapabilities, KernelRegistry, RejectionReason, Unsupported
from torchhal.kernels._checks import PROVIDER
from torchhal.kernels.attention import AttentionSignature

FLASH_BACKEND = "flash-attention"  # kernel_backends entry of devices with SDPA's flash kernels
CUDNN_BACKEND = "cudnn-attention"
FLASH_MAX_HEAD_DIM = 256
CUDNN_MAX_HEAD_DIM = 128  # 256 needs cuDNN >= 9.10 on sm_90 only; the predicate keeps to what all have
CUDNN_HEAD_DIM_MULTIPLE = 8
LOW_PRECISION = (torch.float16, torch.bfloat16)


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


def _common(caps: DeviceCapabilities, sig: AttentionSignature, backend: str) -> Unsupported | None:
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
    if not sig.unit_stride_dim:
        return Unsupported(RejectionReason.LAYOUT, f"{backend} needs unit stride along the head dim")
    if sig.empty:
        return Unsupported(RejectionReason.SHAPE, f"{backend} needs non-empty sequences")
    return None


def flash_supports(caps: DeviceCapabilities, sig: AttentionSignature) -> Unsupported | None:
    verdict = _common(caps, sig, FLASH_BACKEND)
    if verdict is None and sig.head_dim > FLASH_MAX_HEAD_DIM:
        return Unsupported(RejectionReason.SHAPE, f"head dim {sig.head_dim} > {FLASH_MAX_HEAD_DIM}")
    return verdict


def cudnn_supports(caps: DeviceCapabilities, sig: AttentionSignature) -> Unsupported | None:
    verdict = _common(caps, sig, CUDNN_BACKEND)
    if verdict is None and (sig.head_dim > CUDNN_MAX_HEAD_DIM or sig.head_dim % CUDNN_HEAD_DIM_MULTIPLE):
        return Unsupported(
            RejectionReason.SHAPE,
            f"head dim {sig.head_dim}: cuDNN takes multiples of {CUDNN_HEAD_DIM_MULTIPLE} "
            f"up to {CUDNN_MAX_HEAD_DIM}",
        )
    return verdict


def register(registry: KernelRegistry, *, provider: str = PROVIDER, priority: float = 15) -> None:
    """Add both as `attention` candidates (after `attention.register` defined the op). Called by
    the vendor adapters whose devices can list these backends (the NVIDIA adapter), not by the core:
    a vendor's library candidates are its plugin's to register."""
    registry.register(
        "attention", "sdpa_flash", sdpa_flash, provider=provider, supports=flash_supports, priority=priority
    )
    registry.register(
        "attention", "sdpa_cudnn", sdpa_cudnn, provider=provider, supports=cudnn_supports, priority=priority
    )
