"""Autocast: one answer for one call, whatever the path (eager with or without gradients,
compiled) and whichever candidate runs.

The ops whose torch counterparts autocast runs in lower precision (attention as SDPA, matmul,
linear_cross_entropy's logits as lm_head's linear) get their floating inputs cast to the autocast
dtype, as autocast casts them; then every candidate computes in the dtypes it was given. Before,
the reference and SDPA candidates met autocast inside, where their own matmuls cast fp32 back
down: the eager result was bf16 without gradients and fp32-but-computed-in-bf16 with them, while
the compiled path and the Triton kernels ignored autocast altogether.
"""

from __future__ import annotations

import pytest
import torch

import torchhal

AUTOCAST = torch.bfloat16


def _attention(q, k, v):
    return torchhal.ops.attention(q, k, v, causal=True)


def _matmul(a, b):
    return torchhal.ops.matmul(a, b)


def _linear_cross_entropy(hidden, weight, bias, target):
    return torchhal.ops.linear_cross_entropy(hidden, weight, target, bias)


def _inputs(name):
    """Fresh fp32 inputs, and the positions autocast casts."""
    if name == "attention":
        return [torch.randn(2, 4, 19, 16) for _ in range(3)], (0, 1, 2)
    if name == "matmul":
        return [torch.randn(3, 13, 24), torch.randn(24, 11)], (0, 1)
    hidden, weight, bias = torch.randn(21, 32), torch.randn(50, 32) / 4, torch.randn(50)
    return [hidden, weight, bias, torch.randint(0, 50, (21,))], (0, 1, 2)


FUNCTIONS = {"attention": _attention, "matmul": _matmul, "linear_cross_entropy": _linear_cross_entropy}


def _expected(fn, inputs, cast, grad):
    """The call outside autocast, on the inputs autocast would have cast, cast by hand."""
    leaves = [x.detach().clone().requires_grad_(grad and i in cast) for i, x in enumerate(inputs)]
    out = fn(*(x.to(AUTOCAST) if i in cast else x for i, x in enumerate(leaves)))
    if grad:
        out.float().sum().backward()
    return out, [x.grad for x in leaves if x.requires_grad]


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("path", ["eager", "eager_with_gradients", "compiled"])
def test_autocast_casts_as_torch_and_every_path_agrees(name, path):
    fn = FUNCTIONS[name]
    inputs, cast = _inputs(name)
    grad = path != "eager"
    expected, expected_grads = _expected(fn, inputs, cast, grad)
    leaves = [x.detach().clone().requires_grad_(grad and i in cast) for i, x in enumerate(inputs)]
    run = torch.compile(fn, backend="aot_eager", fullgraph=True) if path == "compiled" else fn
    with torch.autocast("cpu", dtype=AUTOCAST):
        out = run(*leaves)
    assert out.dtype == expected.dtype == (torch.float32 if name == "linear_cross_entropy" else AUTOCAST)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    if grad:
        out.float().sum().backward()
        for leaf, want in zip([x for x in leaves if x.requires_grad], expected_grads, strict=True):
            assert leaf.grad.dtype == torch.float32  # the leaves' own dtype, through the cast
            torch.testing.assert_close(leaf.grad, want, rtol=0, atol=0)


def test_a_backward_run_inside_autocast_computes_in_the_saved_dtypes():
    """The backward ops run with autocast off too: matmul's backward (two matmuls) run inside an
    autocast block used to come out of bf16 products."""
    a, b = torch.randn(17, 40, requires_grad=True), torch.randn(40, 9, requires_grad=True)
    torchhal.ops.matmul(a, b).sum().backward()
    want = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    out = torchhal.ops.matmul(a, b)
    with torch.autocast("cpu", dtype=AUTOCAST):
        out.sum().backward()
    torch.testing.assert_close((a.grad, b.grad), want, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm"])
def test_ops_without_an_autocast_policy_compute_in_their_inputs_dtypes(name):
    """CPU autocast leaves the norms alone, as it leaves torch's: under it they return what they
    return outside it (CUDA and XPU autocast run them in fp32: test_autocast_fp32.py)."""
    x, weight, bias = torch.randn(7, 48), torch.randn(48), torch.randn(48)
    args = (x, weight) if name == "rms_norm" else (x, weight, bias)
    fn = getattr(torchhal.ops, name)
    with torch.autocast("cpu", dtype=AUTOCAST):
        out = fn(*args)
    torch.testing.assert_close(out, fn(*args), rtol=0, atol=0)


def test_on_the_triton_kernels_too(on_triton):
    """rms_norm on the Triton kernel through the interpreter (fp32), attention cast to bf16 (which
    the interpreter does not run, so its reference does): the same answers as outside autocast."""
    x, weight = torch.randn(9, 64), torch.randn(64)
    q, k, v = (torch.randn(1, 2, 11, 16) for _ in range(3))
    with torch.autocast("cpu", dtype=AUTOCAST):
        normed = torchhal.ops.rms_norm(x, weight)
        attended = _attention(q, k, v)
    assert ("rms_norm", "triton") in on_triton
    torch.testing.assert_close(normed, torchhal.ops.rms_norm(x, weight), rtol=0, atol=0)
    torch.testing.assert_close(attended, _attention(q.bfloat16(), k.bfloat16(), v.bfloat16()), rtol=0, atol=0)


def test_the_cast_is_the_one_torch_makes_of_the_counterparts():
    """Under autocast each op returns what its torch counterpart returns: the dtype exactly, the
    values within bf16 rounding (the casts are the same; the arithmetic after them may differ)."""
    (q, k, v), _ = _inputs("attention")
    (a, b), _ = _inputs("matmul")
    (hidden, weight, bias, target), _ = _inputs("linear_cross_entropy")
    with torch.autocast("cpu", dtype=AUTOCAST):
        pairs = [
            (_attention(q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)),
            (_matmul(a, b), torch.matmul(a, b)),
            (
                _linear_cross_entropy(hidden, weight, bias, target),
                torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight, bias), target),
            ),
        ]
    for ours, theirs in pairs:
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)
