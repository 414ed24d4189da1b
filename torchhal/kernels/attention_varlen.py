"""attention_varlen: attention over sequences packed along one token axis, as FlashAttention's varlen API.

q (total_q, heads_q, dim), k and v (total_k, heads_kv, dim); sequence b owns query rows
cu_seqlens_q[b]:cu_seqlens_q[b+1] and key rows cu_seqlens_k[b]:cu_seqlens_k[b+1]. Each sequence
is attended as the dense op would (bottom-right causal per sequence); tokens outside every
sequence get zero output and zero gradients. Ops: `attention_varlen`, `attention_varlen_forward`
-> (out, lse (heads_q, total_q) fp32) and `attention_varlen_backward`.

The offsets must rise from 0 to at most the token count, with no sequence longer than its
`max_seqlen_*` (the Triton grid covers `max_seqlen` rows per sequence). On the CPU the signature
reads them and InvalidArgumentError names the values: calls there are validated every time
(`reads_values_on`). On an accelerator a read would synchronise every call, so the signature
reads only layouts (memoised as any op's) and the Triton candidates queue the check on the device
(`check_offsets`: one small launch and `torch._assert_async`, once per offset tensors and their
version); it fails at the next synchronisation as a device-side assert, which cannot name the
values. The reference reads them anyway and checks them there.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from torchhal.hal_core import InvalidArgumentError, KernelRegistry
from torchhal.kernels import attention as dense
from torchhal.kernels import triton_attention
from torchhal.kernels._checks import queue_device_assert, require_rank, require_same, require_tensor
from torchhal.kernels.autograd import AutogradSpec


class VarlenSignature(NamedTuple):
    dtype: torch.dtype
    head_dim: int
    v_head_dim: int
    grouped: bool
    causal: bool
    seq_bucket: int  # bit length of max(max_seqlen_q, max_seqlen_k)
    empty: bool
    group_rows_bucket: int  # as attention's, with max_seqlen_q: the split-KV kernel's query tile


def _check(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float | None,
) -> None:
    dense.check_qkv(op, q, k, v, causal, scale, rank=3)
    require_same(op, "key and value token counts", k=k.shape[0], v=v.shape[0])
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        require_tensor(op, name, cu)
        require_rank(op, name, cu, 1)
        if cu.dtype not in (torch.int32, torch.int64) or cu.shape[0] < 1:
            raise InvalidArgumentError(
                f"{op}: {name} must be a non-empty int32 or int64 tensor, "
                f"got {cu.dtype} of shape {tuple(cu.shape)}"
            )
        require_same(op, f"devices of q and {name}", q=q.device, **{name: cu.device})
    require_same(
        op, "cu_seqlens lengths", cu_seqlens_q=cu_seqlens_q.shape[0], cu_seqlens_k=cu_seqlens_k.shape[0]
    )
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        # a bool passed (True is no length: it reached the kernels as a 1-bit value, and the
        # failure demoted them for the signature of 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgumentError(f"{op}: {name} must be an int >= 0, got {value!r}")
    if cu_seqlens_q.device.type == "cpu":
        _check_offsets(op, "q", cu_seqlens_q.tolist(), q.shape[0], max_seqlen_q)
        _check_offsets(op, "k", cu_seqlens_k.tolist(), k.shape[0], max_seqlen_k)


def _check_offsets(op: str, which: str, cu: list[int], total: int, max_seqlen: int) -> None:
    """The offset rule on values read to the host."""
    lengths = [end - start for start, end in itertools.pairwise(cu)]
    if cu[0] != 0 or cu[-1] > total or any(n < 0 for n in lengths):
        raise InvalidArgumentError(
            f"{op}: cu_seqlens_{which} must rise from 0 to at most {total} tokens, got {cu}"
        )
    longest = max(lengths, default=0)
    if longest > max_seqlen:
        raise InvalidArgumentError(
            f"{op}: max_seqlen_{which} must be >= the longest sequence {longest}, got {max_seqlen}"
        )


HOST_OFFSET_CHECKS = "torchhal.kernels.varlen_host_offset_checks"  # counter of host reads off the CPU


def check_offsets(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    flag: Callable[[], torch.Tensor],
) -> None:
    """`queue_offsets_check` once per offsets: a model passes the same offset tensors to every
    layer, and the check's two launches cost about 45 µs of host time on an H100 host (measured),
    a third of a decoding-sized call. The last offsets queued on a device are remembered with their
    version counters (an in-place write, `copy_` included, bumps them) and the bounds they were
    checked against; the same tensors, unwritten, under the same bounds are not checked again,
    except while a graph is captured, so that the graph replays the check on whatever values are
    copied in later. Not seen, so those offsets must be new tensors or written by an ordinary
    in-place op: writes that bypass the version counter (a graph's replay, `.data`, DLPack or a
    custom kernel writing through a raw pointer). Checked on every call: inference tensors
    (`torch.inference_mode`: no version counter), strided offsets (copied contiguous, a new tensor
    each call) and a pair other than the last one (a model alternating self- and cross-attention
    offsets)."""
    global _last_queued
    bounds = (q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    last = _last_queued
    inference = cu_seqlens_q.is_inference() or cu_seqlens_k.is_inference()  # no version counters
    if (
        not inference
        and last is not None
        and last[0]() is cu_seqlens_q
        and last[1]() is cu_seqlens_k
        and last[2] == (cu_seqlens_q._version, cu_seqlens_k._version, *bounds)
        and not _capturing(q.device)
    ):
        return
    if (
        queue_offsets_check(op, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, flag)
        and not inference
    ):
        versions = (cu_seqlens_q._version, cu_seqlens_k._version, *bounds)
        _last_queued = (weakref.ref(cu_seqlens_q), weakref.ref(cu_seqlens_k), versions)


_last_queued: tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor], tuple[int, ...]] | None = None
"""The offsets `check_offsets` last queued a device check of, and their versions and bounds."""


def _capturing(device: torch.device) -> bool:
    """Whether `device`'s current stream is capturing a graph (a device module without the
    question captures none)."""
    capturing = getattr(torch.get_device_module(device), "is_current_stream_capturing", None)
    return bool(capturing and capturing())


def queue_offsets_check(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    flag: Callable[[], torch.Tensor],
) -> bool:
    """The offset rule where a kernel is about to trust it, without a host sync: `flag()` computes
    it on the device as a one-element tensor (nonzero: valid) and `torch._assert_async` fails on it
    at the next synchronisation (True). On the CPU, or a device type without that assert, the
    offsets are read and checked on the host instead (False)."""
    total_q, total_k = q.shape[0], k.shape[0]
    message = (  # short: queue_device_assert cuts it at ASSERT_MESSAGE_LIMIT characters, for CUDA
        f"{op}: cu_seqlens_q/_k must rise from 0 to at most {total_q}/{total_k} tokens, no sequence "
        f"longer than max_seqlen_q/_k {max_seqlen_q}/{max_seqlen_k} (a device check: read them on "
        "the host for the values)"
    )
    if queue_device_assert(q.device, flag, message, HOST_OFFSET_CHECKS):
        return True
    _check_offsets(op, "q", cu_seqlens_q.tolist(), total_q, max_seqlen_q)
    _check_offsets(op, "k", cu_seqlens_k.tolist(), total_k, max_seqlen_k)
    return False


def _summary(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool
) -> VarlenSignature:
    return VarlenSignature(
        q.dtype,
        q.shape[2],
        v.shape[2],
        q.shape[1] != k.shape[1],
        bool(causal),
        max(max_seqlen_q, max_seqlen_k).bit_length(),
        0 in q.shape or 0 in k.shape or 0 in v.shape or max_seqlen_q == 0,
        dense.group_rows_bucket(q.shape[1], k.shape[1], max_seqlen_q),
    )


def signature(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    scale: float | None = None,
) -> VarlenSignature:
    _check("attention_varlen", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)
    return _summary(q, k, v, max_seqlen_q, max_seqlen_k, causal)


def forward_signature(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    scale: float | None = None,
) -> VarlenSignature:
    _check(
        "attention_varlen_forward",
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        scale,
    )
    return _summary(q, k, v, max_seqlen_q, max_seqlen_k, causal)


def backward_signature(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    scale: float | None = None,
) -> VarlenSignature:
    op = "attention_varlen_backward"
    _check(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)
    dense.check_saved(op, q, v, grad_out, out, lse, lse_shape=(q.shape[1], q.shape[0]))
    return _summary(q, k, v, max_seqlen_q, max_seqlen_k, causal)


def _spans(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """((q0, q1), (k0, k1)) of each sequence, read to the host (the references loop over them) and
    checked there, at no extra cost: an accelerator's offsets reach them unchecked."""
    spans = []
    for which, cu, total, max_seqlen in (
        ("q", cu_seqlens_q, q.shape[0], max_seqlen_q),
        ("k", cu_seqlens_k, k.shape[0], max_seqlen_k),
    ):
        values = cu.tolist()
        _check_offsets(op, which, values, total, max_seqlen)
        spans.append(itertools.pairwise(values))
    return list(zip(*spans, strict=True))


def _dense(t: torch.Tensor) -> torch.Tensor:
    """(tokens, heads, dim) -> (1, heads, tokens, dim), a view."""
    return t.transpose(0, 1).unsqueeze(0)


def _reference_forward(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense reference on each sequence in turn."""
    spans = _spans(op, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for (q0, q1), (k0, k1) in spans:
        o, s = dense.reference_forward(_dense(q[q0:q1]), _dense(k[k0:k1]), _dense(v[k0:k1]), causal, scale)
        out[q0:q1] = o[0].transpose(0, 1)
        lse[:, q0:q1] = s[0]
    return out, lse


def reference_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _reference_forward(
        "attention_varlen_forward", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
        scale,
    )  # fmt: skip


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    out, _ = _reference_forward(
        "attention_varlen", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale
    )
    return out


def reference_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dense reference backward on each sequence in turn."""
    spans = _spans("attention_varlen_backward", q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dq, dk, dv = q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    for (q0, q1), (k0, k1) in spans:
        grads = dense.reference_backward(
            _dense(grad_out[q0:q1]), _dense(q[q0:q1]), _dense(k[k0:k1]), _dense(v[k0:k1]),
            _dense(out[q0:q1]), lse[:, q0:q1].unsqueeze(0), causal, scale,
        )  # fmt: skip
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = (g[0].transpose(0, 1) for g in grads)
    return dq, dk, dv


def _forward_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _backward_fake(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _context(inputs: Sequence[Any], results: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale = inputs
    out, lse = results
    return q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale


AUTOGRAD = AutogradSpec(
    op="attention_varlen",
    forward="attention_varlen_forward",
    backward="attention_varlen_backward",
    forward_fake=_forward_fake,
    backward_fake=_backward_fake,
    differentiable=(0, 1, 2),
    autocast=(0, 1, 2),  # autocast casts them, as it does SDPA's inputs
    aten_op="aten::scaled_dot_product_attention",
    context=_context,
    backward_reference=reference_backward,
)


def register(registry: KernelRegistry) -> None:
    registry.define_op(
        "attention_varlen",
        reference,
        signature=signature,
        doc="attention over packed variable-length sequences",
        reads_values_on=("cpu",),  # the signature checks cu_seqlens' values there
    )
    triton_attention.register(registry, "attention_varlen", triton_attention.bind_varlen)
    triton_attention.register_decode(registry, "attention_varlen", triton_attention.bind_decode_varlen)
    registry.define_op(
        "attention_varlen_forward", reference_forward, signature=forward_signature,
        doc="(out, lse) of attention_varlen", reads_values_on=("cpu",),
    )  # fmt: skip
    triton_attention.register(registry, "attention_varlen_forward", triton_attention.bind_varlen_forward)
    triton_attention.register_decode(
        registry, "attention_varlen_forward", triton_attention.bind_decode_varlen_forward
    )
    registry.define_op(
        "attention_varlen_backward", reference_backward, signature=backward_signature,
        doc="(dq, dk, dv) of attention_varlen", reads_values_on=("cpu",),
    )  # fmt: skip
    triton_attention.register(registry, "attention_varlen_backward", triton_attention.bind_varlen_backward)
