"""The gated activations swiglu(gate, up) = silu(gate) * up and geglu(gate, up) = gelu_tanh(gate) * up.

Each has a reference, a Triton candidate, and a backward op `<op>_backward(dy, gate, up) ->
(dgate, dup)` that recomputes the activation from gate. Computed in fp32 (fp64 for fp64) and
rounded once. The Triton candidates take gate, up (and dy) they can index as (rows, cols) with
unit column stride, so the two halves of a fused projection work without a copy; other layouts
are turned down (reason LAYOUT).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from torchhal.hal_core import DeviceCapabilities, KernelRegistry, Unsupported
from torchhal.kernels._checks import PROVIDER, require_same, require_tensor
from torchhal.kernels.autograd import AutogradSpec
from torchhal.kernels.triton_rows import (
    RowLaunch,
    compute_dtype,
    layout_unsupported,
    require_floating,
    row_stride,
    triton_unsupported,
    unbound,
)


class GatedSignature(NamedTuple):
    dtype: torch.dtype
    rows: bool  # every tensor indexes as (rows, cols) with unit column stride


def _check(op: str, **tensors: torch.Tensor) -> GatedSignature:
    for name, t in tensors.items():
        require_tensor(op, name, t)
    first = next(iter(tensors.values()))
    require_floating(op, next(iter(tensors)), first)
    require_same(op, "shapes", **{k: tuple(t.shape) for k, t in tensors.items()})
    require_same(op, "dtypes", **{k: t.dtype for k, t in tensors.items()})
    require_same(op, "devices", **{k: t.device for k, t in tensors.items()})
    return GatedSignature(first.dtype, all(row_stride(t) is not None for t in tensors.values()))


GELU_K = 0.7978845608028654  # sqrt(2 / pi), of gelu's tanh approximation
GELU_C = 0.044715


def _activation(op: str, gate: torch.Tensor) -> torch.Tensor:
    if op == "swiglu":
        return torch.nn.functional.silu(gate)
    return torch.nn.functional.gelu(gate, approximate="tanh")


def _activation_grad(op: str, gate: torch.Tensor) -> torch.Tensor:
    """d act / d gate, in the textbook forms (tanh for gelu; the kernels use the sigmoid form)."""
    if op == "swiglu":
        s = torch.sigmoid(gate)
        return s * (1 + gate * (1 - s))
    t = torch.tanh(GELU_K * (gate + GELU_C * gate.pow(3)))
    return 0.5 * (1 + t) + 0.5 * gate * (1 - t * t) * GELU_K * (1 + 3 * GELU_C * gate * gate)


def _reference(op: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up in fp32 (fp64 for fp64), returning gate's dtype."""
    ct = compute_dtype(gate.dtype)
    return (_activation(op, gate.to(ct)) * up.to(ct)).to(gate.dtype).contiguous()


def _reference_backward(
    op: str, dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """dgate = dy * up * act'(gate), dup = dy * act(gate)."""
    ct = compute_dtype(gate.dtype)
    g, dy32 = gate.to(ct), dy.to(ct)
    dgate = dy32 * up.to(ct) * _activation_grad(op, g)
    return dgate.to(gate.dtype).contiguous(), (dy32 * _activation(op, g)).to(gate.dtype).contiguous()


def triton_supports(caps: DeviceCapabilities, sig: GatedSignature) -> Unsupported | None:
    return triton_unsupported(caps, sig.dtype) or layout_unsupported(sig.rows)


def _backward_fake(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _context(inputs: Sequence[Any], results: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    gate, up = inputs
    return gate, up


def _spec(op: str) -> AutogradSpec:
    def fake(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        _check(op, gate=gate, up=up)  # under torch.compile the fake meets bad input first
        return gate.new_empty(gate.shape)

    return AutogradSpec(
        op=op,
        forward=op,
        backward=f"{op}_backward",
        forward_fake=fake,
        backward_fake=_backward_fake,
        differentiable=(0, 1),
        context=_context,
        backward_reference=functools.partial(_reference_backward, op),
    )


SWIGLU_AUTOGRAD = _spec("swiglu")
GEGLU_AUTOGRAD = _spec("geglu")


def _register_op(registry: KernelRegistry, op: str, doc: str) -> None:
    def signature(gate: torch.Tensor, up: torch.Tensor) -> GatedSignature:
        return _check(op, gate=gate, up=up)

    def backward_signature(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> GatedSignature:
        return _check(f"{op}_backward", dy=dy, gate=gate, up=up)

    def bind_forward(caps: DeviceCapabilities) -> Callable[..., torch.Tensor]:
        from torchhal.kernels import triton_gated

        return functools.partial(triton_gated.gated_forward, RowLaunch.from_caps(caps), op)

    def bind_backward(caps: DeviceCapabilities) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        from torchhal.kernels import triton_gated

        return functools.partial(triton_gated.gated_backward, RowLaunch.from_caps(caps), op)

    backward = f"{op}_backward"
    registry.define_op(op, functools.partial(_reference, op), signature=signature, doc=doc)
    registry.register(
        op, "triton", unbound, provider=PROVIDER, supports=triton_supports, priority=20, bind=bind_forward
    )
    registry.define_op(
        backward,
        functools.partial(_reference_backward, op),
        signature=backward_signature,
        doc=f"(dgate, dup) of {op}",
    )
    registry.register(
        backward, "triton", unbound, provider=PROVIDER, supports=triton_supports, priority=20,
        bind=bind_backward,
    )  # fmt: skip


def register(registry: KernelRegistry) -> None:
    _register_op(registry, "swiglu", "silu(gate) * up")
    _register_op(registry, "geglu", 'gelu(gate, approximate="tanh") * up')
