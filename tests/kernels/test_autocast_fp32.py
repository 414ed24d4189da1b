"""Autocast's fp32 policy: torch's CUDA and XPU autocast run layer_norm and rms_norm in fp32 and
return fp32 (their "autocast to float32" lists); CPU autocast leaves both alone. torchhal's norms
follow torch per device type, asked of torch's dispatcher. Before, `ops.layer_norm` and
`ops.rms_norm` returned bf16 under CUDA autocast where F.layer_norm and F.rms_norm return fp32,
and refused the bf16-x-with-fp32-weights mix that torch computes there.

A CPU-only machine has no CUDA autocast, so `cpu_autocast_as_cuda` gives CPU autocast CUDA's
policy for aten::layer_norm and aten::rms_norm (an AutocastCPU kernel that casts floating inputs,
not fp64, to fp32 and runs the op below autocast, as torch's CUDA kernel does): torch's own
F.layer_norm and F.rms_norm then return fp32 under CPU autocast, and the ops must agree.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import torchhal
from torchhal.hal_core import telemetry
from torchhal.kernels import autograd
from torchhal.kernels import nn as thnn

AUTOCAST = torch.bfloat16
NORMS = {"layer_norm": torchhal.ops._LAYER_NORM.__self__, "rms_norm": torchhal.ops._RMS_NORM.__self__}


def _fp32_policy(op):
    """What torch's CUDA autocast kernel of an fp32-list op does, for AutocastCPU."""

    def kernel(*args, **kwargs):
        cast = [a.float() if autograd._autocast_eligible(a) else a for a in args]
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            return op(*cast, **kwargs)

    return kernel


@pytest.fixture
def cpu_autocast_as_cuda(monkeypatch):
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("layer_norm", _fp32_policy(torch.ops.aten.layer_norm.default), "AutocastCPU")
        lib.impl("rms_norm", _fp32_policy(torch.ops.aten.rms_norm.default), "AutocastCPU")
        for op in NORMS.values():
            assert autograd.torch_autocasts(op.spec.aten_op, "cpu")
            # no answer kept for the CPU from earlier tests: the rule is asked at the next
            # autocast call, as for a backend whose autocast kernels came after torchhal's import
            monkeypatch.setattr(op, "_autocast_rules", {})
        yield
    finally:
        lib._destroy()  # torch's CPU autocast as it ships, for the other tests


def _args(name, x_dtype, param_dtype, grad=False):
    x = torch.randn(5, 7, 48, dtype=x_dtype)
    params = [torch.randn(48, dtype=param_dtype) for _ in range(2 if name == "layer_norm" else 1)]
    return [t.requires_grad_(grad) for t in (x, *params)]


def _torch(name, x, weight, bias=None):
    if name == "layer_norm":
        return nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, 1e-5)
    return nn.functional.rms_norm(x, (x.shape[-1],), weight, 1e-6)


def _ours(name, *args):
    return getattr(torchhal.ops, name)(*args)


def test_the_rule_is_torchs_own_per_device_type():
    """CUDA and XPU autocast run layer_norm in fp32, CPU autocast does not; CPU autocast does cast
    matmul (the rule reads torch, it is not a constant). rms_norm joined CUDA's and XPU's fp32
    lists after torch 2.11 (whose CUDA autocast leaves it alone): the rule follows the torch
    installed, so only its CPU fact is asserted."""
    assert autograd.torch_autocasts("aten::layer_norm", "cuda") and autograd.torch_autocasts(
        "aten::layer_norm", "xpu"
    )
    assert not autograd.torch_autocasts("aten::layer_norm", "cpu")
    assert not autograd.torch_autocasts("aten::rms_norm", "cpu")
    assert autograd.torch_autocasts("aten::matmul", "cpu")
    assert not autograd.torch_autocasts("aten::layer_norm", "meta")  # no autocast of its own
    spec = NORMS["layer_norm"].spec
    assert (
        autograd.autocast_rule(spec, "cuda")
        == autograd.autocast_rule(spec, "xpu")
        == ((0, 1, 2), torch.float32)
    )
    for name, op in NORMS.items():
        assert autograd.autocast_rule(op.spec, "cpu") == ((), None), name


def test_without_the_dispatcher_query_the_rule_takes_torchs_documented_lists(monkeypatch, capsys):
    telemetry.configure(log_format="json")
    monkeypatch.delattr(torch._C, "_dispatch_has_kernel_for_dispatch_key")
    spec = NORMS["rms_norm"].spec  # not on torch 2.11's CUDA list: the documented list is 2.13's
    assert autograd.autocast_rule(spec, "cuda") == ((0, 1), torch.float32)
    (line,) = (json.loads(raw) for raw in capsys.readouterr().err.splitlines())
    assert line["level"] == "warning" and line["missing"] == [
        "torch._C._dispatch_has_kernel_for_dispatch_key"
    ]
    assert line["op"] == "aten::rms_norm" and line["device_type"] == "cuda"
    assert autograd.autocast_rule(spec, "cpu") == ((), None)


def test_an_unknown_aten_op_is_refused_by_name_when_the_op_is_built():
    spec = NORMS["layer_norm"].spec._replace(aten_op="aten::layernorm")
    with pytest.raises(ValueError, match=r"aten::layernorm.*does not exist"):
        autograd.DifferentiableOp(spec, lambda op, *args: None)


def test_a_backends_autocast_kernels_registered_after_the_op_was_built_are_followed():
    """HPU, XLA and PrivateUse1 register their autocast kernels when their extension is imported,
    often after torchhal: the rule is asked at the first autocast call on a device type, not when
    the op is built (where a backend's later kernels went unseen). Here a fresh op's first CPU
    autocast call comes after the fp32 policy was registered on AutocastCPU."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        op = autograd.DifferentiableOp(
            NORMS["layer_norm"].spec, NORMS["layer_norm"]._dispatch, namespace="torchhal_test_late_autocast"
        )
        lib.impl("layer_norm", _fp32_policy(torch.ops.aten.layer_norm.default), "AutocastCPU")
        x, weight, bias = _args("layer_norm", AUTOCAST, AUTOCAST)
        with torch.autocast("cpu", dtype=AUTOCAST):
            ours, theirs = op(x, weight, bias, 1e-5), _torch("layer_norm", x, weight, bias)
        assert ours.dtype == theirs.dtype == torch.float32
        torch.testing.assert_close(ours, theirs)
    finally:
        lib._destroy()


@pytest.mark.parametrize("name", NORMS)
@pytest.mark.parametrize(
    "dtypes", [(AUTOCAST, AUTOCAST), (AUTOCAST, torch.float32), (torch.float32, AUTOCAST)]
)
@pytest.mark.parametrize("path", ["eager", "eager_with_gradients", "compiled"])
def test_under_cuda_type_autocast_the_norms_return_what_torch_returns(
    cpu_autocast_as_cuda, name, dtypes, path
):
    """fp32 out, computed from the fp32 casts (the same answer as outside autocast on inputs cast
    by hand, to the bit), whatever the mix of bf16 and fp32; gradients in each leaf's own dtype,
    through the casts, as torch's autocast gives them."""
    grad = path != "eager"
    torch._dynamo.reset()  # each case compiles _ours afresh: together they pass Dynamo's recompile limit
    fn = (
        _ours
        if path != "compiled"
        else torch.compile(_ours, backend="aot_eager", fullgraph=True, dynamic=False)
    )
    assert_fp32_as_torch(fn, name, _args(name, *dtypes, grad=grad), "cpu")


def assert_fp32_as_torch(fn, name, leaves, device_type):
    """`fn(name, *leaves)` under `device_type`'s autocast returns fp32 as torch's F.* does there,
    equal to the bit to the op outside autocast on inputs cast by hand, and the gradients come
    back in each leaf's own dtype, equal to the hand-cast ones (the GPU test uses it too)."""
    grad = leaves[0].requires_grad
    with torch.autocast(device_type, dtype=AUTOCAST):
        out, theirs = fn(name, *leaves), _torch(name, *leaves)
    by_hand = [t.detach().float().requires_grad_(grad) for t in leaves]
    want = _ours(name, *by_hand)
    assert out.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(out, theirs)
    if grad:
        dy = torch.randn_like(want)
        ours_grads = torch.autograd.grad(out, leaves, dy)
        theirs_grads = torch.autograd.grad(theirs, leaves, dy)
        want_grads = torch.autograd.grad(want, by_hand, dy)
        for leaf, g, t, w in zip(leaves, ours_grads, theirs_grads, want_grads, strict=True):
            assert g.dtype == t.dtype == leaf.dtype
            torch.testing.assert_close(g, w.to(leaf.dtype), rtol=0, atol=0)
            torch.testing.assert_close(g, t)


@pytest.mark.parametrize("name", NORMS)
def test_cpu_autocast_leaves_the_norms_alone_as_torchs(name):
    """Without the policy (CPU autocast, as torch ships it): bf16 in, bf16 out, the mix refused."""
    leaves = _args(name, AUTOCAST, AUTOCAST)
    with torch.autocast("cpu", dtype=AUTOCAST):
        out, theirs = _ours(name, *leaves), _torch(name, *leaves)
    assert out.dtype == theirs.dtype == AUTOCAST
    torch.testing.assert_close(out, _ours(name, *leaves), rtol=0, atol=0)
    with (
        torch.autocast("cpu", dtype=AUTOCAST),
        pytest.raises(torchhal.hal_core.InvalidArgumentError, match="dtypes"),
    ):
        _ours(name, *_args(name, AUTOCAST, torch.float32))


def test_fp64_is_not_cast(cpu_autocast_as_cuda):
    """Autocast leaves fp64 alone, as torch's does."""
    x, weight, bias = _args("layer_norm", torch.float64, torch.float64)
    with torch.autocast("cpu", dtype=AUTOCAST):
        out, theirs = _ours("layer_norm", x, weight, bias), _torch("layer_norm", x, weight, bias)
    assert out.dtype == theirs.dtype == torch.float64


@pytest.mark.parametrize("param_dtype", [AUTOCAST, torch.float32])
def test_layer_norm_module_under_cuda_type_autocast_is_torchs(cpu_autocast_as_cuda, param_dtype):
    """torchhal's LayerNorm is torch.nn.LayerNorm's drop-in: fp32 out under CUDA-type autocast,
    whether its parameters are x's dtype (through the op) or fp32 (through torch's layer_norm,
    which then agrees with the op)."""
    ours, theirs = thnn.LayerNorm(48, dtype=param_dtype), nn.LayerNorm(48, dtype=param_dtype)
    with torch.no_grad():
        for p, q in ((ours.weight, theirs.weight), (ours.bias, theirs.bias)):
            p.copy_(torch.randn(48))
            q.copy_(p)
    x = torch.randn(3, 5, 48, dtype=AUTOCAST)
    with torch.autocast("cpu", dtype=AUTOCAST):
        out, want, op = ours(x), theirs(x), _ours("layer_norm", x, ours.weight, ours.bias)
    assert out.dtype == want.dtype == op.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(out, op, rtol=0, atol=0)


@pytest.mark.parametrize("param_dtype", [AUTOCAST, torch.float32, None])  # None: no weight
def test_rms_norm_module_under_cuda_type_autocast_is_hugging_faces(cpu_autocast_as_cuda, param_dtype):
    """torchhal's RMSNorm is Hugging Face's (Llama's) drop-in, elementwise math that autocast leaves
    alone: under CUDA-type autocast it returns what it returns outside it (x's dtype for one dtype,
    HF's formula for the mix), where ops.rms_norm and torch.nn.RMSNorm return fp32."""
    norm = thnn.RMSNorm(48, dtype=param_dtype, elementwise_affine=param_dtype is not None)
    if norm.weight is not None:
        with torch.no_grad():
            norm.weight.copy_(torch.randn(48))
    weight = torch.ones(48, dtype=AUTOCAST) if norm.weight is None else norm.weight
    x = torch.randn(3, 5, 48, dtype=AUTOCAST)
    x32 = x.float()
    hf = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    outside = norm(x)
    with torch.autocast("cpu", dtype=AUTOCAST):
        out = norm(x)
        op = _ours("rms_norm", x, weight)
        theirs = nn.RMSNorm(48, eps=1e-6, elementwise_affine=False)(x)
    assert out.dtype == outside.dtype == hf.dtype == torch.promote_types(x.dtype, weight.dtype)
    assert op.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(out, outside, rtol=0, atol=0)
    torch.testing.assert_close(out, hf)  # to a bf16 rounding: the op rounds once, HF twice
