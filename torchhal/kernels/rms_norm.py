"""rms_norm(x, weight, eps) over the last dimension: reference and the ATen candidate."""

from __future__ import annotations

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


class RMSNormSignature(NamedTuple):
    dtype: torch.dtype
    hidden: int
    contiguous: bool


def signature(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> RMSNormSignature:
    require_tensor("rms_norm", "x", x)
    require_tensor("rms_norm", "weight", weight)
    require_rank("rms_norm", "weight", weight, 1)
    if x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise InvalidArgumentError(
            f"rms_norm: x's last dimension must equal weight's length {weight.shape[0]}, "
            f"got x shape {tuple(x.shape)}"
        )
    require_same("rms_norm", "dtypes", x=x.dtype, weight=weight.dtype)
    require_same("rms_norm", "devices", x=x.device, weight=weight.device)
    return RMSNormSignature(x.dtype, weight.shape[0], x.is_contiguous())


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Normalise in fp32, scale by weight in fp32, return x's dtype."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def aten(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """PyTorch's fused rms_norm (torch >= 2.4), computing in fp32 as the reference does."""
    return torch.nn.functional.rms_norm(x.float(), (weight.shape[0],), weight.float(), eps).to(x.dtype)


def aten_supports(caps: DeviceCapabilities, sig: RMSNormSignature) -> Unsupported | None:
    if not hasattr(torch.nn.functional, "rms_norm"):
        return Unsupported(RejectionReason.FEATURE, f"torch {torch.__version__} has no F.rms_norm")
    return None


def register(registry: KernelRegistry) -> None:
    registry.define_op("rms_norm", reference, signature=signature, doc="RMSNorm over the last dimension")
    registry.register("rms_norm", "aten", aten, provider=PROVIDER, supports=aten_supports, priority=10)
