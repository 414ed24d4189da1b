"""The autograd/custom-op glue: each path dispatches the registry op it should, and torch.compile works."""

from __future__ import annotations

import pytest
import torch

import torchhal
from torchhal.hal_core import ConfigurationError, UnsupportedError
from torchhal.kernels import layer_norm, rms_norm, rope
from torchhal.kernels.autograd import AutogradSpec, DifferentiableOp


def _spy(hal, op, calls):
    """A top-priority candidate of `op` that records its call and runs the op's reference."""
    reference = hal.kernels.op(op).reference

    def spy(*args):
        calls.append(op)
        return reference(*args)

    hal.kernels.register(op, "spy", spy, provider="test", priority=100)


OPS = ("matmul", "rms_norm", "layer_norm", "swiglu", "geglu", "rope")
BACKWARD_OPS = tuple(f"{op}_backward" for op in OPS)
REGISTRY_OPS = (*OPS, "layer_norm_forward", *BACKWARD_OPS)
# what runs with gradients, and under torch.compile: each op's training forward and its backward
TRAINING_OPS = ("matmul", "rms_norm", "layer_norm_forward", "swiglu", "geglu", "rope", *BACKWARD_OPS)


@pytest.fixture
def calls(fresh_ops):
    seen: list[str] = []
    for op in REGISTRY_OPS:
        _spy(fresh_ops.hal, op, seen)
    return seen


def _rope_inputs(grad: bool):
    q = torch.randn(2, 4, 5, 8, requires_grad=grad)
    k = torch.randn(2, 2, 5, 8, requires_grad=grad)
    angles = torch.randn(2, 1, 5, 4)
    emb = torch.cat((angles, angles), -1)
    return q, k, emb.cos(), emb.sin()


def _inputs(grad: bool):
    x = torch.randn(9, 33, requires_grad=grad)
    w = (1 + 0.1 * torch.randn(33)).requires_grad_(grad)
    return x, w


def test_no_grad_call_goes_straight_to_the_op(fresh_ops, calls):
    x, w = _inputs(grad=False)
    y = fresh_ops.rms_norm(x, w, 1e-6)
    assert calls == ["rms_norm"] and y.grad_fn is None
    torch.testing.assert_close(y, rms_norm.reference(x, w, 1e-6))
    x.requires_grad_(True)
    with torch.no_grad():
        assert fresh_ops.rms_norm(x, w, 1e-6).grad_fn is None
    assert calls == ["rms_norm", "rms_norm"]


def test_autograd_dispatches_forward_and_backward_through_the_registry(fresh_ops, calls):
    x, w = _inputs(grad=True)
    dy = torch.randn(9, 33)
    y = fresh_ops.rms_norm(x, w, 1e-6)
    assert type(y.grad_fn).__name__.startswith("rms_norm_function")
    y.backward(dy)
    assert calls == ["rms_norm", "rms_norm_backward"]
    dx, dw = rms_norm.reference_backward(dy, x.detach(), w.detach(), 1e-6)
    torch.testing.assert_close(x.grad, dx)
    torch.testing.assert_close(w.grad, dw)


def test_only_the_inputs_that_need_it_get_a_gradient(fresh_ops, calls):
    x, w = _inputs(grad=False)
    x.requires_grad_(True)
    fresh_ops.rms_norm(x, w, 1e-6).sum().backward()
    assert x.grad is not None and w.grad is None


def test_an_unused_output_gets_a_zero_gradient(fresh_ops, calls):
    q, k = torch.randn(2, 3, 5, 8, requires_grad=True), torch.randn(2, 1, 5, 8, requires_grad=True)
    angles = torch.randn(1, 1, 5, 4)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    dq_out = torch.randn(2, 3, 5, 8)
    q_rot, _ = fresh_ops.rope(q, k, cos, sin)
    q_rot.backward(dq_out)
    dq, _ = rope.reference_backward(dq_out, torch.zeros(2, 1, 5, 8), cos, sin)
    torch.testing.assert_close(q.grad, dq)
    assert torch.count_nonzero(k.grad) == 0 and calls == ["rope", "rope_backward"]


def test_saved_statistics_get_no_zero_gradients():
    """The training forward returns statistics beside its outputs (for linear_cross_entropy, the
    weight-sized gradient); autograd must not fill a zero tensor for each of them on backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Made(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.zero_fills: list[tuple[int, ...]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("zeros_like", "zeros", "new_zeros") or (name == "fill_" and args[1] == 0):
                self.zero_fills.append(tuple(out.shape))
            return out

    hidden = torch.randn(6, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    loss = torchhal.ops.linear_cross_entropy(hidden, weight, torch.randint(0, 40, (6,)))
    with Made() as made:
        loss.backward()
    assert weight.grad is not None and hidden.grad is not None
    assert made.zero_fills == [], made.zero_fills


def test_a_table_that_requires_grad_is_refused(fresh_ops):
    q, k = torch.randn(1, 2, 4, 8, requires_grad=True), torch.randn(1, 2, 4, 8)
    cos, sin = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    with pytest.raises(UnsupportedError, match=r"rope: input 'cos' requires grad.*q, k"):
        fresh_ops.rope(q, k, cos, sin)


def test_a_table_that_alone_requires_grad_is_refused(fresh_ops):
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    cos, sin = torch.randn(4, 8), torch.randn(4, 8, requires_grad=True)
    with pytest.raises(UnsupportedError, match=r"rope: input 'sin' requires grad"):
        fresh_ops.rope(q, k, cos, sin)


def test_saved_inputs_are_guarded_against_inplace_changes(fresh_ops):
    x, w = _inputs(grad=True)
    base = x * 1
    y = fresh_ops.rms_norm(base, w, 1e-6)
    base.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_compile_fullgraph_uses_the_custom_ops(fresh_ops, calls):
    """Every op in one compiled block, forward and backward, with no graph break; aot_eager runs
    Dynamo, the fake implementations and AOTAutograd (the GPU tests compile with inductor)."""
    torch._dynamo.reset()

    def block(x, w, b, q, k, cos, sin):
        h = fresh_ops.layer_norm(fresh_ops.rms_norm(x * 2, w, 1e-6), w, b, 1e-5)
        h = fresh_ops.matmul(h, fresh_ops.matmul(w.unsqueeze(1), w.unsqueeze(0)))  # (9, 32) @ (32, 32)
        gate, up = h.chunk(2, dim=-1)
        q2, k2 = fresh_ops.rope(q, k, cos, sin)
        gated = fresh_ops.swiglu(gate, up) + fresh_ops.geglu(up, gate)
        return gated.tanh().sum() + (q2 * 3).sum() + k2.square().sum()

    x, w = _inputs(grad=True)
    x, w = x[:, :32].detach().requires_grad_(True), w[:32].detach().requires_grad_(True)
    b = torch.randn(32, requires_grad=True)
    inputs = (x, w, b, *_rope_inputs(grad=True))
    twins = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in inputs)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    compiled(*inputs).backward()
    assert sorted(set(calls)) == sorted(TRAINING_OPS)
    block(*twins).backward()
    for got, want in zip(inputs, twins, strict=True):
        if want.requires_grad:
            torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("op", TRAINING_OPS)  # the ops that are custom ops
def test_custom_op_registrations_pass_opcheck(plain_ops, op):
    """torch.library.opcheck: schema, fake (meta) implementation and autograd registration agree."""
    x, w = _inputs(grad=True)
    b, dy = torch.randn(33, requires_grad=True), torch.randn(9, 33)
    q, k, cos, sin = _rope_inputs(grad=True)
    args = {
        "matmul": (x, torch.randn(33, 7, requires_grad=True)),
        "matmul_backward": (torch.randn(9, 7), x.detach(), torch.randn(33, 7)),
        "rms_norm": (x, w, 1e-6),
        "rms_norm_backward": (dy, x.detach(), w.detach(), 1e-6),
        "layer_norm_forward": (x, w, b, 1e-5),
        "layer_norm_backward": (
            dy,
            x.detach(),
            w.detach(),
            *layer_norm.reference_forward(x.detach(), w, b)[1:],
        ),
        "swiglu": (x, x.detach().flip(0).requires_grad_(True)),
        "swiglu_backward": (dy, x.detach(), dy.flip(0)),
        "geglu": (x, x.detach().flip(0).requires_grad_(True)),
        "geglu_backward": (dy, x.detach(), dy.flip(0)),
        "rope": (q, k, cos, sin),
        "rope_backward": (q.detach(), k.detach(), cos, sin),
    }[op]
    torch.library.opcheck(getattr(torch.ops.torchhal_test, op).default, args)


def test_context_values_that_are_none_survive_to_the_backward(fresh_ops):
    """A non-tensor context value of None (attention's scale or window) is not a saved-tensor slot."""

    def scale(x: torch.Tensor, factor: float | None) -> torch.Tensor:
        return x * (2.0 if factor is None else factor)

    def scale_backward(dy: torch.Tensor, x: torch.Tensor, factor: float | None) -> torch.Tensor:
        return dy * (2.0 if factor is None else factor) + 0 * x

    def fake(x: torch.Tensor, factor: float | None) -> torch.Tensor:
        return x.new_empty(x.shape)

    def backward_fake(dy: torch.Tensor, x: torch.Tensor, factor: float | None) -> torch.Tensor:
        return x.new_empty(x.shape)

    fresh_ops.hal.kernels.define_op("toy_scale", scale, signature=lambda x, factor: (x.dtype, factor))
    fresh_ops.hal.kernels.define_op(
        "toy_scale_backward", scale_backward, signature=lambda dy, x, factor: (x.dtype, factor)
    )
    spec = AutogradSpec(
        op="toy_scale",
        forward="toy_scale",
        backward="toy_scale_backward",
        forward_fake=fake,
        backward_fake=backward_fake,
        differentiable=(0,),
        context=lambda inputs, results: (inputs[0], inputs[1]),  # a tensor, then None
    )
    toy = DifferentiableOp(spec, fresh_ops.dispatch, namespace="torchhal_test_toy")
    x = torch.randn(5, requires_grad=True)
    toy(x, None).backward(torch.ones(5))
    torch.testing.assert_close(x.grad, torch.full((5,), 2.0))


def _grad(*tensors):
    return tuple(t.requires_grad_() if t.is_floating_point() else t for t in tensors)


COMPILED_BAD_INPUT = {
    "swiglu": (
        lambda: _grad(torch.randn(2, 16), torch.randn(2, 8)),
        torchhal.ops.swiglu,
        "swiglu: shapes must agree",
    ),
    "layer_norm": (
        lambda: _grad(torch.randn(2, 16), torch.randn(16), torch.randn(8)),
        torchhal.ops.layer_norm,
        "layer_norm: weight and bias lengths must agree",
    ),
    "matmul": (
        lambda: _grad(torch.randn(2, 3, 4), torch.randn(3, 4, 6)),
        torchhal.ops.matmul,
        "matmul: batch dimensions must broadcast",
    ),
    "rms_norm": (lambda: _grad(torch.randn(2, 16), torch.randn(8)), torchhal.ops.rms_norm, "rms_norm: "),
    "rope": (
        lambda: (
            *_grad(torch.randn(1, 2, 5, 7), torch.randn(1, 2, 5, 7)),
            torch.randn(5, 7),
            torch.randn(5, 7),
        ),
        torchhal.ops.rope,
        "rope: head dim must be even",
    ),
    "attention": (
        lambda: _grad(torch.randn(2, 2, 5, 8), torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8)),
        torchhal.ops.attention,
        "attention: batch sizes must agree",
    ),
    "linear_cross_entropy": (
        lambda: (*_grad(torch.randn(6, 8), torch.randn(10, 8)), torch.randint(0, 10, (5,))),
        torchhal.ops.linear_cross_entropy,
        "linear_cross_entropy: target's shape must be",
    ),
}


@pytest.mark.parametrize("op", COMPILED_BAD_INPUT)
def test_bad_input_under_compile_names_the_op_and_the_constraint(op):
    """The fake implementations validate: under torch.compile with gradients, a bad shape met a
    fake that did not check it and failed later in AOTAutograd's backward trace (an invalid
    gradient shape) or in torch.broadcast_shapes, naming neither the op nor the constraint."""
    make, fn, message = COMPILED_BAD_INPUT[op]
    with pytest.raises(Exception, match=message):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(*make())


def test_an_op_of_a_name_already_defined_is_refused():
    """torch.library.custom_op replaced the op without a word, and when the replaced op's library
    was collected its registrations went too: calls through the first op's handles crashed in the
    dispatcher (segfaults under Dynamo's fake tensors, `ValueError('vector::reserve')`)."""
    spec = torchhal.ops._RMS_NORM.__self__.spec
    with pytest.raises(ConfigurationError, match=r"custom op torchhal::rms_norm is already defined"):
        DifferentiableOp(spec, lambda op, *args: None)
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(8)
    torch.testing.assert_close(torchhal.ops.rms_norm(x, w), torch.nn.functional.rms_norm(x, (8,), w))
