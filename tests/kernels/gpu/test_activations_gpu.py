"""swiglu and geglu Triton kernels on an NVIDIA GPU in bf16 and fp16 at model sizes."""

from __future__ import annotations

import pytest
import torch

from torchhal.kernels import swiglu

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
SHAPES = [(4096, 11008), (2, 2047, 14336), (8192, 4096), (97, 123)]
SPECS = {"swiglu": swiglu.SWIGLU_AUTOGRAD, "geglu": swiglu.GEGLU_AUTOGRAD}


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_activation(gpu_hal, candidate, check_kernels, op, dtype, shape):
    gate = 2 * torch.randn(shape, device="cuda", dtype=dtype)
    args, dy = (gate, torch.randn_like(gate)), torch.randn_like(gate)
    forward = candidate(gpu_hal, op, "triton", *args)
    backward = candidate(gpu_hal, f"{op}_backward", "triton", dy, *args)
    check_kernels(SPECS[op], forward, backward, gpu_hal.kernels.op(op).reference, args, (dy,))


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_halves_of_a_fused_projection(gpu_hal, candidate, check_kernels, op):
    fused = 2 * torch.randn(4096, 2 * 11008, device="cuda", dtype=torch.bfloat16)
    args = tuple(fused.chunk(2, dim=-1))
    dy = torch.randn_like(args[0])
    forward = candidate(gpu_hal, op, "triton", *args)
    backward = candidate(gpu_hal, f"{op}_backward", "triton", dy, *args)
    check_kernels(SPECS[op], forward, backward, gpu_hal.kernels.op(op).reference, args, (dy,))


def test_activations_compile_with_inductor(gpu_ops):
    torch._dynamo.reset()
    fused = torch.randn(512, 2 * 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def block(fused):
        gate, up = fused.chunk(2, dim=-1)
        return (gpu_ops.swiglu(gate, up) + gpu_ops.geglu(up, gate)).float().square().mean()

    (eager,) = torch.autograd.grad(block(fused), fused)
    (got,) = torch.autograd.grad(torch.compile(block, fullgraph=True)(fused), fused)
    torch.testing.assert_close(got, eager)
