"""rope Triton kernel on an NVIDIA GPU in bf16 and fp16 at model sizes, Hugging Face layouts."""

from __future__ import annotations

import pytest
import torch

from torchhal.kernels import rope

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
# (batch, seq, heads_q, heads_k, head_dim): Llama-3-8B, an MHA model, a head dim of 80, MQA
SHAPES = [(2, 2048, 32, 8, 128), (1, 4096, 16, 16, 64), (3, 333, 12, 4, 80), (1, 1000, 8, 1, 256)]


def _tables(batch, seq, dim, dtype):
    inv_freq = 1.0 / 500000 ** (torch.arange(0, dim, 2, device="cuda") / dim)
    positions = torch.arange(seq, device="cuda") + torch.randint(0, 1000, (batch, 1), device="cuda")
    angles = positions.unsqueeze(-1) * inv_freq
    emb = torch.cat((angles, angles), dim=-1).unsqueeze(1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rope(gpu_hal, candidate, check_kernels, dtype, shape):
    """q and k as projections (batch, seq, heads, dim) viewed as (batch, heads, seq, dim), as HF does."""
    batch, seq, heads_q, heads_k, dim = shape
    q = torch.randn(batch, seq, heads_q, dim, device="cuda", dtype=dtype).transpose(1, 2)
    k = torch.randn(batch, seq, heads_k, dim, device="cuda", dtype=dtype).transpose(1, 2)
    args = (q, k, *_tables(batch, seq, dim, dtype))
    grads = (
        torch.randn(q.shape, device="cuda", dtype=dtype),
        torch.randn(k.shape, device="cuda", dtype=dtype),
    )
    forward = candidate(gpu_hal, "rope", "triton", *args)
    backward = candidate(gpu_hal, "rope_backward", "triton", *grads, *args[2:])
    check_kernels(rope.AUTOGRAD, forward, backward, rope.reference, args, grads)


def test_rope_compile_with_inductor(gpu_ops):
    torch._dynamo.reset()
    q = torch.randn(2, 256, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 256, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = _tables(2, 256, 128, torch.bfloat16)

    def block(q, k):
        q2, k2 = gpu_ops.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q2.float().square().mean() + k2.float().mean()

    eager = torch.autograd.grad(block(q, k), (q, k))
    got = torch.autograd.grad(torch.compile(block, fullgraph=True)(q, k), (q, k))
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e)
