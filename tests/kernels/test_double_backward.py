"""A backward that autograd records (create_graph=True: a gradient penalty, double backward) gives
the second-order gradients that autograd computes through the op's reference forward, with the
Triton kernels selected (interpreter, fp32). Before, the Triton backward's gradients had no
grad_fn: a penalty alone raised "does not require grad", and a penalty added to a loss lost its
second-order term without a word. The fused cross-entropy, which keeps no inputs, refuses."""

from __future__ import annotations

import pytest
import torch

import torchhal
from torchhal.hal_core import UnsupportedError, telemetry
from torchhal.kernels import (
    attention,
    attention_varlen,
    layer_norm,
    linear_cross_entropy,
    matmul,
    rms_norm,
    rope,
    swiglu,
)

FORWARD = {  # op -> the registry op its training forward runs
    spec.op: spec.forward
    for spec in (
        attention.AUTOGRAD, attention_varlen.AUTOGRAD, layer_norm.AUTOGRAD, linear_cross_entropy.AUTOGRAD,
        matmul.AUTOGRAD, rms_norm.AUTOGRAD, rope.AUTOGRAD, swiglu.SWIGLU_AUTOGRAD, swiglu.GEGLU_AUTOGRAD,
    )
}  # fmt: skip

R = 2  # second-order terms in fp32 through the kernels' first-order outputs: a few roundings


def _grad(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def _tables(seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(1, 1, seq, dim // 2) * 6
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


OFFSETS = torch.tensor([0, 4, 11], dtype=torch.int32)

# op -> (fresh inputs, the op through torchhal.ops, the registry op's name and positional arguments)
CASES = {
    "rms_norm": (lambda: (_grad(5, 24), _grad(24)), lambda x, w: torchhal.ops.rms_norm(x, w), ("rms_norm",)),
    "layer_norm": (
        lambda: (_grad(5, 24), _grad(24), _grad(24)),
        lambda x, w, b: torchhal.ops.layer_norm(x, w, b),
        ("layer_norm",),
    ),
    "swiglu": (lambda: (_grad(5, 24), _grad(5, 24)), lambda g, u: torchhal.ops.swiglu(g, u), ("swiglu",)),
    "geglu": (lambda: (_grad(5, 24), _grad(5, 24)), lambda g, u: torchhal.ops.geglu(g, u), ("geglu",)),
    "rope": (
        lambda: (_grad(1, 2, 5, 8), _grad(1, 1, 5, 8), *_tables(5, 8)),
        lambda q, k, cos, sin: torchhal.ops.rope(q, k, cos, sin),
        ("rope",),
    ),
    "attention": (
        lambda: (_grad(1, 2, 7, 16), _grad(1, 1, 7, 16), _grad(1, 1, 7, 16)),
        lambda q, k, v: torchhal.ops.attention(q, k, v, causal=True),
        ("attention", True, None, None),
    ),
    "attention_varlen": (
        lambda: (_grad(11, 2, 16), _grad(11, 1, 16), _grad(11, 1, 16), OFFSETS),
        lambda q, k, v, cu: torchhal.ops.attention_varlen(q, k, v, cu, cu, 7, 7, causal=True),
        ("attention_varlen", OFFSETS, OFFSETS, 7, 7, True, None),
    ),
    "matmul": (lambda: (_grad(5, 6), _grad(6, 7)), lambda a, b: torchhal.ops.matmul(a, b), ("matmul",)),
}


def _penalty_gradients(run, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Gradients of (a loss + the squared norm of its input gradients) with respect to the inputs.
    The loss is not linear in the outputs, so the output gradients depend on the inputs too (rope,
    linear in q and k, then has second-order terms)."""
    wrt = [t for t in inputs if t.requires_grad]
    outputs = run(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    torch.manual_seed(7)
    loss = sum((o.sin() * torch.randn_like(o)).sum() for o in outputs)
    first = torch.autograd.grad(loss, wrt, create_graph=True)
    penalty = sum(g.square().sum() for g in first)
    return torch.autograd.grad(loss + penalty, wrt)


@pytest.mark.parametrize("op", list(CASES))
def test_a_gradient_penalty_through_the_triton_kernels_has_its_second_order_terms(triton_hal, op):
    make, call, (name, *options) = CASES[op]
    inputs = make()
    reference = triton_hal.kernels.op(name).reference
    triton_hal.kernels.clear_cache()  # the selections below are this test's own
    count = telemetry.counts().get(f"torchhal.kernels.recorded_backward_references,op={op}", 0)
    with triton_hal.use("cpu"):
        got = _penalty_gradients(call, inputs)
    truth = _penalty_gradients(
        lambda *a: reference(*a[: len(a) - (op == "attention_varlen")], *options), inputs
    )
    for g, t in zip(got, truth, strict=True):
        torch.testing.assert_close(g, t, rtol=R * 1e-4, atol=R * 1e-5)
    assert telemetry.counts().get(f"torchhal.kernels.recorded_backward_references,op={op}", 0) == count + 1
    if any(c.qualified_name == "torchhal/triton" for c in triton_hal.kernels.candidates(FORWARD[op])):
        selected = {s.candidate.qualified_name for s in triton_hal.kernels._cache[FORWARD[op]].values()}
        # a Triton forward (FlashAttention's or, for few query rows, the split-KV one), whose backward
        # is not differentiable
        assert selected and selected <= {"torchhal/triton", "torchhal/triton_decode"}, selected


def test_a_gradient_penalty_through_the_fused_cross_entropy_is_refused(triton_hal):
    """Its forward computes the gradients and keeps no inputs: nothing to differentiate again.
    Before, the penalty's second-order term was dropped without a word."""
    hidden, weight = _grad(6, 16), _grad(40, 16)
    with triton_hal.use("cpu"):
        loss = torchhal.ops.linear_cross_entropy(hidden, weight, torch.tensor([3, 0, -100, 39, 7, 7]))
        with pytest.raises(
            UnsupportedError, match=r"linear_cross_entropy: a backward with create_graph=True"
        ):
            torch.autograd.grad(loss, (hidden, weight), create_graph=True, retain_graph=True)
        grads = torch.autograd.grad(loss, (hidden, weight))  # first order as before
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
