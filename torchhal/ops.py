"""`torchhal.ops.<op>(...)`: dispatch through the default HAL's kernel registry.

The default HAL is made lazily on the first call. Each call resolves the device from its
first tensor (or `hal.use(device)`), looks up the cached selection and calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchhal.hal_core.hal import active_hal

if TYPE_CHECKING:
    import torch

    from torchhal.hal_core.hal import HardwareAbstractionLayer

_default: HardwareAbstractionLayer | None = None


def default_hal() -> HardwareAbstractionLayer:
    """The process's default HAL, made on first use; the only HAL that is a global."""
    global _default
    if _default is None:
        from torchhal.hal_core.hal import HardwareAbstractionLayer

        _default = HardwareAbstractionLayer()
    return _default


def set_default_hal(hal: HardwareAbstractionLayer | None) -> None:
    """Replace the default HAL (None: make a new one on next use)."""
    global _default
    _default = hal


def _dispatch(op: str, first: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    hal = active_hal() or _default or default_hal()
    return hal.kernels.call(op, hal.device_for_tensor(first), first, *args, **kwargs)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _dispatch("matmul", a, b)  # type: ignore[no-any-return]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return _dispatch("rms_norm", x, weight, eps)  # type: ignore[no-any-return]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
) -> torch.Tensor:
    return _dispatch("attention", q, k, v, causal=causal, scale=scale, window=window)  # type: ignore[no-any-return]
