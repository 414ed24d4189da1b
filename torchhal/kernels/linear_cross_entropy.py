"""linear_cross_entropy: cross_entropy(hidden @ weight.T + bias, target) without the (tokens, vocab) logits.

hidden (..., H), weight (V, H), bias (V,) or None, target (...) of int64 (or int32) class indices.
`ignore_index`, `label_smoothing` and `reduction` ("mean", "sum", "none") mean what they mean to
`torch.nn.functional.cross_entropy`: with smoothing eps a token's loss is
lse - (1 - eps) * logit[target] - eps / V * sum(logits); ignored tokens add 0, and "mean" divides
the sum by the number of tokens not ignored (so it is NaN when every token is ignored, as torch's).
The loss is fp32 (fp64 for fp64 inputs), the precision it is computed in, as Liger's fused loss and
transformers' causal-LM loss give it: rounding it to bf16 would keep three significant digits of a
figure training logs compare across steps. The gradients come in their inputs' dtypes.

Three registry ops:
- `linear_cross_entropy(...) -> loss`: no gradient needed;
- `linear_cross_entropy_forward(...) -> (loss, grad_hidden, grad_weight, grad_bias)`, for training:
  with "mean" or "sum" the gradients of the loss itself are computed during the forward (the
  fused way: each chunk's logits are turned into d loss / d logits in place and multiplied
  into the three gradients at once, so they are never kept); with "none" the gradient slots
  are empty and the backward recomputes (a per-token grad_output cannot be applied afterwards
  to a weight gradient already summed over tokens);
- `linear_cross_entropy_backward(grad_loss, grad_hidden, grad_weight, grad_bias, hidden, weight,
  target, bias, ignore_index, label_smoothing, reduction) -> (dhidden, dweight, dbias)`: scales
  the forward's gradients by the scalar grad_loss ("mean", "sum": hidden, weight, target and
  bias may then be None, and the autograd context passes None so it keeps no activations), or
  recomputes them with per-token weights grad_loss ("none").

No bias: the registry ops take None or a 0-element tensor alike. The public function passes a
0-element stand-in, because the backward returns a tensor for every differentiable input (a
custom op cannot return None) and autograd refuses a gradient for an input that was None.

The training forward computes the gradients of hidden, weight and bias (when given) whether or
not each requires grad: the DifferentiableOp contract hands the forward its inputs, not which
of them need gradients (under torch.compile the custom op sees detached tensors). A frozen
weight thus costs one of the three matmuls it could skip.

Targets outside [0, V) that are not ignore_index: every candidate runs `check_targets` first. On
the CPU it raises InvalidArgumentError naming the value; on a device it queues an asynchronous
device assert (no host sync), which fails at the next synchronisation as torch's cross_entropy
does there. Behind it the Triton row kernel still gives such a token a NaN loss and never reads
out of its row.

The Triton candidates (triton_cross_entropy) walk the tokens in chunks; `ChunkPlan` says how big.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from torchhal.hal_core import (
    DeviceCapabilities,
    DType,
    InvalidArgumentError,
    KernelRegistry,
    Unsupported,
    UnsupportedError,
)
from torchhal.hal_core.kernels import is_finite_number
from torchhal.kernels._checks import (
    PROVIDER,
    queue_device_assert,
    require_min_rank,
    require_rank,
    require_same,
    require_tensor,
    seen_number,
)
from torchhal.kernels.autograd import AutogradSpec
from torchhal.kernels.triton_rows import (
    RowLaunch,
    compute_dtype,
    require_floating,
    triton_unsupported,
    unbound,
)

OP = "linear_cross_entropy"
FORWARD = "linear_cross_entropy_forward"
BACKWARD = "linear_cross_entropy_backward"
REDUCTIONS = ("mean", "sum", "none")
TARGET_DTYPES = (torch.int64, torch.int32)

HOST_TARGET_CHECKS = "torchhal.kernels.lce_host_target_checks"  # counter of host reads off the CPU

# Chunk size. Each chunk reads and writes the fp32 weight-gradient accumulator (8 * V * H bytes)
# for the 2 * rows * V * H flops of its weight-gradient matmul, so a chunk needs
# rows >= ACCUMULATOR_AMORTISATION * (declared matmul flop/s) / (declared memory bytes/s) for
# that matmul, not the accumulator traffic, to bound its time. Measured on an H100 (vocab 128k,
# hidden 2048): the fp32-output matmul ran at 448 TF/s at 896 rows, 591 at 1280, 743 at 2048 and
# 816 at 4096, against 708-829 for a bf16 output; 6 gives 1792 rows on an H100 SXM, 1280 on an
# H200, 896 on an A100.
ACCUMULATOR_AMORTISATION = 6
DEFAULT_MIN_CHUNK_ROWS = 1024  # devices that declare no peaks
MIN_CHUNK_ROWS_RANGE = (256, 8192)
CHUNK_ALIGN = 128  # chunk rows round up to this (matmul tiles), when a chunk has more rows


def min_chunk_rows(caps: DeviceCapabilities) -> int:
    """Rows per chunk from which the weight-gradient matmul, not its accumulator, sets the pace,
    from the device's declared matmul peak and memory bandwidth (DEFAULT_MIN_CHUNK_ROWS when it
    declares neither); `ChunkPlan.chunk_rows` aims its chunks at it."""
    peaks = caps.declared_peaks
    if peaks is None or not peaks.memory_bandwidth_gbps:
        return DEFAULT_MIN_CHUNK_ROWS
    tflops = [peaks.tflops[d] for d in (DType.BF16, DType.FP16, DType.FP32) if d in peaks.tflops]
    if not tflops:
        return DEFAULT_MIN_CHUNK_ROWS
    flop_per_byte = max(tflops) * 1e12 / (peaks.memory_bandwidth_gbps * 1e9)
    rows = CHUNK_ALIGN * math.ceil(ACCUMULATOR_AMORTISATION * flop_per_byte / CHUNK_ALIGN)
    low, high = MIN_CHUNK_ROWS_RANGE
    return min(high, max(low, rows))


class ChunkPlan(NamedTuple):
    """How the Triton candidates split the tokens, and how their row kernel launches."""

    launch: RowLaunch
    min_rows: int = DEFAULT_MIN_CHUNK_ROWS

    @classmethod
    def from_caps(cls, caps: DeviceCapabilities) -> ChunkPlan:
        return cls(RowLaunch.from_caps(caps), min_chunk_rows(caps))

    def chunk_rows(self, tokens: int, hidden: int, vocab: int) -> int:
        """Rows per chunk: as many chunks as keep a chunk's logits within hidden's size (tokens *
        hidden elements) when that allows `min_rows` rows, else tokens / `min_rows` chunks rounded
        to the nearest count, at least one, so a chunk holds 3/4 to 3/2 of `min_rows` rows (all the
        tokens when fewer): the peak memory is the fp32 weight-gradient accumulator plus one
        chunk's logits, and a chunk well past `min_rows` costs memory and buys little speed. The
        tokens then spread evenly over the chunks (rounded up to CHUNK_ALIGN rows)."""
        if tokens <= 0:
            return 1
        budget = tokens * hidden // max(vocab, 1)
        if budget >= self.min_rows:
            chunks = -(-tokens // budget)
        else:
            chunks = max(1, int(tokens / max(self.min_rows, 1) + 0.5))
        rows = -(-tokens // chunks)
        if rows > CHUNK_ALIGN:
            rows = CHUNK_ALIGN * -(-rows // CHUNK_ALIGN)
        return min(rows, tokens)


class LinearCrossEntropySignature(NamedTuple):
    dtype: torch.dtype
    bias: bool
    reduction: str
    smoothing: bool


def has_bias(bias: torch.Tensor | None) -> bool:
    return bias is not None and bias.numel() > 0


def public_arguments(
    hidden: Any,
    weight: Any,
    target: Any,
    bias: Any,
    ignore_index: Any,
    label_smoothing: Any,
    reduction: Any,
) -> tuple[Any, ...]:
    """The registry ops' arguments from the public function's: a 0-element stand-in for no bias,
    an int label_smoothing as a float (the custom op's schema says float)."""
    if bias is None and isinstance(hidden, torch.Tensor):
        require_tensor("linear_cross_entropy", "hidden", hidden)  # refuses one new_empty fails on
        bias = hidden.new_empty(0)
    if isinstance(label_smoothing, int) and not isinstance(label_smoothing, bool):
        label_smoothing = float(label_smoothing)
    return hidden, weight, target, bias, ignore_index, label_smoothing, reduction


def _check_scalars(op: str, ignore_index: Any, label_smoothing: Any, reduction: Any) -> None:
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise InvalidArgumentError(
            f"{op}: ignore_index must be a Python int, got {seen_number(ignore_index)}"
        )
    if not is_finite_number(label_smoothing) or not 0.0 <= label_smoothing <= 1.0:
        raise InvalidArgumentError(
            f"{op}: label_smoothing must be a Python float in [0, 1], got {seen_number(label_smoothing)}"
        )
    if reduction not in REDUCTIONS:
        raise InvalidArgumentError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _check(
    op: str,
    hidden: Any,
    weight: Any,
    target: Any,
    bias: Any,
    ignore_index: Any,
    label_smoothing: Any,
    reduction: Any,
) -> LinearCrossEntropySignature:
    require_tensor(op, "hidden", hidden)
    require_tensor(op, "weight", weight)
    require_tensor(op, "target", target)
    require_min_rank(op, "hidden", hidden, 1)
    require_rank(op, "weight", weight, 2)
    require_floating(op, "hidden", hidden)
    if weight.shape[1] != hidden.shape[-1]:
        raise InvalidArgumentError(
            f"{op}: hidden's last dimension must equal weight's second (weight is (vocab, hidden)), "
            f"got hidden shape {tuple(hidden.shape)} and weight shape {tuple(weight.shape)}"
        )
    if weight.shape[0] < 1:
        raise InvalidArgumentError(f"{op}: vocab (weight's first dimension) must be >= 1, got 0")
    if weight.shape[1] < 1:
        raise InvalidArgumentError(f"{op}: the hidden size (weight's second dimension) must be >= 1, got 0")
    if target.dtype not in TARGET_DTYPES:
        raise UnsupportedError(
            f"{op}: target must be an int64 (or int32) tensor of class indices, got dtype {target.dtype}"
        )
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise InvalidArgumentError(
            f"{op}: target's shape must be hidden's without its last dimension, "
            f"{tuple(hidden.shape[:-1])}, got {tuple(target.shape)}"
        )
    dtypes: dict[str, object] = {"hidden": hidden.dtype, "weight": weight.dtype}
    devices: dict[str, object] = {"hidden": hidden.device, "weight": weight.device, "target": target.device}
    if bias is not None:
        require_tensor(op, "bias", bias)
        if has_bias(bias):
            if tuple(bias.shape) != (weight.shape[0],):
                raise InvalidArgumentError(
                    f"{op}: bias must have shape (vocab,) = ({weight.shape[0]},), got {tuple(bias.shape)}"
                )
            dtypes["bias"], devices["bias"] = bias.dtype, bias.device
    require_same(op, "dtypes", **dtypes)
    require_same(op, "devices", **devices)
    _check_scalars(op, ignore_index, label_smoothing, reduction)
    bounds = torch.iinfo(target.dtype)  # beyond them, torch's comparison with the targets wraps
    if not bounds.min <= ignore_index <= bounds.max:
        raise InvalidArgumentError(
            f"{op}: ignore_index must fit target's dtype {target.dtype} ([{bounds.min}, {bounds.max}]), "
            f"got {ignore_index}"
        )
    return LinearCrossEntropySignature(hidden.dtype, has_bias(bias), reduction, label_smoothing > 0)


def signature(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> LinearCrossEntropySignature:
    return _check(OP, hidden, weight, target, bias, ignore_index, label_smoothing, reduction)


def forward_signature(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> LinearCrossEntropySignature:
    return _check(FORWARD, hidden, weight, target, bias, ignore_index, label_smoothing, reduction)


def backward_signature(
    grad_loss: torch.Tensor,
    grad_hidden: torch.Tensor,
    grad_weight: torch.Tensor,
    grad_bias: torch.Tensor,
    hidden: torch.Tensor | None,
    weight: torch.Tensor | None,
    target: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> LinearCrossEntropySignature:
    op = BACKWARD
    for name, t in (("grad_loss", grad_loss), ("grad_hidden", grad_hidden), ("grad_weight", grad_weight)):
        require_tensor(op, name, t)
    require_tensor(op, "grad_bias", grad_bias)
    _check_scalars(op, ignore_index, label_smoothing, reduction)
    if reduction == "none":
        sig = _check(op, hidden, weight, target, bias, ignore_index, label_smoothing, reduction)
        assert target is not None and hidden is not None  # checked by _check
        require_same(
            op, "grad_loss and target shapes", grad_loss=tuple(grad_loss.shape), target=tuple(target.shape)
        )
        require_same(op, "dtypes", grad_loss=grad_loss.dtype, loss=compute_dtype(hidden.dtype))
        require_same(op, "devices", grad_loss=grad_loss.device, hidden=hidden.device)
        return sig
    if grad_loss.dim() != 0:
        raise InvalidArgumentError(
            f"{op}: grad_loss of a {reduction!r} loss must be a scalar, got shape {tuple(grad_loss.shape)}"
        )
    require_floating(op, "grad_hidden", grad_hidden)
    require_same(op, "dtypes", grad_loss=grad_loss.dtype, loss=compute_dtype(grad_hidden.dtype))
    dtypes = {
        "grad_hidden": grad_hidden.dtype,
        "grad_weight": grad_weight.dtype,
    }
    devices = {
        "grad_loss": grad_loss.device,
        "grad_hidden": grad_hidden.device,
        "grad_weight": grad_weight.device,
    }
    if grad_bias.numel() > 0:
        dtypes["grad_bias"], devices["grad_bias"] = grad_bias.dtype, grad_bias.device
    require_same(op, "dtypes", **dtypes)
    require_same(op, "devices", **devices)
    return LinearCrossEntropySignature(
        grad_hidden.dtype, grad_bias.numel() > 0, reduction, label_smoothing > 0
    )


def check_targets(op: str, target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Every target in [0, vocab) or ignore_index, as torch's cross_entropy requires; every
    candidate runs it, since validation never reads values and past it the kernels would give NaN
    and the references index out of range. A CPU tensor's values are read: InvalidArgumentError
    names the first bad one. Elsewhere that read would be a host sync per call, so the check is
    queued on the device (`torch._assert_async`) and fails asynchronously, as torch's own
    cross_entropy's device assert does; a device type without it is read on the host (logged,
    counted)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    message = f"{op}: target values must lie in [0, {vocab}) or equal ignore_index {ignore_index}"
    if queue_device_assert(target.device, lambda: bad.logical_not().all(), message, HOST_TARGET_CHECKS):
        return
    if bool(bad.any()):
        raise InvalidArgumentError(f"{message}, got {int(target[bad].flatten()[0])}")


def _reference_gradients(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    grad_loss: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of hidden, weight (and bias) of grad_loss (default 1) times the loss, on full logits
    in fp32 (fp64 for fp64): d loss_i / d logits_i = softmax_i - (1 - eps) onehot(target_i) - eps / V,
    times 1 / (tokens not ignored) for "mean" and 0 for an ignored token. Written out rather than
    by autograd: custom-op implementations (torch.compile's path) run with autograd switched off.
    The caller has checked the targets."""
    ct = compute_dtype(hidden.dtype)
    h, w = hidden.reshape(-1, hidden.shape[-1]).to(ct), weight.to(ct)
    b = bias.to(ct) if has_bias(bias) else None  # type: ignore[union-attr]
    t = target.reshape(-1).long()
    logits = torch.nn.functional.linear(h, w, b)
    kept = t != ignore_index
    eps, vocab = float(label_smoothing), weight.shape[0]
    onehot = torch.zeros_like(logits).scatter_(1, t.clamp(0, vocab - 1).unsqueeze(1), 1.0)
    d_logits = torch.softmax(logits, dim=1) - (1 - eps) * onehot - eps / vocab
    seed = torch.ones((), dtype=ct, device=h.device) if grad_loss is None else grad_loss.to(ct)
    if reduction == "none":
        scale = seed.reshape(-1, 1)
    elif reduction == "mean":
        scale = seed / kept.sum()  # inf when every token is ignored; those rows are zeroed below
    else:
        scale = seed
    d_logits = torch.where(kept.unsqueeze(1), d_logits * scale, 0.0)
    grads = [d_logits @ w, d_logits.t() @ h]
    if b is not None:
        grads.append(d_logits.sum(0))
    return tuple(grads)


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """torch's cross_entropy on the full logits, in fp32 (fp64 for fp64), the loss's dtype."""
    check_targets(OP, target, weight.shape[0], ignore_index)
    ct = compute_dtype(hidden.dtype)
    b = bias.to(ct) if has_bias(bias) else None  # type: ignore[union-attr]
    logits = torch.nn.functional.linear(hidden.to(ct).reshape(-1, hidden.shape[-1]), weight.to(ct), b)
    loss = torch.nn.functional.cross_entropy(
        logits, target.reshape(-1).long(), ignore_index=ignore_index,
        label_smoothing=float(label_smoothing), reduction=reduction,
    )  # fmt: skip
    return loss.reshape(target.shape) if reduction == "none" else loss


def _empty_grads(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return hidden.new_empty(0), hidden.new_empty(0), hidden.new_empty(0)


def _cast_grads(
    grads: Sequence[torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_bias = grads[2].to(bias.dtype) if len(grads) > 2 and bias is not None else hidden.new_empty(0)
    return grads[0].reshape(hidden.shape).to(hidden.dtype), grads[1].to(weight.dtype), grad_bias


def reference_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, d loss/d hidden, d loss/d weight, d loss/d bias or empty); empty gradients for "none"."""
    if reduction == "none":
        return (reference(hidden, weight, target, bias, ignore_index, label_smoothing, reduction),
                *_empty_grads(hidden))  # fmt: skip
    loss = reference(hidden, weight, target, bias, ignore_index, label_smoothing, reduction)  # checks
    grads = _reference_gradients(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, None)
    return (loss, *_cast_grads(grads, hidden, weight, bias))


SCALE_SLAB_BYTES = 64 << 20  # fp32 temporaries of scale_gradients, a row slab at a time


def scale_gradients(
    grad_loss: torch.Tensor, grads: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's gradients of a scalar loss times grad_loss, in fp32 (fp64 for fp64), rounded
    once; a row slab at a time, so a (vocab, hidden) weight gradient gets no full fp32 copy."""
    out = []
    for g in grads:
        ct = compute_dtype(g.dtype)
        factor = grad_loss.to(ct)
        scaled = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        rows = g.reshape(-1, g.shape[-1]) if g.dim() > 1 else g.reshape(1, -1)
        dest = scaled.view(rows.shape)
        step = max(1, SCALE_SLAB_BYTES // max(1, rows.shape[1] * torch.finfo(ct).bits // 8))
        for start in range(0, rows.shape[0], step):
            dest[start : start + step] = rows[start : start + step].to(ct) * factor
        out.append(scaled)
    return out[0], out[1], out[2]


def reference_backward(
    grad_loss: torch.Tensor,
    grad_hidden: torch.Tensor,
    grad_weight: torch.Tensor,
    grad_bias: torch.Tensor,
    hidden: torch.Tensor | None,
    weight: torch.Tensor | None,
    target: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scaled forward gradients ("mean", "sum"); recomputed with per-token grad_loss ("none")."""
    if reduction != "none":
        return scale_gradients(grad_loss, (grad_hidden, grad_weight, grad_bias))
    assert hidden is not None and weight is not None and target is not None
    check_targets(BACKWARD, target, weight.shape[0], ignore_index)
    grads = _reference_gradients(
        hidden, weight, target, bias, ignore_index, label_smoothing, reduction, grad_loss
    )
    return _cast_grads(grads, hidden, weight, bias)


def triton_supports(caps: DeviceCapabilities, sig: LinearCrossEntropySignature) -> Unsupported | None:
    return triton_unsupported(caps, sig.dtype)


def _bind(name: str) -> Callable[[DeviceCapabilities], Callable[..., Any]]:
    def bind(caps: DeviceCapabilities) -> Callable[..., Any]:
        from torchhal.kernels import triton_cross_entropy

        return functools.partial(getattr(triton_cross_entropy, name), ChunkPlan.from_caps(caps))

    return bind


def _loss_fake(hidden: torch.Tensor, target: torch.Tensor, reduction: str) -> torch.Tensor:
    shape = tuple(target.shape) if reduction == "none" else ()
    return hidden.new_empty(shape, dtype=compute_dtype(hidden.dtype))


def _forward_fake(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # under torch.compile the fake meets bad input first
    _check(OP, hidden, weight, target, bias, ignore_index, label_smoothing, reduction)
    loss = _loss_fake(hidden, target, reduction)
    if reduction == "none":
        return (loss, *_empty_grads(hidden))
    grad_bias = bias.new_empty(bias.shape) if bias is not None else hidden.new_empty(0)
    return loss, hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), grad_bias


def _backward_fake(
    grad_loss: torch.Tensor,
    grad_hidden: torch.Tensor,
    grad_weight: torch.Tensor,
    grad_bias: torch.Tensor,
    hidden: torch.Tensor | None,
    weight: torch.Tensor | None,
    target: torch.Tensor | None,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if reduction != "none":
        return (grad_hidden.new_empty(grad_hidden.shape), grad_weight.new_empty(grad_weight.shape),
                grad_bias.new_empty(grad_bias.shape))  # fmt: skip
    assert hidden is not None and weight is not None
    grad_b = bias.new_empty(bias.shape) if bias is not None and bias.numel() else hidden.new_empty(0)
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), grad_b


def _context(inputs: Sequence[Any], results: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """The forward's gradients; the inputs too only for "none", whose backward recomputes."""
    hidden, weight, target, bias, ignore_index, label_smoothing, reduction = inputs
    _, grad_hidden, grad_weight, grad_bias = results
    if reduction == "none":
        saved = (hidden, weight, target, bias)
    else:
        saved = (None, None, None, None)
    return grad_hidden, grad_weight, grad_bias, *saved, ignore_index, label_smoothing, reduction


AUTOGRAD = AutogradSpec(
    op=OP,
    forward=FORWARD,
    backward=BACKWARD,
    forward_fake=_forward_fake,
    backward_fake=_backward_fake,
    differentiable=(0, 1, 3),
    autocast=(0, 1, 3),  # autocast casts them, as it does lm_head's linear inputs
    aten_op="aten::linear",
    context=_context,
)


def register(registry: KernelRegistry) -> None:
    registry.define_op(
        OP, reference, signature=signature, doc="cross_entropy(hidden @ weight.T + bias, target), fused"
    )
    registry.register(
        OP, "triton", unbound, provider=PROVIDER, supports=triton_supports, priority=20,
        bind=_bind("linear_cross_entropy"),
    )  # fmt: skip
    registry.define_op(
        FORWARD, reference_forward, signature=forward_signature,
        doc="(loss, grad_hidden, grad_weight, grad_bias) of linear_cross_entropy",
    )  # fmt: skip
    registry.register(
        FORWARD, "triton", unbound, provider=PROVIDER, supports=triton_supports, priority=20,
        bind=_bind("linear_cross_entropy_forward"),
    )  # fmt: skip
    registry.define_op(
        BACKWARD, reference_backward, signature=backward_signature,
        doc="(dhidden, dweight, dbias) of linear_cross_entropy",
    )  # fmt: skip
    registry.register(
        BACKWARD, "triton", unbound, provider=PROVIDER, supports=triton_supports, priority=20,
        bind=_bind("linear_cross_entropy_backward"),
    )  # fmt: skip
