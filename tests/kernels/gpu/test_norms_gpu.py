"""rms_norm and layer_norm Triton kernels on an NVIDIA GPU in bf16 and fp16 at model sizes, and in
fp32 where rows are long enough to change the launch (16384 up: rms_norm's backward reads its
weight again per row, layer_norm's forward runs on 32 warps)."""

from __future__ import annotations

import pytest
import torch

from torchhal.kernels import layer_norm, rms_norm

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
SHAPES = [(4096, 4096), (8192, 2048), (2, 1023, 5120), (1024, 16384), (97, 123)]
CASES = [(dtype, shape) for dtype in DTYPES for shape in SHAPES] + [
    (torch.float32, shape) for shape in [(1024, 16384), (64, 32768), (97, 123)]
]


def _weight(n: int, dtype: torch.dtype) -> torch.Tensor:
    return (1 + 0.2 * torch.randn(n, device="cuda")).to(dtype)


@pytest.mark.parametrize(("dtype", "shape"), CASES)
def test_rms_norm(gpu_hal, candidate, check_kernels, dtype, shape):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    args, dy = (x, _weight(shape[-1], dtype), 1e-6), torch.randn_like(x)
    forward = candidate(gpu_hal, "rms_norm", "triton", *args)
    backward = candidate(gpu_hal, "rms_norm_backward", "triton", dy, *args)
    check_kernels(rms_norm.AUTOGRAD, forward, backward, rms_norm.reference, args, (dy,))


@pytest.mark.parametrize(("dtype", "shape"), CASES)
def test_layer_norm(gpu_hal, candidate, check_kernels, dtype, shape):
    x = torch.randn(shape, device="cuda", dtype=dtype) + 2
    bias = (0.2 * torch.randn(shape[-1], device="cuda")).to(dtype)
    args, dy = (x, _weight(shape[-1], dtype), bias, 1e-5), torch.randn_like(x)
    forward = candidate(gpu_hal, "layer_norm_forward", "triton", *args)
    _, mean, rstd = layer_norm.reference_forward(*args)
    backward = candidate(gpu_hal, "layer_norm_backward", "triton", dy, x, args[1], mean, rstd)
    check_kernels(layer_norm.AUTOGRAD, forward, backward, layer_norm.reference, args, (dy,))
    # the no-gradient forward: the same kernel without the statistics stores. Not bitwise equal to
    # the training forward: the two specialisations compile apart, so their fp32 arithmetic may
    # differ by a few fp32 roundings (an H100: 7e-7 at 97x123 in fp32), which can move a result
    # across one rounding step of the output dtype (875 of 10.5M bf16 elements at 2x1023x5120).
    plain = candidate(gpu_hal, "layer_norm", "triton", *args)
    y = forward(*args)[0]
    fp32_slack = 16 * torch.finfo(torch.float32).eps * y.abs().max().item()
    torch.testing.assert_close(plain(*args), y, rtol=torch.finfo(dtype).eps, atol=fp32_slack)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [100, 768, 4096, 16384])
def test_layer_norm_of_constant_rows_is_the_bias(gpu_hal, candidate, dtype, hidden):
    """Rows of equal values (1000.1, -3.7, ...) normalise to exactly the bias (torch's own CUDA kernel
    does not, at bf16 and hidden 100 on an H100)."""
    constants = torch.tensor([1000.1, -3.7, 0.3, 12345.678], device="cuda")
    x = constants[:, None].expand(4, hidden).to(dtype).contiguous()
    weight, bias = _weight(hidden, dtype), (0.2 * torch.randn(hidden, device="cuda")).to(dtype)
    for op in ("layer_norm", "layer_norm_forward"):
        y = candidate(gpu_hal, op, "triton", x, weight, bias, 1e-5)(x, weight, bias, 1e-5)
        y = y if op == "layer_norm" else y[0]
        assert torch.equal(y, bias.expand(4, -1)), op


def test_norms_compile_with_inductor(gpu_ops):
    """Both ops inside one torch.compile(fullgraph=True) graph, forward and backward, against eager."""
    torch._dynamo.reset()
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = _weight(4096, torch.bfloat16).requires_grad_(True)
    b = torch.zeros(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def block(x, w, b):
        return gpu_ops.layer_norm(gpu_ops.rms_norm(x, w, 1e-6) * 2, w, b, 1e-5).float().square().mean()

    eager = torch.autograd.grad(block(x, w, b), (x, w, b))
    compiled = torch.compile(block, fullgraph=True)
    got = torch.autograd.grad(compiled(x, w, b), (x, w, b))
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e)
