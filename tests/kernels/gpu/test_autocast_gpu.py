"""CUDA autocast: attention, matmul and linear_cross_entropy on fp32 inputs give what they give on
the inputs cast by hand, on every path, whichever GPU candidate the registry selects (before,
the Triton kernels computed fp32 inputs in fp32 under autocast while SDPA cast them)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_autocast import AUTOCAST, FUNCTIONS, _expected, _inputs
from torchhal.kernels import autograd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("path", ["eager", "eager_with_gradients", "compiled"])
def test_cuda_autocast_casts_as_torch_on_every_path(name, path):
    fn = FUNCTIONS[name]
    inputs, cast = _inputs(name)
    inputs = [x.cuda() for x in inputs]
    grad = path != "eager"
    expected, expected_grads = _expected(fn, inputs, cast, grad)
    leaves = [x.detach().clone().requires_grad_(grad and i in cast) for i, x in enumerate(inputs)]
    run = torch.compile(fn, fullgraph=True) if path == "compiled" else fn
    with torch.autocast("cuda", dtype=AUTOCAST):
        out = run(*leaves)
    assert out.dtype == expected.dtype == (torch.float32 if name == "linear_cross_entropy" else AUTOCAST)
    torch.testing.assert_close(out, expected)
    if grad:
        out.float().sum().backward()
        for leaf, want in zip([x for x in leaves if x.requires_grad], expected_grads, strict=True):
            assert leaf.grad.dtype == torch.float32
            torch.testing.assert_close(leaf.grad, want)


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtypes", [(AUTOCAST, AUTOCAST), (AUTOCAST, torch.float32)])
@pytest.mark.parametrize("path", ["eager", "eager_with_gradients", "compiled"])
def test_cuda_autocast_runs_the_norms_in_fp32_as_torch(name, dtypes, path):
    """CUDA autocast's fp32 list holds layer_norm and (after torch 2.11) rms_norm: the ops return
    fp32, as F.layer_norm and F.rms_norm do there, computed from the fp32 casts (so on the fp32
    Triton kernels), the gradients in each leaf's dtype (they returned bf16 before, and refused the
    fp32-weight mix). Where this torch's CUDA autocast leaves the op alone, so do the ops."""
    from tests.kernels.test_autocast_fp32 import _args, _ours, assert_fp32_as_torch

    if not autograd.torch_autocasts(f"aten::{name}", "cuda"):
        pytest.skip(f"torch {torch.__version__}'s CUDA autocast leaves {name} alone")

    grad = path != "eager"
    leaves = [t.detach().cuda().requires_grad_(grad) for t in _args(name, *dtypes)]
    torch._dynamo.reset()  # each case compiles _ours afresh: together they pass Dynamo's recompile limit
    fn = torch.compile(_ours, fullgraph=True, dynamic=False) if path == "compiled" else _ours
    assert_fp32_as_torch(fn, name, leaves, "cuda")
