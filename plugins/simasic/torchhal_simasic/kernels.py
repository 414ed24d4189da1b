"""simasic candidates for the core ops `matmul`, `rms_norm` and `attention`.

The registry calls a kernel as `fn(*args, **kwargs)`, without the device, and caches its
choice per (device id, signature). Each op therefore gets one candidate, `simasic/simasic`,
whose predicate accepts only this adapter's devices and whose `bind` hook makes, once per
selection, a kernel bound to the selected device's clock and ledger. Routing comes from the
registry alone: no hidden "current device" state, and several devices used at once (threads,
`hal.use` blocks) each charge their own clock.

A bound kernel computes with the op's reference implementation (real numerics, on the host),
charges the output to the ledger (DeviceOutOfMemoryError beyond capacity, clock untouched),
then advances the clock by exactly the cost model's time for the op.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torchhal.hal_core import (
    DeviceCapabilities,
    DType,
    KernelRegistry,
    RejectionReason,
    Unsupported,
    UnsupportedError,
)

from torchhal_simasic.cost import OpCost, attention_cost, matmul_cost, rms_norm_cost
from torchhal_simasic.spec import SimASICSpec
from torchhal_simasic.state import DeviceState

PROVIDER = "simasic"
PRIORITY = 100.0  # above the built-in host candidates, which would run without simulated cost

Reference = Callable[..., torch.Tensor]
Kernel = Callable[..., torch.Tensor]
Builder = Callable[[SimASICSpec, DeviceState, Reference], Kernel]


def register_simasic_kernels(
    registry: KernelRegistry, adapter: str, spec: SimASICSpec, states: Sequence[DeviceState]
) -> None:
    """Register the ops' candidates; `adapter` is the adapter's name as capabilities carry it."""
    matmul_dtypes = frozenset(spec.macs_per_cell_per_cycle)
    builders = {
        "matmul": (_matmul, matmul_dtypes),
        "rms_norm": (_rms_norm, spec.dtypes),
        "attention": (_attention, matmul_dtypes),  # both of its matmuls run on the array
    }
    builder: Builder
    for op, (builder, dtypes) in builders.items():
        registry.register(
            op,
            PROVIDER,
            _unbound(op),
            provider=PROVIDER,
            supports=_on_this_adapter(adapter, op, dtypes),
            priority=PRIORITY,
            bind=_binder(builder, spec, states, registry.op(op).reference),
        )


def matmul_dims(a: Sequence[int], b: Sequence[int]) -> tuple[int, int, int, int]:
    """(batch, M, K, N) of torch.matmul(a, b), folding batch dims into M where torch does."""
    if len(b) == 1:  # matrix-vector (or dot): a's leading dims are rows
        return 1, math.prod(a[:-1]), a[-1], 1
    if len(a) == 1:  # vector-matrix, batched over b
        return math.prod(b[:-2]), 1, a[0], b[-1]
    if len(b) == 2:  # a's batch dims fold into its rows
        return 1, math.prod(a[:-1]), a[-1], b[-1]
    batch = torch.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2]))  # type: ignore[no-untyped-call]
    return math.prod(batch), a[-2], a[-1], b[-1]


def _binder(
    build: Builder, spec: SimASICSpec, states: Sequence[DeviceState], reference: Reference
) -> Callable[[DeviceCapabilities], Kernel]:
    """The `bind` hook: a kernel charging the selected device (capabilities' index)."""

    def bind(caps: DeviceCapabilities) -> Kernel:
        return build(spec, states[caps.index], reference)

    return bind


def _on_this_adapter(
    adapter: str, op: str, dtypes: frozenset[DType]
) -> Callable[[DeviceCapabilities, Any], Unsupported | None]:
    def supports(caps: DeviceCapabilities, sig: Any) -> Unsupported | None:
        if caps.adapter != adapter:
            return Unsupported(RejectionReason.DEVICE, f"runs on {adapter} devices only, not {caps.adapter}")
        if DType.from_torch(sig.dtype) not in dtypes:
            supported = sorted(d.value for d in dtypes)
            return Unsupported(
                RejectionReason.DTYPE, f"{op} on {adapter} supports {supported}, got {sig.dtype}"
            )
        return None

    return supports


def _unbound(op: str) -> Kernel:
    """The candidate's `fn`: it needs a device, so only its bound form (via `bind`) runs."""

    def unbound(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise UnsupportedError(
            f"{op}: the simasic kernel is bound to a device when the registry selects it; "
            "call it through KernelRegistry.call or torchhal.ops"
        )

    return unbound


def _finish(state: DeviceState, out: torch.Tensor, cost: OpCost) -> torch.Tensor:
    state.ledger.track(out)
    state.clock.advance(cost.time_s)
    return out


def _dtype(dtype: torch.dtype) -> DType:
    declared = DType.from_torch(dtype)
    assert declared is not None, f"the predicate admitted {dtype}"
    return declared


def _matmul(spec: SimASICSpec, state: DeviceState, reference: Reference) -> Callable[..., torch.Tensor]:
    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        batch, m, k, n = matmul_dims(a.shape, b.shape)
        cost = matmul_cost(spec, m, k, n, _dtype(a.dtype), batch=batch)
        return _finish(state, reference(a, b), cost)

    return matmul


def _rms_norm(spec: SimASICSpec, state: DeviceState, reference: Reference) -> Callable[..., torch.Tensor]:
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        cost = rms_norm_cost(spec, math.prod(x.shape[:-1]), weight.shape[0], _dtype(x.dtype))
        return _finish(state, reference(x, weight, eps), cost)

    return rms_norm


def _attention(spec: SimASICSpec, state: DeviceState, reference: Reference) -> Callable[..., torch.Tensor]:
    def attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        scale: float | None = None,
        window: Sequence[int] | None = None,
    ) -> torch.Tensor:
        batch, heads, seq_q, head_dim = q.shape
        cost = attention_cost(
            spec,
            batch=batch,
            heads=heads,
            seq_q=seq_q,
            seq_k=k.shape[2],
            head_dim=head_dim,
            v_head_dim=v.shape[3],
            dtype=_dtype(q.dtype),
        )
        return _finish(state, reference(q, k, v, causal, scale, window), cost)

    return attention
