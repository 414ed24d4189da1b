"""Autocast's lower-precision rule asks torch, as the fp32 rule does: torchhal casts attention's,
matmul's and linear_cross_entropy's inputs to the autocast dtype only on the device types where
torch's autocast has a kernel for the aten counterpart (SDPA, matmul, linear). Before, it cast on
every device type with autocast on, where a backend whose autocast has no such kernel (a
PrivateUse1 backend's casts only what it registers) leaves torch's own call alone.

A CPU-only machine's CPU autocast casts all three, so `cpu_autocast_without_lower_precision`
takes that policy away: fallthrough kernels on AutocastCPU for the counterparts and the ops they
decompose into (matmul into mm and bmm, linear into addmm), so torch's own calls then compute in
fp32 under CPU autocast, and torchhal's must agree.
"""

from __future__ import annotations

import json
import random
import warnings

import pytest
import torch
from torch import nn

import torchhal
from torchhal.hal_core import telemetry
from torchhal.kernels import autograd

AUTOCAST = torch.bfloat16
OPS = {
    "attention": torchhal.ops._ATTENTION.__self__,
    "attention_varlen": torchhal.ops._ATTENTION_VARLEN.__self__,
    "matmul": torchhal.ops._MATMUL.__self__,
    "linear_cross_entropy": torchhal.ops._LINEAR_CROSS_ENTROPY.__self__,
}


@pytest.fixture
def cpu_autocast_without_lower_precision(monkeypatch):
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": meant
            warnings.simplefilter("ignore")
            for op in ("scaled_dot_product_attention", "matmul", "mm", "bmm", "linear", "addmm"):
                lib.impl(op, torch.library.fallthrough_kernel, "AutocastCPU")
        for op in OPS.values():
            assert not autograd.torch_autocasts(op.spec.aten_op, "cpu")
            # no answer kept for the CPU from earlier tests: the rule is asked at the next
            # autocast call, as for a backend whose autocast kernels came after torchhal's import
            monkeypatch.setattr(op, "_autocast_rules", {})
        yield
    finally:
        lib._destroy()  # torch's CPU autocast as it ships, for the other tests


def _inputs(name):
    """Fresh fp32 inputs at random sizes, and torch's own counterpart of the op."""
    if name in ("attention", "attention_varlen"):
        seq, dim = random.randint(3, 20), random.choice([8, 16])
        q, k, v = (torch.randn(1, 2, seq, dim) for _ in range(3))
        if name == "attention":
            return [q, k, v], lambda q, k, v: nn.functional.scaled_dot_product_attention(q, k, v)
        packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]  # (seq, heads, dim)
        cu = torch.tensor([0, seq], dtype=torch.int32)

        def sdpa_packed(q, k, v, cu_q, cu_k, max_q, max_k):
            one = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
            return nn.functional.scaled_dot_product_attention(*one)[0].transpose(0, 1)

        return [*packed, cu, cu, seq, seq], sdpa_packed
    if name == "matmul":
        m, k, n = (random.randint(5, 40) for _ in range(3))
        return [torch.randn(3, m, k), torch.randn(k, n)], torch.matmul
    rows, hidden, vocab = random.randint(5, 30), random.randint(8, 40), random.randint(10, 60)
    inputs = [torch.randn(rows, hidden), torch.randn(vocab, hidden) / 4, torch.randint(0, vocab, (rows,))]
    return [*inputs, torch.randn(vocab)], lambda h, w, t, b: nn.functional.cross_entropy(
        nn.functional.linear(h, w, b), t
    )


def _ours(name, *args):
    return getattr(torchhal.ops, name)(*args)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("grad", [False, True], ids=["eager", "eager_with_gradients"])
def test_where_torchs_autocast_has_no_kernel_the_inputs_are_left_alone(
    cpu_autocast_without_lower_precision, name, grad
):
    inputs, theirs_fn = _inputs(name)
    floats = [x for x in inputs if isinstance(x, torch.Tensor) and x.is_floating_point()]
    for x in floats:
        x.requires_grad_(grad)
    with torch.autocast("cpu", dtype=AUTOCAST):
        out = _ours(name, *inputs)
        theirs = theirs_fn(*inputs)
    outside = _ours(name, *inputs)
    assert out.dtype == theirs.dtype == torch.float32  # bf16 before, for all but the loss
    torch.testing.assert_close(out, outside, rtol=0, atol=0)  # computed in fp32: the same answer
    torch.testing.assert_close(out, theirs)  # fp32 tolerances: a bf16 computation is far outside
    if grad:
        dy = torch.randn_like(out)
        got = torch.autograd.grad(out, floats, dy)
        want = torch.autograd.grad(outside, floats, dy)
        for g, w, t in zip(got, want, torch.autograd.grad(theirs, floats, dy), strict=True):
            assert g.dtype == torch.float32
            torch.testing.assert_close(g, w, rtol=0, atol=0)
            torch.testing.assert_close(g, t)


def test_compiled_too(cpu_autocast_without_lower_precision):
    a, b = torch.randn(3, 17, 24), torch.randn(24, 11)
    torch._dynamo.reset()
    fn = torch.compile(torchhal.ops.matmul, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=AUTOCAST):
        out, theirs = fn(a, b), torch.matmul(a, b)
    assert out.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(out, torchhal.ops.matmul(a, b), rtol=0, atol=0)


def test_without_the_dispatcher_query_every_autocast_device_type_casts(monkeypatch, capsys):
    """As before the asking, logged: a torch without the private calls cannot say where."""
    telemetry.configure(log_format="json")
    monkeypatch.delattr(torch._C, "_dispatch_kernel_for_dispatch_key_is_fallthrough")
    spec = OPS["matmul"].spec
    assert autograd.autocast_rule(spec, "privateuseone") == (spec.autocast, None)
    (line,) = (json.loads(raw) for raw in capsys.readouterr().err.splitlines())
    assert line["level"] == "warning" and line["op"] == "aten::matmul"
    assert line["missing"] == ["torch._C._dispatch_kernel_for_dispatch_key_is_fallthrough"]


def test_the_rule_is_torchs_own_per_op_and_device_type():
    """As torch 2.13 ships: CPU, CUDA and XPU autocast cast SDPA, matmul and linear (the rule reads
    torch, it is not a constant), PrivateUse1's autocast none of them, and each op asks its own
    counterpart."""
    for name, op in OPS.items():
        for device_type in ("cpu", "cuda", "xpu"):
            assert autograd.autocast_rule(op.spec, device_type) == (op.spec.autocast, None), (
                name,
                device_type,
            )
        assert autograd.autocast_rule(op.spec, "privateuseone") == ((), None), name
        assert autograd.autocast_rule(op.spec, "privateuseone", ask=False) == (op.spec.autocast, None), name


def test_the_traced_rule_is_marked_as_the_public_decorator_marks():
    """autograd marks `_asked_while_traced` by hand (importing torch._dynamo at import cost ~2 s):
    the mark must be exactly what torch.compiler.assume_constant_result sets."""

    def probe():
        return 0

    marked = set(vars(torch.compiler.assume_constant_result(probe)))
    assert marked <= set(vars(autograd._asked_while_traced)), marked


def test_importing_the_ops_does_not_import_dynamo():
    import subprocess
    import sys

    code = "import sys, torchhal.ops; print('torch._dynamo' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "False", done.stderr
