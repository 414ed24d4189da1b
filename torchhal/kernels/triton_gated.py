"""Triton kernels for the gated activations swiglu and geglu; imported only when a candidate binds.

Element-wise over (rows, cols) views, so gate and up may be strided views of one fused
projection (e.g. `gate, up = proj.chunk(2, -1)`) without a copy. A 1-D grid over the (row,
column block) tiles in memory order (`RowLaunch.elementwise`: the forward on GATED_FORWARD_TILE,
the backward on ELEMENTWISE_TILE), so programs launched together read neighbouring memory. Activations
and their derivatives in fp32, through the logistic function: silu(g) = g*sigmoid(g),
gelu_tanh(g) = g*sigmoid(2*sqrt(2/pi)*(g + 0.044715*g^3)) (0.5*(1 + tanh(z)) = sigmoid(2z)
exactly), so one exp serves value and derivative.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchhal.kernels.swiglu import GELU_C, GELU_K
from torchhal.kernels.triton_rows import ELEMENTWISE_TILE, GATED_FORWARD_TILE, RowLaunch, cdiv, row_stride

SILU = 0
GELU_TANH = 1
ACTIVATIONS = {"swiglu": SILU, "geglu": GELU_TANH}
_SILU = tl.constexpr(SILU)
_GELU_K = tl.constexpr(GELU_K)
_GELU_C = tl.constexpr(GELU_C)


@triton.jit
def _activation(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in fp32; the forward kernels drop the derivative (dead code to the compiler)."""
    if ACT == _SILU:
        s = tl.sigmoid(g)
        return g * s, s * (1.0 + g * (1.0 - s))
    else:
        g2 = g * g
        # tensors on the left of the constants: Triton 3.7's interpreter turns `constexpr * tensor`
        # into a constexpr wrapping the tensor, which tl.sigmoid then refuses
        s = tl.sigmoid(g * (2.0 * _GELU_K) * (1.0 + g2 * _GELU_C))
        return g * s, s + g * s * (1.0 - s) * (2.0 * _GELU_K) * (1.0 + g2 * (3.0 * _GELU_C))


@triton.jit
def _tile(n_cols, BLOCK: tl.constexpr):
    """(row, columns) of this program's tile: tile i is column block i % blocks of row i // blocks."""
    pid = tl.program_id(0)
    blocks = tl.cdiv(n_cols, BLOCK)
    return (pid // blocks).to(tl.int64), (pid % blocks) * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _gated_fwd(G, U, Y, g_stride, u_stride, n_cols, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row, cols = _tile(n_cols, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * g_stride + cols, mask=mask, other=0.0)
    u = tl.load(U + row * u_stride + cols, mask=mask, other=0.0)
    a, _ = _activation(g.to(tl.float32), ACT)
    tl.store(Y + row * n_cols + cols, (a * u.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd(
    DY, G, U, DG, DU, dy_stride, g_stride, u_stride, n_cols, ACT: tl.constexpr, BLOCK: tl.constexpr
):
    row, cols = _tile(n_cols, BLOCK)
    mask = cols < n_cols
    dy = tl.load(DY + row * dy_stride + cols, mask=mask, other=0.0)
    g = tl.load(G + row * g_stride + cols, mask=mask, other=0.0)
    u = tl.load(U + row * u_stride + cols, mask=mask, other=0.0)
    dy = dy.to(tl.float32)
    a, da = _activation(g.to(tl.float32), ACT)
    tl.store(DG + row * n_cols + cols, (dy * u.to(tl.float32) * da).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * n_cols + cols, (dy * a).to(DU.dtype.element_ty), mask=mask)


def _grid(launch: RowLaunch, x: torch.Tensor, tile: tuple[int, int]) -> tuple[tuple[int], int, int]:
    cols = x.shape[-1]
    block, warps = launch.elementwise(cols, x.element_size(), tile)
    return ((x.numel() // cols) * cdiv(cols, block),), block, warps


def gated_forward(launch: RowLaunch, op: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if y.numel() == 0:
        return y
    grid, block, warps = _grid(launch, gate, GATED_FORWARD_TILE)
    _gated_fwd[grid](
        gate, up, y, row_stride(gate), row_stride(up), gate.shape[-1],
        ACT=ACTIVATIONS[op], BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return y


def gated_backward(
    launch: RowLaunch, op: str, dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if dgate.numel() == 0:
        return dgate, dup
    grid, block, warps = _grid(launch, gate, ELEMENTWISE_TILE)
    _gated_bwd[grid](
        dy, gate, up, dgate, dup, row_stride(dy), row_stride(gate), row_stride(up), gate.shape[-1],
        ACT=ACTIVATIONS[op], BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return dgate, dup
