"""Random inputs, at a few odd shapes, for the ops DESIGN.md defines and their backward ops.

A case is drawn on the host in fp32 (integer index tensors as they must be), then cast to
the dtype under test: the rounded values are what the device and the fp64 truth both see.
A backward op's saved forward results (attention's out and its fp32 log-sum-exp, layer_norm's
mean and rstd) are then computed from the cast inputs by the forward op's reference, as autograd
would save them.
Shapes are odd on purpose (no vector-width fast path hides a remainder bug) and small (the
kit runs each candidate on every device and dtype); each op also gets the sizes fast kernels
insist on (head_dim 64 and 128, rows of 256, matmul and cross-entropy dims of 64 and more), on
short sequences and few rows, since a candidate whose predicate declines every case is never run
and reports not applicable.
An op outside this list (one a plugin defines) brings its own inputs as `define_op(...,
examples=fn)`, turned into cases by `examples`; one with neither has no inputs, and its
candidates are reported not applicable with that reason.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torchhal.testing.context import ADAPTER_ERRORS, CheckFailed, describe, where

if TYPE_CHECKING:
    import torch

    from torchhal.hal_core import Device, KernelRegistry
    from torchhal.hal_core.kernels import Examples


@dataclass(frozen=True)
class Case:
    label: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def map(self, fn: Callable[[Any], Any]) -> Case:
        """Apply `fn` to every argument (tensors and the rest alike)."""
        return Case(self.label, tuple(fn(a) for a in self.args), {k: fn(v) for k, v in self.kwargs.items()})


def _floating(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.is_floating_point()


def cast(case: Case, dtype: torch.dtype) -> Case:
    """Floating tensors rounded to `dtype`; index tensors and scalars unchanged."""
    return case.map(lambda v: v.to(dtype) if _floating(v) else v)


def on_device(case: Case, device: Device) -> Case:
    """Fresh copies: floating tensors allocated through the adapter, index tensors copied explicitly
    to its torch device (never the host's own tensors, which must stay pristine)."""
    import torch

    def move(value: Any) -> Any:
        if _floating(value):
            return device.to_device(value)
        if isinstance(value, torch.Tensor):
            return value.to(device.torch_device, copy=True)
        return value

    return case.map(move)


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    import torch

    return torch.randn(*shape, generator=g).mul_(scale)


def _matmul(g: torch.Generator) -> list[Case]:
    """Every operand layout torch.matmul takes: 2-D, a batched over a 2-D b, both batched, a batch
    broadcast, and a vector on either side (a candidate right for a 2-D b only must meet the rest)."""
    return [
        Case("7x13 @ 13x5", (_randn(g, 7, 13), _randn(g, 13, 5))),
        Case("batched 3x9x17 @ 17x6", (_randn(g, 3, 9, 17), _randn(g, 17, 6))),
        Case("batched 3x9x17 @ 3x17x6", (_randn(g, 3, 9, 17), _randn(g, 3, 17, 6))),
        Case("2x9x17 @ 1x17x6 (b's batch broadcast)", (_randn(g, 2, 9, 17), _randn(g, 1, 17, 6))),
        Case("7x13 @ 13 (vector b)", (_randn(g, 7, 13), _randn(g, 13))),
        Case("13 @ 2x13x5 (vector a)", (_randn(g, 13), _randn(g, 2, 13, 5))),
        Case("aligned 64x128 @ 128x64", (_randn(g, 64, 128), _randn(g, 128, 64, scale=128**-0.5))),
    ]


def _matmul_backward(g: torch.Generator) -> list[Case]:
    """grad_out of the product's shape, then a and b: 2-D, batched over a 2-D b, b broadcast over
    a's batch and a over b's, and a vector on either side."""
    return [
        Case("grad 7x5, 7x13 @ 13x5", (_randn(g, 7, 5), _randn(g, 7, 13), _randn(g, 13, 5))),
        Case("grad 3x9x6, 3x9x17 @ 17x6", (_randn(g, 3, 9, 6), _randn(g, 3, 9, 17), _randn(g, 17, 6))),
        Case(
            "grad 2x3x4x5, 2x3x4x7 @ 1x3x7x5 (b broadcast)",
            (_randn(g, 2, 3, 4, 5), _randn(g, 2, 3, 4, 7), _randn(g, 1, 3, 7, 5)),
        ),
        Case(
            "grad 2x9x6, 1x9x17 @ 2x17x6 (a broadcast)",
            (_randn(g, 2, 9, 6), _randn(g, 1, 9, 17), _randn(g, 2, 17, 6)),
        ),
        Case("grad 3x7, 3x7x13 @ 13 (vector b)", (_randn(g, 3, 7), _randn(g, 3, 7, 13), _randn(g, 13))),
        Case("grad 2x5, 13 @ 2x13x5 (vector a)", (_randn(g, 2, 5), _randn(g, 13), _randn(g, 2, 13, 5))),
        Case(
            "grad 64x64, aligned 64x128 @ 128x64", (_randn(g, 64, 64), _randn(g, 64, 128), _randn(g, 128, 64))
        ),
    ]


def _rms_norm(g: torch.Generator) -> list[Case]:
    return [
        Case("5x123", (_randn(g, 5, 123), 1 + _randn(g, 123, scale=0.1))),
        Case("2x3x64, eps 1e-5", (_randn(g, 2, 3, 64), 1 + _randn(g, 64, scale=0.1), 1e-5)),
        Case("3x256", (_randn(g, 3, 256), 1 + _randn(g, 256, scale=0.1))),
    ]


def _attention_backward(g: torch.Generator) -> list[Case]:
    """Attention's cases with a random output gradient in front (forward results added by `_saved`)."""
    return [Case(c.label, (_randn(g, *c.args[0].shape), *c.args), c.kwargs) for c in _attention(g)]


def _saved_attention_forward(case: Case, dtype: torch.dtype, registry: KernelRegistry) -> Case:
    """(grad_out, q, k, v) cast, then out and lse from attention_forward's reference on them."""
    grad_out, q, k, v = cast(case, dtype).args
    out, lse = registry.op("attention_forward").reference(q, k, v, **case.kwargs)
    return Case(case.label, (grad_out, q, k, v, out, lse), case.kwargs)


def _rms_norm_backward(g: torch.Generator) -> list[Case]:
    return [
        Case("dy, x 5x123", (_randn(g, 5, 123), _randn(g, 5, 123), 1 + _randn(g, 123, scale=0.1))),
        Case(
            "dy, x 2x3x64, eps 1e-5",
            (_randn(g, 2, 3, 64), _randn(g, 2, 3, 64), 1 + _randn(g, 64, scale=0.1), 1e-5),
        ),
        Case("dy, x 3x256", (_randn(g, 3, 256), _randn(g, 3, 256), 1 + _randn(g, 256, scale=0.1))),
    ]


def _layer_norm(g: torch.Generator) -> list[Case]:
    return [
        Case(
            "5x97", (_randn(g, 5, 97, scale=2) + 0.5, 1 + _randn(g, 97, scale=0.1), _randn(g, 97, scale=0.1))
        ),
        Case("2x3x33", (_randn(g, 2, 3, 33), 1 + _randn(g, 33, scale=0.1), _randn(g, 33, scale=0.1))),
        Case("3x256", (_randn(g, 3, 256), 1 + _randn(g, 256, scale=0.1), _randn(g, 256, scale=0.1))),
    ]


def _layer_norm_backward(g: torch.Generator) -> list[Case]:
    return [
        Case("dy, x 5x97", (_randn(g, 5, 97), _randn(g, 5, 97, scale=2) + 0.5, 1 + _randn(g, 97, scale=0.1))),
        Case(
            "dy, x 2x3x33, eps 1e-6",
            (_randn(g, 2, 3, 33), _randn(g, 2, 3, 33), 1 + _randn(g, 33, scale=0.1), 1e-6),
        ),
        Case("dy, x 3x256", (_randn(g, 3, 256), _randn(g, 3, 256), 1 + _randn(g, 256, scale=0.1))),
    ]


def _saved_layer_norm_forward(case: Case, dtype: torch.dtype, registry: KernelRegistry) -> Case:
    """(dy, x, weight[, eps]) cast, then (dy, x, weight, mean, rstd) with the statistics from
    layer_norm_forward's reference (the bias does not change them)."""
    import torch

    dy, x, weight, *eps = cast(case, dtype).args
    _, mean, rstd = registry.op("layer_norm_forward").reference(x, weight, torch.zeros_like(weight), *eps)
    return Case(case.label, (dy, x, weight, mean, rstd))


def _gated_backward(g: torch.Generator) -> list[Case]:
    return [
        Case("dy, gate, up 6x45", (_randn(g, 6, 45), _randn(g, 6, 45, scale=2), _randn(g, 6, 45))),
        Case("dy, gate, up 2x3x33", (_randn(g, 2, 3, 33), _randn(g, 2, 3, 33, scale=2), _randn(g, 2, 3, 33))),
        Case("dy, gate, up 3x256", (_randn(g, 3, 256), _randn(g, 3, 256, scale=2), _randn(g, 3, 256))),
    ]


def _gated(g: torch.Generator) -> list[Case]:
    return [
        Case("6x45", (_randn(g, 6, 45, scale=2), _randn(g, 6, 45))),
        Case("2x3x33", (_randn(g, 2, 3, 33, scale=2), _randn(g, 2, 3, 33))),
        Case("3x256", (_randn(g, 3, 256, scale=2), _randn(g, 3, 256))),
    ]


def _rope(g: torch.Generator) -> list[Case]:
    import torch

    def case(batch: int, heads_q: int, heads_k: int, seq: int, dim: int) -> Case:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        positions = torch.arange(seq, dtype=torch.float32) + torch.randint(0, 100, (batch, 1), generator=g)
        angles = positions.unsqueeze(-1) * inv_freq  # (batch, seq, dim / 2)
        emb = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # (batch, 1, seq, dim), rotate-half layout
        q, k = _randn(g, batch, heads_q, seq, dim), _randn(g, batch, heads_k, seq, dim)
        label = f"q {'x'.join(map(str, q.shape))}, k {'x'.join(map(str, k.shape))}"
        return Case(label, (q, k, emb.cos(), emb.sin()))

    return [case(2, 4, 2, 11, 16), case(1, 2, 1, 5, 64), case(1, 2, 2, 3, 128)]


def _rope_backward(g: torch.Generator) -> list[Case]:
    """The gradients flowing into q' and k' have q's and k's shapes; cos and sin as forward."""
    return [
        Case(
            f"dq', dk' of {case.label}",
            (_randn(g, *case.args[0].shape), _randn(g, *case.args[1].shape), *case.args[2:]),
        )
        for case in _rope(g)
    ]


def _attention(g: torch.Generator) -> list[Case]:
    def qkv(b: int, hq: int, hkv: int, sq: int, sk: int, d: int) -> tuple[Any, ...]:
        return (_randn(g, b, hq, sq, d), _randn(g, b, hkv, sk, d), _randn(g, b, hkv, sk, d))

    return [
        Case("full 2x4x13x16", qkv(2, 4, 4, 13, 13, 16)),
        Case("causal GQA 1x4/2x17x32", qkv(1, 4, 2, 17, 17, 32), {"causal": True}),
        Case("causal seq_q 7 < seq_k 19", qkv(1, 2, 2, 7, 19, 16), {"causal": True}),
        Case("window (5, 3), scale 0.3", qkv(1, 2, 1, 23, 23, 16), {"window": (5, 3), "scale": 0.3}),
        Case("causal GQA 1x2/1x9x64", qkv(1, 2, 1, 9, 9, 64), {"causal": True}),
        Case("full 1x2x5x128, seq_k 7", qkv(1, 2, 2, 5, 7, 128)),
    ]


def _attention_varlen(g: torch.Generator) -> list[Case]:
    import torch

    lengths_q, lengths_k = (5, 7, 9), (7, 5, 13)
    cu_q = torch.tensor((0, *itertools.accumulate(lengths_q)), dtype=torch.int32)
    cu_k = torch.tensor((0, *itertools.accumulate(lengths_k)), dtype=torch.int32)

    def packed(dim: int = 16) -> tuple[Any, ...]:
        q = _randn(g, sum(lengths_q), 4, dim)
        k, v = _randn(g, sum(lengths_k), 2, dim), _randn(g, sum(lengths_k), 2, dim)
        return (q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k))

    return [
        Case("3 sequences, GQA 4/2", packed()),
        Case("3 sequences, causal", packed(), {"causal": True}),
        Case("3 sequences, head_dim 64", packed(64)),
        Case("3 sequences, head_dim 128, causal", packed(128), {"causal": True}),
    ]


def _attention_varlen_backward(g: torch.Generator) -> list[Case]:
    """Varlen cases with a random output gradient in front (forward results added by `_saved`)."""
    return [Case(c.label, (_randn(g, *c.args[0].shape), *c.args), c.kwargs) for c in _attention_varlen(g)]


def _saved_attention_varlen_forward(case: Case, dtype: torch.dtype, registry: KernelRegistry) -> Case:
    """(grad_out, q, k, v, offsets...) cast, then out and lse from the forward's reference, in the
    backward's order: grad_out, q, k, v, out, lse, offsets and lengths."""
    grad_out, q, k, v, *rest = cast(case, dtype).args
    out, lse = registry.op("attention_varlen_forward").reference(q, k, v, *rest, **case.kwargs)
    return Case(case.label, (grad_out, q, k, v, out, lse, *rest), case.kwargs)


def _linear_cross_entropy(g: torch.Generator) -> list[Case]:
    import torch

    tokens, hidden, vocab = 9, 24, 37
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[3] = -100  # one ignored position
    scale = 1 / math.sqrt(hidden)
    aligned_target = torch.randint(0, 256, (64,), generator=g)
    return [
        Case(
            "9 tokens, vocab 37, bias",
            (_randn(g, tokens, hidden), _randn(g, vocab, hidden, scale=scale), target, _randn(g, vocab)),
        ),
        Case(
            "label smoothing 0.1, sum",
            (_randn(g, tokens, hidden), _randn(g, vocab, hidden, scale=scale), target),
            {"label_smoothing": 0.1, "reduction": "sum"},
        ),
        Case(
            "aligned 64 tokens, hidden 64, vocab 256",
            (_randn(g, 64, 64), _randn(g, 256, 64, scale=1 / 8), aligned_target),
        ),
    ]


def _linear_cross_entropy_backward(g: torch.Generator) -> list[Case]:
    """A random grad_loss in front of the forward's inputs (the forward's results added by `_saved`):
    a scalar for "mean" and "sum", one per token for "none" (whose backward recomputes)."""
    import torch

    made = [
        Case(c.label, (torch.randn((), generator=g), *c.args), c.kwargs) for c in _linear_cross_entropy(g)
    ]
    tokens, hidden, vocab = 7, 24, 37
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[2] = -100
    inputs = (_randn(g, tokens, hidden), _randn(g, vocab, hidden, scale=1 / math.sqrt(hidden)), target)
    made.append(
        Case(
            "7 tokens, vocab 37, bias, reduction none, smoothing 0.05",
            (_randn(g, tokens), *inputs, _randn(g, vocab)),
            {"reduction": "none", "label_smoothing": 0.05},
        )
    )
    return made


def _saved_linear_cross_entropy_forward(case: Case, dtype: torch.dtype, registry: KernelRegistry) -> Case:
    """(grad_loss, hidden, weight, target[, bias]) cast, then the backward's arguments as autograd
    passes them: grad_loss in the loss's dtype, the forward reference's gradients, and the inputs
    only for "none" (else None)."""
    grad_loss, hidden, weight, target, *rest = cast(case, dtype).args
    bias = rest[0] if rest else None
    kwargs = dict(case.kwargs)
    forward = registry.op("linear_cross_entropy_forward").reference
    loss, *grads = forward(hidden, weight, target, bias, **kwargs)
    saved = (hidden, weight, target, bias) if kwargs.get("reduction") == "none" else (None,) * 4
    # in the loss's dtype (fp32 for half inputs), as autograd passes it
    return Case(case.label, (grad_loss.to(loss.dtype), *grads, *saved), kwargs)


CASES: dict[str, Callable[[torch.Generator], list[Case]]] = {  # fp32 host cases per op
    "matmul": _matmul,
    "matmul_backward": _matmul_backward,
    "rms_norm": _rms_norm,
    "rms_norm_backward": _rms_norm_backward,
    "layer_norm": _layer_norm,
    "layer_norm_forward": _layer_norm,
    "layer_norm_backward": _layer_norm_backward,
    "swiglu": _gated,
    "swiglu_backward": _gated_backward,
    "geglu": _gated,
    "geglu_backward": _gated_backward,
    "rope": _rope,
    "rope_backward": _rope_backward,
    "attention": _attention,
    "attention_forward": _attention,
    "attention_backward": _attention_backward,
    "attention_varlen": _attention_varlen,
    "attention_varlen_forward": _attention_varlen,
    "attention_varlen_backward": _attention_varlen_backward,
    "linear_cross_entropy": _linear_cross_entropy,
    "linear_cross_entropy_forward": _linear_cross_entropy,
    "linear_cross_entropy_backward": _linear_cross_entropy_backward,
}


FINISH: dict[str, Callable[[Case, torch.dtype, KernelRegistry], Case]] = {  # default: cast
    "layer_norm_backward": _saved_layer_norm_forward,
    "attention_backward": _saved_attention_forward,
    "attention_varlen_backward": _saved_attention_varlen_forward,
    "linear_cross_entropy_backward": _saved_linear_cross_entropy_forward,
}


def cases(op: str, g: torch.Generator, dtype: torch.dtype, registry: KernelRegistry) -> list[Case] | None:
    """Host cases for `op` in `dtype`, or None when the kit has no inputs for it."""
    make = CASES.get(op)
    if make is None:
        return None
    finish = FINISH.get(op)
    return [cast(c, dtype) if finish is None else finish(c, dtype, registry) for c in make(g)]


def examples(op: str, make: Examples, device: Device, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """Host cases from `op`'s own `make(device, dtype, generator)`, its `examples` (see
    `KernelRegistry.define_op`), each tensor copied to the host (the pristine inputs the kit
    keeps); an empty list where the op takes no inputs in `dtype`. One that raises or returns
    anything but a list of argument tuples, or inputs not in `dtype`, is the op's defect:
    CheckFailed naming the op and what was wrong."""
    import torch

    called = f"op {op!r}: examples({device.torch_device}, {dtype}, generator)"
    try:
        made = make(device.torch_device, dtype, g)
    except ADAPTER_ERRORS as exc:
        raise CheckFailed(f"{called} raised {describe(exc)} ({where(exc)})") from exc
    if not isinstance(made, list):
        raise CheckFailed(f"{called} must return a list of argument tuples, got {type(made).__name__}")
    cases = []  # an empty list: the op takes no inputs in this dtype
    for i, args in enumerate(made):
        if not isinstance(args, tuple):
            raise CheckFailed(
                f"{called}: item {i} must be a tuple of the op's arguments, got {type(args).__name__}"
            )
        host = tuple(a.detach().cpu() if isinstance(a, torch.Tensor) else a for a in args)
        floating = [a.dtype for a in host if isinstance(a, torch.Tensor) and a.is_floating_point()]
        # fp32 side tensors (tables, scales) may stay beside one in the dtype asked, or beside the
        # dtype itself as an argument (a dequantize's output dtype)
        if floating and dtype not in floating and dtype not in host:
            seen = ", ".join(sorted({str(d) for d in floating}))
            raise CheckFailed(
                f"{called}: item {i} has no floating tensor in {dtype} (its floating tensors are "
                f"{seen}), nor {dtype} as an argument: its candidates would be certified in {dtype} "
                "on inputs of another dtype (return [] for a dtype the op does not take)"
            )
        cases.append(Case(f"example {i} ({_summary(host, dtype)})", host))
    return cases


def _summary(args: tuple[Any, ...], dtype: torch.dtype) -> str:
    """Arguments as a case label shows them: a tensor by its shape (and its dtype where it is not
    the case's), anything else by its repr."""
    import torch

    def tensor(t: torch.Tensor) -> str:
        shape = "x".join(map(str, t.shape)) or "scalar tensor"
        return shape if t.dtype == dtype else f"{shape} {str(t.dtype).removeprefix('torch.')}"

    return ", ".join(tensor(a) if isinstance(a, torch.Tensor) else repr(a) for a in args)
