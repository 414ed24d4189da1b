"""Triton kernels for rms_norm and layer_norm, forward and backward; imported only when a candidate binds.

Forward: one program per row, a block covering the row, statistics and the affine transform in
fp32, one rounding to the output dtype; layer_norm's training forward also writes each row's mean
and rstd (8 bytes a row), as PyTorch and Liger do, so its backward takes one reduction round a
row instead of two. Backward: `RowLaunch.backward_programs` programs, program p taking rows p,
p + P, p + 2P, ... (so the programs running at one time read neighbouring rows, as the forwards
do); rms_norm recomputes rstd from x in the same round as its other sum; each writes dx and
accumulates its partial weight (and bias) gradient in fp32 registers, summed across programs
after. Rows too long to hold across the sums are read again from L1 (`RowLaunch.reload_row`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchhal.kernels.triton_rows import RowLaunch, next_power_of_2, row_stride


@triton.jit
def _row_mask(cols, n_cols, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """The columns inside the row. EVEN (the row fills the block) makes it a compile-time constant,
    so the loads and stores lose their predicates: on an H200 the forwards ran up to 2.2% faster
    that way (rms_norm at 32768x4096 within 0.4%), on an H100 within 0.2% (docs/benchmarks.md,
    eleventh session)."""
    return cols < (BLOCK if EVEN else n_cols)


@triton.jit
def _rms_norm_fwd(X, W, Y, x_stride, n_cols, eps, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = _row_mask(cols, n_cols, BLOCK, EVEN)
    x = tl.load(X + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(Y + row * n_cols + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _read_row(xs, dys, mask, SECOND_READ: tl.constexpr):
    """x and dy of one row in fp32. The first read takes the default cache policy, so that a
    second read after the row's sums (`RowLaunch.reload_row`) hits L1; that second read is the
    row's last, evict-first. (On an H100, evict-first on a row read only once measured up to 1.2%
    slower, and the default policy on the second of two reads 14-35% slower: docs/benchmarks.md,
    ninth session.)"""
    if SECOND_READ:
        x = tl.load(xs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        dy = tl.load(dys, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        x = tl.load(xs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dys, mask=mask, other=0.0).to(tl.float32)
    return x, dy


@triton.jit
def _rms_norm_bwd(
    DY, X, W, DX, DW, dy_stride, x_stride, n_rows, n_cols, eps,
    BLOCK: tl.constexpr, RELOAD_ROW: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if not RELOAD_ROW:
        held_w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    r = pid.to(tl.int64)  # rows pid, pid + P, ...; an int64, as it addresses memory past 2**31 rows
    while r < n_rows:  # not `for ... in range`: the interpreter cannot take tensor bounds (triton#9171)
        xs, dys = X + r * x_stride + cols, DY + r * dy_stride + cols
        x, dy = _read_row(xs, dys, mask, SECOND_READ=False)
        if RELOAD_ROW:  # read per row and held across the sums
            w = tl.load(W + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        else:
            w = held_w
        g = dy * w
        # both sums in one round: mean(g * xhat) = rstd * mean(g * x)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        mean_gx = tl.sum(g * x, axis=0) / n_cols
        if RELOAD_ROW:  # RowLaunch.reload_row: x and dy again from L1 rather than held across the sums
            x, dy = _read_row(xs, dys, mask, SECOND_READ=True)
            g = dy * w
        xhat = x * rstd
        dx = (g - xhat * (rstd * mean_gx)) * rstd
        tl.store(DX + r * n_cols + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        r += tl.num_programs(0)
    tl.store(DW + pid * n_cols + cols, dw, mask=mask)


@triton.jit
def _layer_norm_fwd(
    X, W, B, Y, Mean, Rstd, x_stride, n_cols, eps,
    BLOCK: tl.constexpr, SAVE_STATS: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = _row_mask(cols, n_cols, BLOCK, EVEN)
    x = tl.load(X + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    # the mean of x - x[0], then x[0] added back: a constant row's differences are exactly 0 and y = b
    # (torch's CPU kernel gives b too; sum(x) / n rounds at x's scale, and rstd ~ 1/sqrt(eps) amplified it)
    shift = tl.load(X + row * x_stride).to(tl.float32)
    shifted = tl.where(mask, x - shift, 0.0)
    mean_shifted = tl.sum(shifted, axis=0) / n_cols
    diff = tl.where(mask, shifted - mean_shifted, 0.0)
    mean = shift + mean_shifted
    rstd = tl.rsqrt(tl.sum(diff * diff, axis=0) / n_cols + eps)
    # weight and bias after the sums: loaded before, they are live across both reductions
    # (ptxas, 16384 at 16 warps: 91 registers a thread against 64, so half the programs resident)
    w = tl.load(W + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(Y + row * n_cols + cols, (diff * rstd * w + b).to(Y.dtype.element_ty), mask=mask)
    if SAVE_STATS:
        tl.store(Mean + row, mean)
        tl.store(Rstd + row, rstd)


@triton.jit
def _layer_norm_bwd(
    DY, X, W, Mean, Rstd, DX, DW, DB, dy_stride, x_stride, n_rows, n_cols,
    BLOCK: tl.constexpr, RELOAD_ROW: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if not RELOAD_ROW:
        held_w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    r = pid.to(tl.int64)  # rows pid, pid + P, ...; an int64, as it addresses memory past 2**31 rows
    while r < n_rows:  # not `for ... in range`: the interpreter cannot take tensor bounds (triton#9171)
        mean = tl.load(Mean + r)
        rstd = tl.load(Rstd + r)
        xs, dys = X + r * x_stride + cols, DY + r * dy_stride + cols
        x, dy = _read_row(xs, dys, mask, SECOND_READ=False)
        if RELOAD_ROW:  # read per row and held across the sums
            w = tl.load(W + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        else:
            w = held_w
        # 0 beyond the row: (0 - mean) * rstd there may overflow, and 0 * inf in a sum is NaN
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = dy * w
        mean_g = tl.sum(g, axis=0) / n_cols  # both sums in one round
        mean_gxhat = tl.sum(g * xhat, axis=0) / n_cols
        if RELOAD_ROW:  # RowLaunch.reload_row: x and dy again from L1 rather than held across the sums
            x, dy = _read_row(xs, dys, mask, SECOND_READ=True)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            g = dy * w
        dx = (g - mean_g - xhat * mean_gxhat) * rstd
        tl.store(DX + r * n_cols + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
        r += tl.num_programs(0)
    tl.store(DW + pid * n_cols + cols, dw, mask=mask)
    tl.store(DB + pid * n_cols + cols, db, mask=mask)


def _rows(x: torch.Tensor) -> tuple[int, int]:
    cols = x.shape[-1]
    return (x.numel() // cols if cols else 0), cols


def rms_norm_forward(
    launch: RowLaunch, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, cols = _rows(x)
    if rows == 0:
        return y
    block = next_power_of_2(cols)
    _rms_norm_fwd[(rows,)](
        x, weight, y, row_stride(x), cols, eps,
        BLOCK=block, EVEN=cols == block, num_warps=launch.norm_warps(block, x.element_size()),
    )  # fmt: skip
    return y


def rms_norm_backward(
    launch: RowLaunch, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, cols = _rows(x)
    if rows == 0:
        return dx, torch.zeros_like(weight)
    block = next_power_of_2(cols)
    warps = launch.norm_warps(block, x.element_size())
    programs = launch.backward_programs(rows, warps)
    partial = torch.empty((programs, cols), dtype=torch.float32, device=x.device)
    _rms_norm_bwd[(programs,)](
        dy, x, weight, dx, partial, row_stride(dy), row_stride(x), rows, cols, eps,
        BLOCK=block, RELOAD_ROW=launch.reload_row(block, warps), num_warps=warps,
    )  # fmt: skip
    return dx, partial.sum(0).to(weight.dtype)


def layer_norm_forward(
    launch: RowLaunch, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    return _layer_norm_forward(launch, x, weight, bias, eps, None)


def layer_norm_forward_with_stats(
    launch: RowLaunch, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd), the statistics fp32 of shape x.shape[:-1], for `layer_norm_backward`."""
    mean, rstd = (torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device) for _ in range(2))
    return _layer_norm_forward(launch, x, weight, bias, eps, (mean, rstd)), mean, rstd


def _layer_norm_forward(
    launch: RowLaunch,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    stats: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, cols = _rows(x)
    if rows == 0:
        return y
    block = next_power_of_2(cols)
    mean, rstd = (None, None) if stats is None else stats
    _layer_norm_fwd[(rows,)](
        x, weight, bias, y, mean, rstd, row_stride(x), cols, eps,
        BLOCK=block, SAVE_STATS=stats is not None, EVEN=cols == block,
        num_warps=launch.norm_warps(block, x.element_size()),
    )  # fmt: skip
    return y


def layer_norm_backward(
    launch: RowLaunch,
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the forward's saved statistics; mean and rstd contiguous fp32, one value per row."""
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, cols = _rows(x)
    if rows == 0:
        return dx, torch.zeros_like(weight), torch.zeros_like(weight)
    block = next_power_of_2(cols)
    warps = launch.norm_warps(block, x.element_size())
    programs = launch.backward_programs(rows, warps)
    dw = torch.empty((programs, cols), dtype=torch.float32, device=x.device)
    db = torch.empty_like(dw)
    _layer_norm_bwd[(programs,)](
        dy, x, weight, mean, rstd, dx, dw, db, row_stride(dy), row_stride(x), rows, cols,
        BLOCK=block, RELOAD_ROW=launch.reload_row(block, warps), num_warps=warps,
    )  # fmt: skip
    return dx, dw.sum(0).to(weight.dtype), db.sum(0).to(weight.dtype)
