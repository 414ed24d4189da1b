"""`torchhal.ops.<op>(...)`: dispatch through the default HAL's kernel registry; any registry op,
a plugin's own included, as `torchhal.ops.dispatch(op, *args)`.

The default HAL is made lazily on the first call. Each call resolves the device from its
first tensor (or `hal.use(device)`), looks up the cached selection and calls it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchhal.hal_core.hal import active_use
from torchhal.hal_core.kernels import NOT_SEEN
from torchhal.kernels import attention as _attention
from torchhal.kernels import attention_varlen as _attention_varlen
from torchhal.kernels import layer_norm as _layer_norm
from torchhal.kernels import linear_cross_entropy as _linear_cross_entropy
from torchhal.kernels import matmul as _matmul
from torchhal.kernels import rms_norm as _rms_norm
from torchhal.kernels import rope as _rope
from torchhal.kernels import swiglu as _swiglu
from torchhal.kernels.autograd import AutogradSpec, DifferentiableOp

if TYPE_CHECKING:
    import torch

    from torchhal.hal_core.hal import HardwareAbstractionLayer

_default: HardwareAbstractionLayer | None = None
_default_lock = threading.Lock()  # one default HAL even when first op calls race
# op -> the default HAL's `dispatcher(op)` (and its `seen_only` one), made on first use. Replaced,
# never cleared, when the default is: a call that read the old dicts while the default changed
# writes only to those.
_default_dispatchers: dict[str, Callable[..., Any]] = {}
_default_seen_dispatchers: dict[str, Callable[..., Any]] = {}


def default_hal() -> HardwareAbstractionLayer:
    """The process's default HAL, made on first use; the only HAL that is a global."""
    global _default
    hal = _default
    if hal is None:
        with _default_lock:
            if _default is None:
                from torchhal.hal_core.hal import HardwareAbstractionLayer

                _default = HardwareAbstractionLayer()
            hal = _default
    return hal


def set_default_hal(hal: HardwareAbstractionLayer | None) -> None:
    """Replace the default HAL (None: make a new one on next use)."""
    global _default, _default_dispatchers, _default_seen_dispatchers
    with _default_lock:
        _default = hal
        _default_dispatchers, _default_seen_dispatchers = {}, {}


def dispatch(op: str, *args: Any) -> Any:
    """Run registry op `op` (a core op or one a plugin defined) on positional `args`, as the ops
    of this module do: through the HAL of the innermost `hal.use(device)` block, else the
    default HAL, on the device of the first argument (a tensor). What a plugin's own
    `torch.library.custom_op` wrapper calls (adapter guide §8). Autocast is the caller's: this
    module's ops apply torch's autocast rule and then call here with it off, and a wrapper turns
    it off itself. An op no HAL defines raises `UnknownOpError`, naming the op and the defined
    ones. (Every op call of this module comes here: one frame, one `use()` lookup, one dict
    lookup.)"""
    use = active_use()
    if use is not None:
        return use[0].dispatch(op, *args)
    dispatchers = _default_dispatchers
    try:
        call = dispatchers[op]
    except (KeyError, TypeError):  # TypeError: an unhashable op name, named by `_bind_default`
        call = _bind_default(dispatchers, op, seen_only=False)
    return call(*args)


def _dispatch_seen(op: str, args: tuple[Any, ...]) -> Any:
    """The default HAL's `dispatch_seen` (NOT_SEEN inside a `use()` block: those take `dispatch`)."""
    if active_use() is not None:
        return NOT_SEEN
    dispatchers = _default_seen_dispatchers
    call = dispatchers.get(op) or _bind_default(dispatchers, op, seen_only=True)
    return call(args)


def _bind_default(
    dispatchers: dict[str, Callable[..., Any]], op: str, *, seen_only: bool
) -> Callable[..., Any]:
    """The default HAL's dispatcher for `op`, kept for the next call. An op the HAL does not
    define raises its UnknownOpError here, before anything is kept: a misspelt name, or a
    tensor passed where the op's name goes, stayed in the dict (and the tensor alive) for good."""
    hal = default_hal()
    call = hal.dispatcher(op, seen_only=seen_only)
    hal.kernels.op(op)
    dispatchers[op] = call
    return call


def _public(spec: AutogradSpec) -> Callable[..., Any]:
    """The op's DifferentiableOp as its bound `__call__`: calling the instance would go through
    its type's call slot, a tenth of a µs more on every op call."""
    return DifferentiableOp(spec, dispatch, _dispatch_seen).__call__


_MATMUL = _public(_matmul.AUTOGRAD)
_RMS_NORM = _public(_rms_norm.AUTOGRAD)
_LAYER_NORM = _public(_layer_norm.AUTOGRAD)
_SWIGLU = _public(_swiglu.SWIGLU_AUTOGRAD)
_GEGLU = _public(_swiglu.GEGLU_AUTOGRAD)
_ROPE = _public(_rope.AUTOGRAD)
_ATTENTION = _public(_attention.AUTOGRAD)
_ATTENTION_VARLEN = _public(_attention_varlen.AUTOGRAD)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, as torch.matmul (broadcast batch dimensions, vector operands)."""
    return _MATMUL(a, b)  # type: ignore[no-any-return]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return _RMS_NORM(x, weight, eps)  # type: ignore[no-any-return]


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return _LAYER_NORM(x, weight, bias, eps)  # type: ignore[no-any-return]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return _SWIGLU(gate, up)  # type: ignore[no-any-return]


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up."""
    return _GEGLU(gate, up)  # type: ignore[no-any-return]


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k, Hugging Face's rotate-half convention."""
    return _ROPE(q, k, cos, sin)  # type: ignore[no-any-return]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v in SDPA's layout; GQA/MQA, bottom-right causal, sliding window."""
    return _ATTENTION(q, k, v, causal, scale, window)  # type: ignore[no-any-return]


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over packed sequences: q (total_q, heads_q, dim), offsets in cu_seqlens."""
    return _ATTENTION_VARLEN(  # type: ignore[no-any-return]
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale
    )


_LINEAR_CROSS_ENTROPY = _public(_linear_cross_entropy.AUTOGRAD)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, target, ...) without materialising the logits.

    hidden (..., H), weight (V, H), bias (V,) or None, target (...) of class indices; reduction
    "mean" (over tokens not ignored), "sum" or "none". Fused: the training forward walks the
    tokens in chunks and computes the gradients as it goes (see torchhal.kernels.linear_cross_entropy).
    """
    args = _linear_cross_entropy.public_arguments(
        hidden, weight, target, bias, ignore_index, label_smoothing, reduction
    )
    return _LINEAR_CROSS_ENTROPY(*args)  # type: ignore[no-any-return]
