"""CUDA autocast: attention, matmul and linear_cross_entropy on fp32 inputs give what they give on
the inputs cast by hand, on every path, whichever GPU candidate the registry selects (before,
the Triton kernels computed fp32 inputs in fp32 under autocast while SDPA cast them)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_autocast import AUTOCAST, FUNCTIONS, _expected, _inputs

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
