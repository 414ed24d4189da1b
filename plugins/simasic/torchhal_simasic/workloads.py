"""What each registry op runs on the simulated device: its array matmuls and streamed bytes.

A workload reads one op call's arguments and results (shapes, element sizes, sequence
offsets) and returns its cost from the model in `torchhal_simasic.cost` (`op_cost`: each
matmul its own roofline, streamed bytes at the memory bandwidth, one launch overhead).
s is the element size of the op's dtype; statistics (lse, mean, rstd, the row sums D) are
fp32 by the ops' contract, so 4 bytes each.

- matmul: the product, batch dimensions folded as torch.matmul folds them (`matmul_dims`).
  matmul_backward: the two gradient products; an operand broadcast over the batch also streams
  its per-batch partial gradients out and back in for the sum.
- rms_norm, layer_norm, swiglu, geglu, rope and their training ops (`_forward`,
  `_backward`): no array work; every tensor argument is read once and every result written
  once (the minimum traffic of a fused row or element-wise kernel).
- attention, per (batch, query head): S = Q·Kᵀ and O = P·V on the array; the softmax streams
  S in and P out. attention_forward also writes the lse. attention_backward recomputes S and
  runs dV = Pᵀ·dO, dP = dO·Vᵀ, dQ = dS·K and dK = dSᵀ·Q on the array; it streams P =
  exp(S − lse) (S, lse in; P out), D = rowsum(dO ∘ O) (dO, O in; D out) and dS = P ∘ (dP − D)
  (P, dP, D in; dS out). Masks skip no work; a query head reads its kv head's K and V as its
  own (GQA shares nothing), and the backward's per-query-head dK and dV are not summed apart.
- attention_varlen and its training ops: the dense ops' work for each packed sequence (one
  batch, every query head); rows outside every sequence cost nothing.
- linear_cross_entropy (and its training forward with reduction "none"): logits =
  hidden·weightᵀ on the array; the loss streams the logits, the target and the bias in and
  the loss out. The training forward with "mean" or "sum" also writes d loss / d logits and
  runs dhidden = dlogits·weight and dweight = dlogitsᵀ·hidden on the array, reading dlogits
  once more for dbias when there is a bias. The backward with "none" is that gradient work
  with grad_loss in place of the loss; with "mean" or "sum" it only streams grad_loss and the
  forward's gradients in and the scaled gradients out.

Like attention's scores, the logits are modelled as going through memory once: the array's
outputs cannot feed it directly, so a chunked kernel stores them to read them back.

`OUTPUT_BYTES` gives, for each op, the device memory its results take, from its arguments
alone (shapes and dtypes, as the ops' fake implementations give them: every result a fresh
dense tensor), so that a bound kernel charges the ledger before computing anything.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torchhal.hal_core import DType

from torchhal_simasic.cost import (
    Matmul,
    OpCost,
    element_bytes,
    elementwise_cost,
    matmul_cost,
    op_cost,
    require_sizes,
)
from torchhal_simasic.spec import SimASICSpec

STATISTIC_BYTES = 4  # fp32: lse, mean, rstd and D, as the ops return or use them
Results = tuple[torch.Tensor, ...]  # an op's results, one tensor or several
Workload = Callable[..., OpCost]  # (spec, the op's results, **its arguments by name) -> its cost


class Pass(enum.Enum):
    """Which op of an attention family; the value is the op name's suffix."""

    INFERENCE = ""  # the output only
    FORWARD = "_forward"  # the output and the lse the backward needs
    BACKWARD = "_backward"  # dq, dk, dv, recomputing the probabilities from the lse


def attention_cost(
    spec: SimASICSpec,
    *,
    batch: int,
    heads: int,
    seq_q: int,
    seq_k: int,
    head_dim: int,
    v_head_dim: int,
    dtype: DType,
    pass_: Pass = Pass.INFERENCE,
) -> OpCost:
    """Dense attention: `batch` × `heads` query heads, each seq_q queries over seq_k keys."""
    op = f"attention{pass_.value}"
    require_sizes(
        op, batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim, v_head_dim=v_head_dim
    )
    matmuls, streamed = _attention_work(pass_, seq_q, seq_k, head_dim, v_head_dim, batch * heads, dtype)
    return op_cost(spec, op, dtype, matmuls, streamed)


def attention_varlen_cost(
    spec: SimASICSpec,
    *,
    heads: int,
    lengths: Sequence[tuple[int, int]],
    head_dim: int,
    v_head_dim: int,
    dtype: DType,
    pass_: Pass = Pass.INFERENCE,
) -> OpCost:
    """Packed attention: the dense work of each sequence's (seq_q, seq_k), one launch for all."""
    op = f"attention_varlen{pass_.value}"
    require_sizes(op, heads=heads, head_dim=head_dim, v_head_dim=v_head_dim)
    matmuls: list[Matmul] = []
    streamed = 0
    for seq_q, seq_k in lengths:
        require_sizes(op, seq_q=seq_q, seq_k=seq_k)
        work, nbytes = _attention_work(pass_, seq_q, seq_k, head_dim, v_head_dim, heads, dtype)
        matmuls += work
        streamed += nbytes
    return op_cost(spec, op, dtype, matmuls, streamed)


def _attention_work(
    pass_: Pass, seq_q: int, seq_k: int, head_dim: int, v_head_dim: int, count: int, dtype: DType
) -> tuple[list[Matmul], int]:
    """The matmuls and streamed bytes of `count` query heads (see the module docstring)."""
    s = element_bytes(dtype)
    scores = Matmul(seq_q, head_dim, seq_k, count)
    matrix = seq_q * seq_k * s  # S, P, dP or dS
    stats = seq_q * STATISTIC_BYTES
    if pass_ is Pass.BACKWARD:
        matmuls = [
            scores,
            Matmul(seq_k, seq_q, v_head_dim, count),  # dV = Pᵀ·dO
            Matmul(seq_q, v_head_dim, seq_k, count),  # dP = dO·Vᵀ
            Matmul(seq_q, seq_k, head_dim, count),  # dQ = dS·K
            Matmul(seq_k, seq_q, head_dim, count),  # dK = dSᵀ·Q
        ]
        # P: S and lse in, P out (2 matrices, 1 stats); D: dO and O in, D out (1 stats);
        # dS: P, dP and D in, dS out (3 matrices, 1 stats)
        return matmuls, count * (5 * matrix + 2 * seq_q * v_head_dim * s + 3 * stats)
    softmax = 2 * matrix + (stats if pass_ is Pass.FORWARD else 0)
    return [scores, Matmul(seq_q, seq_k, v_head_dim, count)], count * softmax


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


def streamed(op: str) -> Workload:
    """An op without array work: each tensor argument read once, each result written once."""

    def work(spec: SimASICSpec, results: Results, **arguments: Any) -> OpCost:
        tensors = [a for a in arguments.values() if isinstance(a, torch.Tensor)]
        return elementwise_cost(spec, op, _dtype(tensors[0]), _bytes(*tensors, *results))

    return work


def matmul(spec: SimASICSpec, results: Results, *, a: torch.Tensor, b: torch.Tensor) -> OpCost:
    batch, m, k, n = matmul_dims(a.shape, b.shape)
    return matmul_cost(spec, m, k, n, _dtype(a), batch=batch)


def matmul_backward(
    spec: SimASICSpec, results: Results, *, grad_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> OpCost:
    """da = grad_out @ bᵀ (M×N×K) and db = aᵀ @ grad_out (K×M×N), `batch` of each; where an
    operand was broadcast over the batch, its per-batch partial gradients are written and read
    back for the sum (streamed)."""
    batch, m, k, n = matmul_dims(a.shape, b.shape)
    partials = (batch * m * k if a.numel() < batch * m * k else 0) + (
        batch * k * n if b.numel() < batch * k * n else 0
    )
    streamed_bytes = 2 * partials * a.element_size()
    return op_cost(
        spec, "matmul_backward", _dtype(a), [Matmul(m, n, k, batch), Matmul(k, m, n, batch)], streamed_bytes
    )


def dense_attention(pass_: Pass) -> Workload:
    """attention, attention_forward or attention_backward (all take q, k and v by those names)."""

    def work(
        spec: SimASICSpec, results: Results, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **_: Any
    ) -> OpCost:
        batch, heads, seq_q, head_dim = q.shape
        return attention_cost(
            spec,
            batch=batch,
            heads=heads,
            seq_q=seq_q,
            seq_k=k.shape[2],
            head_dim=head_dim,
            v_head_dim=v.shape[3],
            dtype=_dtype(q),
            pass_=pass_,
        )

    return work


def packed_attention(pass_: Pass) -> Workload:
    """attention_varlen or its training ops; the offsets are host tensors, as the device's are."""

    def work(
        spec: SimASICSpec, results: Results, *, q: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor, **_: Any,
    ) -> OpCost:  # fmt: skip
        lengths = list(zip(cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist(), strict=True))
        return attention_varlen_cost(
            spec,
            heads=q.shape[1],
            lengths=lengths,
            head_dim=q.shape[2],
            v_head_dim=v.shape[2],
            dtype=_dtype(q),
            pass_=pass_,
        )

    return work


def linear_cross_entropy(
    spec: SimASICSpec, results: Results, *, hidden: torch.Tensor, weight: torch.Tensor,
    target: torch.Tensor, bias: torch.Tensor | None, **_: Any,
) -> OpCost:  # fmt: skip
    op = "linear_cross_entropy"
    return _cross_entropy(
        spec, op, hidden, weight, bias, gradients=False, side=_bytes(target, bias, *results)
    )


def linear_cross_entropy_forward(
    spec: SimASICSpec, results: Results, *, hidden: torch.Tensor, weight: torch.Tensor,
    target: torch.Tensor, bias: torch.Tensor | None, reduction: str, **_: Any,
) -> OpCost:  # fmt: skip
    loss, grad_bias = results[0], results[3]  # dhidden and dweight come out of the matmuls
    return _cross_entropy(
        spec, "linear_cross_entropy_forward", hidden, weight, bias,
        gradients=reduction != "none", side=_bytes(target, bias, loss, grad_bias),
    )  # fmt: skip


def linear_cross_entropy_backward(
    spec: SimASICSpec, grads: Results, *, grad_loss: torch.Tensor, grad_hidden: torch.Tensor,
    grad_weight: torch.Tensor, grad_bias: torch.Tensor, hidden: torch.Tensor | None,
    weight: torch.Tensor | None, target: torch.Tensor | None, bias: torch.Tensor | None, reduction: str,
    **_: Any,
) -> OpCost:  # fmt: skip
    op = "linear_cross_entropy_backward"
    if reduction != "none":  # the forward's gradients scaled by the scalar grad_loss
        nbytes = _bytes(grad_loss, grad_hidden, grad_weight, grad_bias, *grads)
        return elementwise_cost(spec, op, _dtype(grad_hidden), nbytes)
    assert hidden is not None and weight is not None  # the op's signature requires them for "none"
    side = _bytes(grad_loss, target, bias, grads[2])
    return _cross_entropy(spec, op, hidden, weight, bias, gradients=True, side=side)


def _cross_entropy(
    spec: SimASICSpec, op: str, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    *, gradients: bool, side: int,
) -> OpCost:  # fmt: skip
    """The logits' matmul, and with `gradients` the two gradient matmuls; `side` is what the
    loss streams besides the logits (target, bias, loss or grad_loss, dbias)."""
    tokens, width, vocab = math.prod(hidden.shape[:-1]), hidden.shape[-1], weight.shape[0]
    dtype = _dtype(hidden)
    logits = tokens * vocab * element_bytes(dtype)
    matmuls = [Matmul(tokens, width, vocab)]
    nbytes = logits + side  # the loss reads the logits
    if gradients:
        matmuls += [Matmul(tokens, vocab, width), Matmul(vocab, tokens, width)]
        nbytes += logits  # d loss / d logits written
        if bias is not None and bias.numel() > 0:
            nbytes += logits  # and read again, summed over tokens into dbias
    return op_cost(spec, op, dtype, matmuls, nbytes)


STREAMED_OPS = (
    "rms_norm",
    "rms_norm_backward",
    "layer_norm",
    "layer_norm_forward",
    "layer_norm_backward",
    "swiglu",
    "swiglu_backward",
    "geglu",
    "geglu_backward",
    "rope",
    "rope_backward",
)
ARRAY_WORKLOADS: dict[str, Workload] = {  # ops with matmuls: they need the dtype's MAC rate
    "matmul": matmul,
    "matmul_backward": matmul_backward,
    **{f"attention{p.value}": dense_attention(p) for p in Pass},
    **{f"attention_varlen{p.value}": packed_attention(p) for p in Pass},
    "linear_cross_entropy": linear_cross_entropy,
    "linear_cross_entropy_forward": linear_cross_entropy_forward,
    "linear_cross_entropy_backward": linear_cross_entropy_backward,
}
WORKLOADS: dict[str, Workload] = {**{op: streamed(op) for op in STREAMED_OPS}, **ARRAY_WORKLOADS}

OutputBytes = Callable[..., int]  # (**the op's arguments by name) -> bytes of its results


def _matmul_out(*, a: torch.Tensor, b: torch.Tensor) -> int:
    batch, m, _, n = matmul_dims(a.shape, b.shape)
    return batch * m * n * a.element_size()


def _attention_out(*, q: torch.Tensor, v: torch.Tensor, **_: Any) -> int:
    """out: q's shape with v's head dim, q's dtype (dense or packed)."""
    return math.prod(q.shape[:-1]) * v.shape[-1] * q.element_size()


def _attention_forward_out(*, q: torch.Tensor, v: torch.Tensor, **_: Any) -> int:
    """out and the fp32 lse, one per query row and head."""
    return _attention_out(q=q, v=v) + math.prod(q.shape[:-1]) * STATISTIC_BYTES


def _loss_bytes(hidden: torch.Tensor, target: torch.Tensor, reduction: str) -> int:
    """The loss, in the references' compute dtype (fp32, fp64 for fp64): one per token for
    "none", else a scalar."""
    size = torch.promote_types(hidden.dtype, torch.float32).itemsize
    return (target.numel() if reduction == "none" else 1) * size


def _cross_entropy_out(*, hidden: torch.Tensor, target: torch.Tensor, reduction: str, **_: Any) -> int:
    return _loss_bytes(hidden, target, reduction)


def _cross_entropy_forward_out(
    *, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    reduction: str, **_: Any,
) -> int:  # fmt: skip
    """The loss, then dhidden, dweight and dbias like their inputs ("none": empty gradients)."""
    gradients = 0 if reduction == "none" else _bytes(hidden, weight, bias)
    return _loss_bytes(hidden, target, reduction) + gradients


def _cross_entropy_backward_out(
    *, grad_hidden: torch.Tensor, grad_weight: torch.Tensor, grad_bias: torch.Tensor,
    hidden: torch.Tensor | None, weight: torch.Tensor | None, bias: torch.Tensor | None,
    reduction: str, **_: Any,
) -> int:  # fmt: skip
    """The forward's gradients scaled ("mean", "sum"), or recomputed like hidden, weight, bias."""
    if reduction != "none":
        return _bytes(grad_hidden, grad_weight, grad_bias)
    return _bytes(hidden, weight, bias)


def _like(*names: str, twice: str | None = None) -> OutputBytes:
    """Results shaped and typed as the named arguments (`twice`: two results like that one)."""

    def out(**arguments: Any) -> int:
        return _bytes(*(arguments[name] for name in names)) + (2 * _bytes(arguments[twice]) if twice else 0)

    return out


def _layer_norm_forward_out(*, x: torch.Tensor, **_: Any) -> int:
    """y like x, then mean and rstd per row in the compute dtype."""
    rows = math.prod(x.shape[:-1])
    return _bytes(x) + 2 * rows * torch.promote_types(x.dtype, torch.float32).itemsize


OUTPUT_BYTES: dict[str, OutputBytes] = {
    "matmul": _matmul_out,
    "matmul_backward": _like("a", "b"),
    "rms_norm": _like("x"),
    "rms_norm_backward": _like("x", "weight"),
    "layer_norm": _like("x"),
    "layer_norm_forward": _layer_norm_forward_out,
    "layer_norm_backward": _like("x", twice="weight"),
    "swiglu": _like("gate"),
    "swiglu_backward": _like(twice="gate"),
    "geglu": _like("gate"),
    "geglu_backward": _like(twice="gate"),
    "rope": _like("q", "k"),
    "rope_backward": _like("dq_out", "dk_out"),
    **{f"attention{infix}": _attention_out for infix in ("", "_varlen")},
    **{f"attention{infix}_forward": _attention_forward_out for infix in ("", "_varlen")},
    **{f"attention{infix}_backward": _like("q", "k", "v") for infix in ("", "_varlen")},
    "linear_cross_entropy": _cross_entropy_out,
    "linear_cross_entropy_forward": _cross_entropy_forward_out,
    "linear_cross_entropy_backward": _cross_entropy_backward_out,
}


def _dtype(t: torch.Tensor) -> DType:
    declared = DType.from_torch(t.dtype)
    assert declared is not None, f"the predicate admitted {t.dtype}"
    return declared


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
