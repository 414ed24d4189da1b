"""matmul's training path on an NVIDIA GPU: gradients through the registry's matmul_backward in
bf16, and the custom ops under torch.compile with inductor."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("a_shape", "b_shape"), [((8, 333, 1024), (1024, 2048)), ((4, 8, 97, 64), (4, 8, 64, 113))]
)
def test_gradients_match_torch_in_bf16(gpu_ops, a_shape, b_shape):
    """The same products as torch's own matmul backward (cuBLAS both ways): equal up to the
    summation order of the folded batch."""
    a = torch.randn(a_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(b_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = gpu_ops.matmul(a, b)
    want = torch.matmul(a, b)
    torch.testing.assert_close(out, want)
    grad = torch.randn_like(want)
    got = torch.autograd.grad(out, (a, b), grad)
    expected = torch.autograd.grad(want, (a, b), grad)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


def test_matmul_compile_with_inductor(gpu_ops):
    torch._dynamo.reset()
    a = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def block(a, b):
        return gpu_ops.matmul(a * 2, b).float().square().mean()

    eager = torch.autograd.grad(block(a, b), (a, b))
    got = torch.autograd.grad(torch.compile(block, fullgraph=True)(a, b), (a, b))
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e)
