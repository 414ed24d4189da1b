"""Triton kernels for rms_norm and layer_norm, forward and backward; imported only when a candidate binds.

Forward: one program per row, a block covering the row, statistics and the affine transform in
fp32, one rounding to the output dtype. Backward: `RowLaunch.backward_programs` programs, each
walking a contiguous run of rows; it recomputes the row statistics from x (the row is read
anyway, so nothing is saved by the forward), taking the sums that do not depend on each other in
one round (each round is a cross-warp reduction, a barrier), writes dx, and accumulates its
partial weight (and bias) gradient in fp32 registers; the partials are summed across programs
after. Rows too long to hold across the sums are read again from L1 (`RowLaunch.reload_row`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchhal.kernels.triton_rows import RowLaunch, next_power_of_2, row_stride


@triton.jit
def _rms_norm_fwd(X, W, Y, x_stride, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * x_stride + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(Y + row * n_cols + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _read_row(xs, dys, mask, KEEP_IN_L1: tl.constexpr):
    """x and dy of one row in fp32. KEEP_IN_L1 reads them with the default cache policy, so that
    their second read after the row's sums (`RowLaunch.reload_row`) hits L1; otherwise they are
    read once, evict-first."""
    if KEEP_IN_L1:
        x = tl.load(xs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dys, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(xs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        dy = tl.load(dys, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    return x, dy


@triton.jit
def _rms_norm_bwd(
    DY, X, W, DX, DW, dy_stride, x_stride, n_rows, n_cols, eps, rows_per_program,
    BLOCK: tl.constexpr, RELOAD_ROW: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if not RELOAD_ROW:
        held_w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    row = pid * rows_per_program
    end = tl.minimum(row + rows_per_program, n_rows)
    while row < end:  # not `for ... in range`: the interpreter cannot take tensor bounds (triton#9171)
        r = row.to(tl.int64)
        xs, dys = X + r * x_stride + cols, DY + r * dy_stride + cols
        x, dy = _read_row(xs, dys, mask, KEEP_IN_L1=RELOAD_ROW)
        if RELOAD_ROW:  # read per row and held across the sums
            w = tl.load(W + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        else:
            w = held_w
        g = dy * w
        # both sums in one round: mean(g * xhat) = rstd * mean(g * x)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        mean_gx = tl.sum(g * x, axis=0) / n_cols
        if RELOAD_ROW:  # RowLaunch.reload_row: x and dy again from L1 rather than held across the sums
            x, dy = _read_row(xs, dys, mask, KEEP_IN_L1=False)
            g = dy * w
        xhat = x * rstd
        dx = (g - xhat * (rstd * mean_gx)) * rstd
        tl.store(DX + r * n_cols + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        row += 1
    tl.store(DW + pid * n_cols + cols, dw, mask=mask)


@triton.jit
def _layer_norm_fwd(X, W, B, Y, x_stride, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * x_stride + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    diff = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(diff * diff, axis=0) / n_cols + eps)
    # weight and bias after the sums: loaded before, they are live across both reductions
    # (ptxas, 16384 at 16 warps: 91 registers a thread against 64, so half the programs resident)
    w = tl.load(W + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(Y + row * n_cols + cols, (diff * rstd * w + b).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd(
    DY, X, W, DX, DW, DB, dy_stride, x_stride, n_rows, n_cols, eps, rows_per_program,
    BLOCK: tl.constexpr, RELOAD_ROW: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if not RELOAD_ROW:
        held_w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    row = pid * rows_per_program
    end = tl.minimum(row + rows_per_program, n_rows)
    while row < end:  # not `for ... in range`: the interpreter cannot take tensor bounds (triton#9171)
        r = row.to(tl.int64)
        xs, dys = X + r * x_stride + cols, DY + r * dy_stride + cols
        x, dy = _read_row(xs, dys, mask, KEEP_IN_L1=RELOAD_ROW)
        if RELOAD_ROW:  # read per row and held across the sums
            w = tl.load(W + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        else:
            w = held_w
        mean = tl.sum(x, axis=0) / n_cols
        diff = tl.where(mask, x - mean, 0.0)
        g = dy * w
        # three sums in one round after the mean: mean(g * xhat) = rstd * mean(g * diff)
        rstd = tl.rsqrt(tl.sum(diff * diff, axis=0) / n_cols + eps)
        mean_g = tl.sum(g, axis=0) / n_cols
        mean_gd = tl.sum(g * diff, axis=0) / n_cols
        if RELOAD_ROW:  # RowLaunch.reload_row: x and dy again from L1 rather than held across the sums
            x, dy = _read_row(xs, dys, mask, KEEP_IN_L1=False)
            diff = tl.where(mask, x - mean, 0.0)
            g = dy * w
        xhat = diff * rstd
        dx = (g - mean_g - xhat * (rstd * mean_gd)) * rstd
        tl.store(DX + r * n_cols + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
        row += 1
    tl.store(DW + pid * n_cols + cols, dw, mask=mask)
    tl.store(DB + pid * n_cols + cols, db, mask=mask)


def _rows(x: torch.Tensor) -> tuple[int, int]:
    cols = x.shape[-1]
    return (x.numel() // cols if cols else 0), cols


def _backward_grid(launch: RowLaunch, rows: int, warps: int) -> tuple[int, int]:
    """(programs, rows per program) with no program left without rows."""
    per_program = triton.cdiv(rows, launch.backward_programs(rows, warps))
    return triton.cdiv(rows, per_program), per_program


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
        BLOCK=block, num_warps=launch.forward_warps(block, x.element_size()),
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
    warps = launch.backward_warps(block, x.element_size())
    programs, per_program = _backward_grid(launch, rows, warps)
    partial = torch.empty((programs, cols), dtype=torch.float32, device=x.device)
    _rms_norm_bwd[(programs,)](
        dy, x, weight, dx, partial, row_stride(dy), row_stride(x), rows, cols, eps, per_program,
        BLOCK=block, RELOAD_ROW=launch.reload_row(block, warps), num_warps=warps,
    )  # fmt: skip
    return dx, partial.sum(0).to(weight.dtype)


def layer_norm_forward(
    launch: RowLaunch, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, cols = _rows(x)
    if rows == 0:
        return y
    block = next_power_of_2(cols)
    _layer_norm_fwd[(rows,)](
        x, weight, bias, y, row_stride(x), cols, eps,
        BLOCK=block, num_warps=launch.forward_warps(block, x.element_size()),
    )  # fmt: skip
    return y


def layer_norm_backward(
    launch: RowLaunch, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, cols = _rows(x)
    if rows == 0:
        return dx, torch.zeros_like(weight), torch.zeros_like(weight)
    block = next_power_of_2(cols)
    warps = launch.backward_warps(block, x.element_size())
    programs, per_program = _backward_grid(launch, rows, warps)
    dw = torch.empty((programs, cols), dtype=torch.float32, device=x.device)
    db = torch.empty_like(dw)
    _layer_norm_bwd[(programs,)](
        dy, x, weight, dx, dw, db, row_stride(dy), row_stride(x), rows, cols, eps, per_program,
        BLOCK=block, RELOAD_ROW=launch.reload_row(block, warps), num_warps=warps,
    )  # fmt: skip
    return dx, dw.sum(0).to(weight.dtype), db.sum(0).to(weight.dtype)
