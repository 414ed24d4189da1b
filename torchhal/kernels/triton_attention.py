"""The Triton FlashAttention candidates: what they accept, and their callables bound to a device.

Kernels live in `triton_attention_kernels` (it imports triton); tile sizes come from
`triton_attention_config.launch_configs(caps, ...)`, computed once per (device, head dim,
dtype). Both are imported on first bind, so discovery never pays for them. The candidates take
any strides and return contiguous tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from torchhal.hal_core import DeviceCapabilities, KernelRegistry, RejectionReason, Unsupported
from torchhal.kernels._checks import PROVIDER
from torchhal.kernels.triton_rows import triton_unsupported, unbound

if TYPE_CHECKING:
    from torchhal.kernels.triton_attention_config import LaunchConfigs
    from torchhal.kernels.triton_attention_kernels import Problem

MAX_HEAD_DIM = 256  # padded q/k/v tiles beyond this leave no registers for the scores
INTERPRETER_BACKEND = "triton-interpreter"  # kernel backend the CPU adapter declares under TRITON_INTERPRET=1


class Shapes(Protocol):
    """What the predicate reads from the dense and varlen signatures alike."""

    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def v_head_dim(self) -> int: ...
    @property
    def empty(self) -> bool: ...


def supports(caps: DeviceCapabilities, sig: Shapes) -> Unsupported | None:
    verdict = triton_unsupported(caps, sig.dtype)
    if verdict is not None:
        return verdict
    if INTERPRETER_BACKEND in caps.kernel_backends and sig.dtype != torch.float32:
        return Unsupported(
            RejectionReason.DTYPE, f"the Triton interpreter computes fp32 only, got {sig.dtype}"
        )
    if sig.head_dim != sig.v_head_dim:
        return Unsupported(RejectionReason.SHAPE, f"head dims differ: qk {sig.head_dim}, v {sig.v_head_dim}")
    if sig.head_dim > MAX_HEAD_DIM:
        return Unsupported(RejectionReason.SHAPE, f"head dim {sig.head_dim} > {MAX_HEAD_DIM}")
    if sig.empty:
        return Unsupported(RejectionReason.SHAPE, "an empty problem: nothing to launch")
    return None


def register(
    registry: KernelRegistry, op: str, bind: Callable[[DeviceCapabilities], Callable[..., Any]]
) -> None:
    """`bind`'s kernel as `op`'s Triton candidate: every dense and packed attention op shares this
    predicate and priority (above SDPA's)."""
    registry.register(op, "triton", unbound, provider=PROVIDER, supports=supports, priority=20, bind=bind)


class GroupShapes(Shapes, Protocol):
    @property
    def group_rows_bucket(self) -> int: ...


def decode_supports(caps: DeviceCapabilities, sig: GroupShapes) -> Unsupported | None:
    """The split-KV kernel: what the FlashAttention kernel takes, with at most DECODE_MAX_ROWS
    query rows per kv head (query heads per kv head x query length): decoding and short chunks."""
    from torchhal.kernels.triton_attention_config import DECODE_MAX_ROWS

    verdict = supports(caps, sig)
    if verdict is not None:
        return verdict
    if 1 << sig.group_rows_bucket > DECODE_MAX_ROWS:
        return Unsupported(
            RejectionReason.SHAPE,
            f"query rows per kv head (heads per kv head x query length) above {DECODE_MAX_ROWS}, "
            f"got up to {1 << sig.group_rows_bucket}: the split-KV kernel is for decoding",
        )
    return None


def register_decode(
    registry: KernelRegistry, op: str, bind: Callable[[DeviceCapabilities], Callable[..., Any]]
) -> None:
    """`bind`'s split-KV kernel as `op`'s `triton_decode` candidate, preferred to the FlashAttention
    kernel where it applies (a few query rows per kv head), when selection does not measure."""
    registry.register(
        op, "triton_decode", unbound, provider=PROVIDER, supports=decode_supports, priority=25, bind=bind
    )


class _Configs:
    """Launch configurations of one device, made once per (padded head dim, element size)."""

    def __init__(self, caps: DeviceCapabilities) -> None:
        from torchhal.kernels.triton_attention_config import launch_configs

        self._make = functools.partial(launch_configs, caps)
        self._made: dict[tuple[int, int], LaunchConfigs] = {}

    def of(self, q: torch.Tensor, head_dim_padded: int) -> LaunchConfigs:
        key = (head_dim_padded, q.element_size())
        configs = self._made.get(key)
        if configs is None:
            configs = self._made[key] = self._make(*key)
        return configs


def _problem(packed_op: str | None) -> Callable[..., Problem]:
    """What makes an op's problem of (q, k, *its arguments after v): attention's (None), or the
    packed op `packed_op`'s. Imports the kernels: called when a candidate is bound."""
    from torchhal.kernels import triton_attention_kernels as kernels

    if packed_op is None:
        return kernels.dense_problem
    return functools.partial(kernels.packed_problem, packed_op)


def _bind_forward(
    caps: DeviceCapabilities, packed_op: str | None
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """An op's forward, (q, k, v, *its other arguments) -> (out, lse): one launch for the dense and
    packed layouts, which differ only in the problem `_problem(packed_op)` makes of those arguments."""
    from torchhal.kernels import triton_attention_kernels as kernels

    configs, problem = _Configs(caps), _problem(packed_op)

    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        made = problem(q, k, *args, **kwargs)
        return kernels.forward(q, k, v, made, configs.of(q, made.head_dim_padded))

    return forward


def _bind_backward(
    caps: DeviceCapabilities, packed_op: str | None
) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """An op's backward, (grad_out, q, k, v, out, lse, *its other arguments) -> (dq, dk, dv), as
    `_bind_forward` launches the forward."""
    from torchhal.kernels import triton_attention_kernels as kernels

    configs, problem = _Configs(caps), _problem(packed_op)

    def backward(
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        made = problem(q, k, *args, **kwargs)
        return kernels.backward(grad_out, q, k, v, out, lse, made, configs.of(q, made.head_dim_padded))

    return backward


def _output_only(forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., torch.Tensor]:
    def op(*args: Any, **kwargs: Any) -> torch.Tensor:
        return forward(*args, **kwargs)[0]

    return op


def bind_forward(caps: DeviceCapabilities) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """attention_forward: (out, lse) for dense (batch, heads, seq, dim) tensors."""
    return _bind_forward(caps, None)


def bind_attention(caps: DeviceCapabilities) -> Callable[..., torch.Tensor]:
    """attention (no gradient): the forward's output alone."""
    return _output_only(bind_forward(caps))


def bind_backward(caps: DeviceCapabilities) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """attention_backward: (dq, dk, dv) from the output gradient and the forward's out and lse."""
    return _bind_backward(caps, None)


def bind_varlen_forward(caps: DeviceCapabilities) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """attention_varlen_forward: (out, lse) for packed (tokens, heads, dim) tensors."""
    return _bind_forward(caps, "attention_varlen_forward")


def bind_varlen(caps: DeviceCapabilities) -> Callable[..., torch.Tensor]:
    return _output_only(_bind_forward(caps, "attention_varlen"))


def bind_varlen_backward(
    caps: DeviceCapabilities,
) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return _bind_backward(caps, "attention_varlen_backward")


def _bind_decode(caps: DeviceCapabilities, packed_op: str | None) -> Callable[..., Any]:
    """An op's split-KV forward, (q, k, v, *its other arguments) -> (out, lse), for the dense and
    packed layouts alike (as `_bind_forward`), its key slices sized from the device's compute units
    (`decode_splits`) over the keys the queries can see (`visible_keys`) and the keys all of them
    read (`keys_read`)."""
    from torchhal.kernels import triton_attention_decode as decode
    from torchhal.kernels.triton_attention_config import (
        DECODE_MAX_SPLITS,
        DECODE_SCRATCH_PER_KV,
        TileConfig,
        decode_splits,
        decode_tile,
    )

    problem = _problem(packed_op)
    tiles: dict[tuple[int, int, int], TileConfig] = {}

    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        made = problem(q, k, *args, **kwargs)
        rows = decode.query_tile_rows(made.heads_q, made.heads_kv, made.seq_q)
        key = (made.head_dim_padded, q.element_size(), rows)
        tile = tiles.get(key)
        if tile is None:
            tile = tiles[key] = decode_tile(caps, *key)
        keys = decode.visible_keys(made, tile.block_n)
        work = made.heads_kv * decode.keys_read(made, k, keys)
        kv_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
        most = DECODE_SCRATCH_PER_KV * kv_bytes // max(1, decode.split_scratch_bytes(made))
        splits, keys_per_split = decode_splits(caps, work, keys, tile.block_n, min(DECODE_MAX_SPLITS, most))
        return decode.forward(q, k, v, made, tile, splits, keys_per_split)

    return forward


def bind_decode_forward(caps: DeviceCapabilities) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """attention_forward by split-KV: (out, lse) for dense tensors with few query rows per kv head."""
    return _bind_decode(caps, None)


def bind_decode_attention(caps: DeviceCapabilities) -> Callable[..., torch.Tensor]:
    """attention (no gradient) by split-KV: the output alone."""
    return _output_only(bind_decode_forward(caps))


def bind_decode_varlen_forward(caps: DeviceCapabilities) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """attention_varlen_forward by split-KV: packed sequences of a few query rows each (decoding
    steps of a batch of sequences with caches of their own lengths)."""
    return _bind_decode(caps, "attention_varlen_forward")


def bind_decode_varlen(caps: DeviceCapabilities) -> Callable[..., torch.Tensor]:
    return _output_only(_bind_decode(caps, "attention_varlen"))
