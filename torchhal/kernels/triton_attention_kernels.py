"""FlashAttention-2 in Triton: forward with online softmax, backward as a dq pass and a dk/dv pass.

Imported only when a Triton candidate is bound (it imports triton at module level). One kernel
set serves dense `(batch, heads, seq, dim)` tensors and packed variable-length `(tokens, heads,
dim)` tensors: a `VARLEN` constexpr reads each sequence's start and length from `cu_seqlens`,
and every tensor is addressed through its strides, so any layout is computed correctly (a
non-unit stride on the head dim is slow, never wrong).

Masking. Causal and sliding-window attention are one rule: with `offset = seq_k - seq_q`
(bottom-right alignment), query i sees key j when `i + offset - left <= j <= i + offset + right`;
causal is `right = 0`. Each program splits its loop into masked edge blocks and unmasked
interior blocks (no per-element mask work there), and skips blocks no query of the tile sees.

Numerics. Scores are scaled by `scale * log2(e)` and exponentiated with exp2; the row max and
sum, the output and all gradients accumulate in fp32. The saved log-sum-exp is in natural log,
-inf for a query that sees no key (its output is 0). The head dim is padded to a power of two
(at least 16, tl.dot's minimum) with masked loads.

Backward. The dq kernel runs first, once per query tile, and also computes delta = rowsum(dO*O)
(the FA2 preprocessing step, fused). The dk/dv kernel then runs once per key tile and kv head,
looping over the query heads of its group, so GQA/MQA gradients are summed in registers: no
atomics, no expanded copies of k and v, deterministic results.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from torchhal.kernels import triton_attention_interpreter
from torchhal.kernels.attention import LOG2E
from torchhal.kernels.attention_varlen import check_offsets
from torchhal.kernels.triton_attention_config import LaunchConfigs
from torchhal.kernels.triton_rows import cdiv, next_power_of_2

if triton_attention_interpreter.needs_fix():
    triton_attention_interpreter.apply()


class Problem(NamedTuple):
    """Sizes and masking rule shared by forward and backward launches (a NamedTuple: made on every
    call, where a frozen dataclass's field-by-field init cost ~2 µs more)."""

    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int  # dense length, or max_seqlen_q for varlen
    seq_k: int
    head_dim: int
    scale: float
    window_left: int  # used when has_left
    window_right: int  # used when has_right
    has_left: bool
    has_right: bool
    cu_seqlens_q: torch.Tensor | None = None  # varlen only
    cu_seqlens_k: torch.Tensor | None = None

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def head_dim_padded(self) -> int:
        return padded_head_dim(self.head_dim)


def padded_head_dim(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def make_problem(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    seq_q: int,
    seq_k: int,
    batch: int,
    causal: bool,
    scale: float | None,
    window: tuple[int, int] | None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> Problem:
    """Fold causal and window into the (left, right) band; clamp it so int32 math cannot overflow."""
    head_dim = q.shape[-1]
    limit = seq_q + seq_k + 1  # a band wider than this masks nothing more
    left = min(window[0], limit) if window is not None else limit
    right = min(window[1], limit) if window is not None else limit
    if causal:
        right = 0
    return Problem(
        batch=batch,
        heads_q=q.shape[1],  # (batch, heads, seq, dim) and packed (tokens, heads, dim) alike
        heads_kv=k.shape[1],
        seq_q=seq_q,
        seq_k=seq_k,
        head_dim=head_dim,
        scale=1.0 / math.sqrt(head_dim) if scale is None else float(scale),
        window_left=left,
        window_right=right,
        has_left=window is not None,
        has_right=causal or window is not None,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
    )


# --------------------------------------------------------------------------- device code
# Triton kernels keep their argument lists compact, one concern per line, so formatting is off here.
# Strides travel as (batch, head, row, dim) tuples; `band` is (offset, left, right) with
# offset = seq_k - seq_q of the current sequence.
# Lengths, group size, band and a launch's first head and batch are runtime values (no recompile
# per sequence length or grid slice).
_RUNTIME = ("group", "dense_seq_q", "dense_seq_k", "left", "right", "head0", "batch0")
# fmt: off


@triton.jit
def _sequence(CU, b, dense_len, VARLEN: tl.constexpr):
    """Start row and length of sequence b: from cu_seqlens when VARLEN, else (0, dense_len)."""
    if VARLEN:
        start = tl.load(CU + b)
        length = tl.load(CU + b + 1) - start
    else:
        start = 0
        length = dense_len
    return start, length


@triton.jit
def _tile_base(Ptr, strides, b, h, row0):
    """Row row0 of head h in batch b; int64 offsets, as large tensors overflow int32."""
    return (Ptr + b.to(tl.int64) * strides[0] + h.to(tl.int64) * strides[1]
            + tl.cast(row0, tl.int64) * strides[2])


@triton.jit
def _visible(offs_m, offs_n, seq_k, band, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """(queries, keys) mask of the keys each query sees: in range and inside the band."""
    mask = offs_n[None, :] < seq_k
    if HAS_RIGHT:
        mask = mask & (offs_n[None, :] <= offs_m[:, None] + band[0] + band[2])
    if HAS_LEFT:
        mask = mask & (offs_n[None, :] >= offs_m[:, None] + band[0] - band[1])
    return mask


@triton.jit
def _load_rows(base, rows, n_rows, strides, offs_d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
               CHECK_ROWS: tl.constexpr):
    """A (rows, D_PAD) tile, zero outside; bounds are checked only where rows or padding may stray."""
    ptrs = base + rows[:, None] * strides[2] + offs_d[None, :] * strides[3]
    if CHECK_ROWS:
        if HEAD_DIM == D_PAD:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == D_PAD:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _store_rows(base, tile, rows, n_rows, strides, offs_d, HEAD_DIM: tl.constexpr):
    ptrs = base + rows[:, None] * strides[2] + offs_d[None, :] * strides[3]
    mask = (rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _split(lo, full_lo, full_hi, hi, BLOCK: tl.constexpr):
    """Block starts, multiples of BLOCK: [lo, mid_lo) masked, [mid_lo, mid_hi) not, [mid_hi, hi) masked."""
    hi = tl.maximum(hi, 0)
    lo = (lo // BLOCK) * BLOCK
    hi_ceil = ((hi + BLOCK - 1) // BLOCK) * BLOCK
    mid_lo = tl.minimum(tl.maximum(((full_lo + BLOCK - 1) // BLOCK) * BLOCK, lo), hi_ceil)
    mid_hi = tl.maximum((tl.maximum(full_hi, 0) // BLOCK) * BLOCK, mid_lo)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _key_blocks(start_m, seq_q, seq_k, band, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key blocks of query tile start_m. Unmasked: every query of the tile sees all of the block,
    which lies inside seq_k. Blocks no query of the tile sees are skipped."""
    last_row = tl.minimum(start_m + BLOCK_M, seq_q) - 1
    lo = 0
    full_lo = 0
    hi = seq_k
    full_hi = seq_k
    if HAS_RIGHT:
        hi = tl.minimum(hi, last_row + band[0] + band[2] + 1)
        full_hi = tl.minimum(full_hi, start_m + band[0] + band[2] + 1)
    if HAS_LEFT:
        lo = tl.maximum(start_m + band[0] - band[1], 0)
        full_lo = tl.maximum(last_row + band[0] - band[1], 0)
    return _split(lo, full_lo, full_hi, hi, BLOCK_N)


@triton.jit
def _query_blocks(start_n, seq_q, seq_k, band, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query blocks of key tile start_n, split as _key_blocks splits key blocks. Unmasked blocks
    also lie inside seq_q (their loads are unchecked); a partial key tile is masked throughout."""
    lo = 0
    full_lo = 0
    hi = seq_q
    full_hi = (seq_q // BLOCK_M) * BLOCK_M
    if HAS_RIGHT:
        lo = tl.maximum(start_n - band[0] - band[2], 0)
        full_lo = tl.maximum(start_n + BLOCK_N - 1 - band[0] - band[2], 0)
    if HAS_LEFT:
        hi = tl.minimum(hi, start_n + BLOCK_N - band[0] + band[1])
        full_hi = tl.minimum(full_hi, start_n - band[0] + band[1] + 1)
    full_hi = tl.where(start_n + BLOCK_N > seq_k, 0, full_hi)
    return _split(lo, full_lo, full_hi, hi, BLOCK_M)


@triton.jit
def _log2_lse(LSE_row, rows, seq_q, stride):
    """The saved natural-log LSE in the log2 domain; +inf past seq_q and for queries that saw no
    key, so that exp2(s - lse) is 0 there."""
    lse = tl.load(LSE_row + rows * stride, mask=rows < seq_q, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


# ----- forward


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, K_base, V_base, k_strides, v_strides, offs_m, offs_d, lo, hi, seq_k, band,
               qk_scale, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
               MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               PRECISION: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(K_base, offs_n, seq_k, k_strides, offs_d, HEAD_DIM, D_PAD, MASKED)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:  # scale before masking: -inf * 0 would be NaN for a zero scale
            visible = _visible(offs_m, offs_n, seq_k, band, HAS_LEFT, HAS_RIGHT)
            s = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: p = 0, not NaN
            p = tl.math.exp2(s - m_use[:, None])
        else:  # qk_scale >= 0 (a negative scale moved onto q), so the scaled row max is the max of
            # the scaled row, and p is one fused multiply-add per score
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(V_base, offs_n, seq_k, v_strides, offs_d, HEAD_DIM, D_PAD, MASKED)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _zero_rows(Ptr, strides, b, h, first, n_rows, program, programs,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Rows [first, first + n_rows) of head h set to 0, shared out over `programs` programs (this
    one is number `program`) in blocks of BLOCK rows; int64 rows, as a packed tail is not bounded
    by max_seqlen."""
    base = _tile_base(Ptr, strides, b, h, first)
    offs_d = tl.arange(0, D_PAD)
    zeros = tl.zeros([BLOCK, D_PAD], tl.float32)
    for start in range(program * BLOCK, n_rows, programs * BLOCK):
        _store_rows(base, zeros, tl.arange(0, BLOCK).to(tl.int64) + start, n_rows, strides, offs_d, HEAD_DIM)


@triton.jit
def _fill_unowned_rows(Out, LSE, CU_Q, o_strides, lse_strides, b, h, program, programs, n_batch, total_q,
                       HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Packed rows after the last sequence belong to none: output 0, lse -inf, for head h. The
    `programs` programs of the first sequence that serve head h share them out (this one is number
    `program`), so the outputs need no fill launches before the kernel (two of a decoding step's
    four launches)."""
    first = tl.load(CU_Q + n_batch)
    n_rows = total_q - first
    _zero_rows(Out, o_strides, b, h, first, n_rows, program, programs, HEAD_DIM, D_PAD, BLOCK_M)
    L_base = _tile_base(LSE, lse_strides, b, h, first)
    no_keys = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for start in range(program * BLOCK_M, n_rows, programs * BLOCK_M):
        rows = tl.arange(0, BLOCK_M).to(tl.int64) + start
        tl.store(L_base + rows * lse_strides[2], no_keys, mask=rows < n_rows)


@triton.jit(do_not_specialize=(*_RUNTIME, "n_batch", "total_q"))
def _attn_fwd_kernel(Q, K, V, Out, LSE, CU_Q, CU_K,
                     q_strides, k_strides, v_strides, o_strides, lse_strides,
                     group, dense_seq_q, dense_seq_k, q_sign, qk_scale, left, right, head0, batch0,
                     n_batch, total_q, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                     VARLEN: tl.constexpr, REVERSE_M: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    if REVERSE_M:  # causal: the longest query tiles first, so short ones fill the tail of the wave
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1) + head0  # a launch takes at most MAX_GRID_YZ heads and batches (`_grid_slices`)
    b = tl.program_id(2) + batch0
    q_start, seq_q = _sequence(CU_Q, b, dense_seq_q, VARLEN)
    k_start, seq_k = _sequence(CU_K, b, dense_seq_k, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m < seq_q:
        hk = h // group
        band = (seq_k - seq_q, left, right)
        K_base = _tile_base(K, k_strides, b, hk, k_start)
        V_base = _tile_base(V, v_strides, b, hk, k_start)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        Q_base = _tile_base(Q, q_strides, b, h, q_start)
        q = _load_rows(Q_base, offs_m, seq_q, q_strides, offs_d, HEAD_DIM, D_PAD, True)
        q = (q * q_sign).to(Q.dtype.element_ty)  # exact: the sign of the scale moves onto q
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        lo, mid_lo, mid_hi, hi = _key_blocks(start_m, seq_q, seq_k, band, BLOCK_M, BLOCK_N,
                                             HAS_LEFT, HAS_RIGHT)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_base, V_base, k_strides, v_strides, offs_m, offs_d,
                                   lo, mid_lo, seq_k, band, qk_scale,
                                   BLOCK_N, HEAD_DIM, D_PAD, True, HAS_LEFT, HAS_RIGHT, PRECISION)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_base, V_base, k_strides, v_strides, offs_m, offs_d,
                                   mid_lo, mid_hi, seq_k, band, qk_scale,
                                   BLOCK_N, HEAD_DIM, D_PAD, False, HAS_LEFT, HAS_RIGHT, PRECISION)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_base, V_base, k_strides, v_strides, offs_m, offs_d,
                                   mid_hi, hi, seq_k, band, qk_scale,
                                   BLOCK_N, HEAD_DIM, D_PAD, True, HAS_LEFT, HAS_RIGHT, PRECISION)
        empty = l_i == 0.0  # the query saw no key: output 0, lse -inf
        l_safe = tl.where(empty, 1.0, l_i)
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
        O_base = _tile_base(Out, o_strides, b, h, q_start)
        _store_rows(O_base, acc / l_safe[:, None], offs_m, seq_q, o_strides, offs_d, HEAD_DIM)
        lse_row = _tile_base(LSE, lse_strides, b, h, q_start)
        tl.store(lse_row + offs_m * lse_strides[2], lse, mask=offs_m < seq_q)
    if VARLEN:
        if b == 0:
            _fill_unowned_rows(Out, LSE, CU_Q, o_strides, lse_strides, b, h, pid_m, tl.num_programs(0),
                               n_batch, total_q, HEAD_DIM, D_PAD, BLOCK_M)


# ----- backward: dq, with delta = rowsum(dO * O) fused in


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, K_base, V_base, k_strides, v_strides, offs_m, offs_d, lo, hi, seq_k,
              band, qk_scale, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
              MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, PRECISION: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(K_base, offs_n, seq_k, k_strides, offs_d, HEAD_DIM, D_PAD, MASKED)
        v = _load_rows(V_base, offs_n, seq_k, v_strides, offs_d, HEAD_DIM, D_PAD, MASKED)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(_visible(offs_m, offs_n, seq_k, band, HAS_LEFT, HAS_RIGHT), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit(do_not_specialize=(*_RUNTIME, "n_batch", "total_q"))
def _attn_bwd_dq_kernel(Q, K, V, Out, DO, LSE, Delta, DQ, CU_Q, CU_K,
                        q_strides, k_strides, v_strides, o_strides, do_strides, dq_strides, lse_strides,
                        group, dense_seq_q, dense_seq_k, qk_scale, scale, left, right, head0, batch0,
                        n_batch, total_q, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                        VARLEN: tl.constexpr, PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1) + head0  # a launch takes at most MAX_GRID_YZ heads and batches (`_grid_slices`)
    b = tl.program_id(2) + batch0
    q_start, seq_q = _sequence(CU_Q, b, dense_seq_q, VARLEN)
    k_start, seq_k = _sequence(CU_K, b, dense_seq_k, VARLEN)
    if start_m < seq_q:
        hk = h // group
        band = (seq_k - seq_q, left, right)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        Q_base = _tile_base(Q, q_strides, b, h, q_start)
        DO_base = _tile_base(DO, do_strides, b, h, q_start)
        O_base = _tile_base(Out, o_strides, b, h, q_start)
        q = _load_rows(Q_base, offs_m, seq_q, q_strides, offs_d, HEAD_DIM, D_PAD, True)
        do = _load_rows(DO_base, offs_m, seq_q, do_strides, offs_d, HEAD_DIM, D_PAD, True)
        o = _load_rows(O_base, offs_m, seq_q, o_strides, offs_d, HEAD_DIM, D_PAD, True)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(_tile_base(Delta, lse_strides, b, h, q_start) + offs_m * lse_strides[2], delta,
                 mask=offs_m < seq_q)
        lse2 = _log2_lse(_tile_base(LSE, lse_strides, b, h, q_start), offs_m, seq_q, lse_strides[2])
        K_base = _tile_base(K, k_strides, b, hk, k_start)
        V_base = _tile_base(V, v_strides, b, hk, k_start)
        dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        lo, mid_lo, mid_hi, hi = _key_blocks(start_m, seq_q, seq_k, band, BLOCK_M, BLOCK_N,
                                             HAS_LEFT, HAS_RIGHT)
        dq = _dq_tiles(dq, q, do, lse2, delta, K_base, V_base, k_strides, v_strides, offs_m, offs_d,
                       lo, mid_lo, seq_k, band, qk_scale,
                       BLOCK_N, HEAD_DIM, D_PAD, True, HAS_LEFT, HAS_RIGHT, PRECISION)
        dq = _dq_tiles(dq, q, do, lse2, delta, K_base, V_base, k_strides, v_strides, offs_m, offs_d,
                       mid_lo, mid_hi, seq_k, band, qk_scale,
                       BLOCK_N, HEAD_DIM, D_PAD, False, HAS_LEFT, HAS_RIGHT, PRECISION)
        dq = _dq_tiles(dq, q, do, lse2, delta, K_base, V_base, k_strides, v_strides, offs_m, offs_d,
                       mid_hi, hi, seq_k, band, qk_scale,
                       BLOCK_N, HEAD_DIM, D_PAD, True, HAS_LEFT, HAS_RIGHT, PRECISION)
        DQ_base = _tile_base(DQ, dq_strides, b, h, q_start)
        _store_rows(DQ_base, dq * scale, offs_m, seq_q, dq_strides, offs_d, HEAD_DIM)
    if VARLEN:
        if b == 0:  # packed query rows after the last sequence: gradient 0
            first = tl.load(CU_Q + n_batch)
            _zero_rows(DQ, dq_strides, b, h, first, total_q - first, tl.program_id(0), tl.num_programs(0),
                       HEAD_DIM, D_PAD, BLOCK_M)


# ----- backward: dk and dv, summed over the query heads of each kv head


@triton.jit
def _dkdv_tiles(dk, dv, k, v, Q_base, DO_base, LSE_row, Delta_row, q_strides, do_strides, lse_stride,
                offs_n, offs_d, lo, hi, seq_q, seq_k, band, qk_scale,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, PRECISION: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(Q_base, offs_m, seq_q, q_strides, offs_d, HEAD_DIM, D_PAD, MASKED)
        lse2 = _log2_lse(LSE_row, offs_m, seq_q, lse_stride)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse2[None, :])
        if MASKED:
            p_t = tl.where(tl.trans(_visible(offs_m, offs_n, seq_k, band, HAS_LEFT, HAS_RIGHT)), p_t, 0.0)
        do = _load_rows(DO_base, offs_m, seq_q, do_strides, offs_d, HEAD_DIM, D_PAD, MASKED)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        delta = tl.load(Delta_row + offs_m * lse_stride, mask=offs_m < seq_q, other=0.0)
        ds_t = p_t * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=(*_RUNTIME, "n_batch", "total_k"))
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, Delta, DK, DV, CU_Q, CU_K,
                          q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides, lse_strides,
                          group, dense_seq_q, dense_seq_k, qk_scale, scale, left, right, head0, batch0,
                          n_batch, total_k, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
                          HAS_RIGHT: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    hk = tl.program_id(1) + head0  # kv heads, sliced as the other kernels' query heads (`_grid_slices`)
    b = tl.program_id(2) + batch0
    q_start, seq_q = _sequence(CU_Q, b, dense_seq_q, VARLEN)
    k_start, seq_k = _sequence(CU_K, b, dense_seq_k, VARLEN)
    if start_n < seq_k:
        band = (seq_k - seq_q, left, right)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D_PAD)
        K_base = _tile_base(K, k_strides, b, hk, k_start)
        V_base = _tile_base(V, v_strides, b, hk, k_start)
        k = _load_rows(K_base, offs_n, seq_k, k_strides, offs_d, HEAD_DIM, D_PAD, True)
        v = _load_rows(V_base, offs_n, seq_k, v_strides, offs_d, HEAD_DIM, D_PAD, True)
        dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
        dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
        lo, mid_lo, mid_hi, hi = _query_blocks(start_n, seq_q, seq_k, band, BLOCK_M, BLOCK_N,
                                               HAS_LEFT, HAS_RIGHT)
        for g in range(group):
            h = hk * group + g
            Q_base = _tile_base(Q, q_strides, b, h, q_start)
            DO_base = _tile_base(DO, do_strides, b, h, q_start)
            LSE_row = _tile_base(LSE, lse_strides, b, h, q_start)
            Delta_row = _tile_base(Delta, lse_strides, b, h, q_start)
            dk, dv = _dkdv_tiles(dk, dv, k, v, Q_base, DO_base, LSE_row, Delta_row, q_strides, do_strides,
                                 lse_strides[2], offs_n, offs_d, lo, mid_lo, seq_q, seq_k, band, qk_scale,
                                 BLOCK_M, HEAD_DIM, D_PAD, True, HAS_LEFT, HAS_RIGHT, PRECISION)
            dk, dv = _dkdv_tiles(dk, dv, k, v, Q_base, DO_base, LSE_row, Delta_row, q_strides, do_strides,
                                 lse_strides[2], offs_n, offs_d, mid_lo, mid_hi, seq_q, seq_k, band, qk_scale,
                                 BLOCK_M, HEAD_DIM, D_PAD, False, HAS_LEFT, HAS_RIGHT, PRECISION)
            dk, dv = _dkdv_tiles(dk, dv, k, v, Q_base, DO_base, LSE_row, Delta_row, q_strides, do_strides,
                                 lse_strides[2], offs_n, offs_d, mid_hi, hi, seq_q, seq_k, band, qk_scale,
                                 BLOCK_M, HEAD_DIM, D_PAD, True, HAS_LEFT, HAS_RIGHT, PRECISION)
        DK_base = _tile_base(DK, dk_strides, b, hk, k_start)
        DV_base = _tile_base(DV, dv_strides, b, hk, k_start)
        _store_rows(DK_base, dk * scale, offs_n, seq_k, dk_strides, offs_d, HEAD_DIM)
        _store_rows(DV_base, dv, offs_n, seq_k, dv_strides, offs_d, HEAD_DIM)
    if VARLEN:
        if b == 0:  # packed key rows after the last sequence: gradients 0
            first = tl.load(CU_K + n_batch)
            n_rows, program, programs = total_k - first, tl.program_id(0), tl.num_programs(0)
            _zero_rows(DK, dk_strides, b, hk, first, n_rows, program, programs, HEAD_DIM, D_PAD, BLOCK_N)
            _zero_rows(DV, dv_strides, b, hk, first, n_rows, program, programs, HEAD_DIM, D_PAD, BLOCK_N)


# ----- attention_varlen's offsets, checked on the device before the kernels read them


@triton.jit(do_not_specialize=("batch", "total_q", "total_k", "max_q", "max_k"))
def _offsets_ok_kernel(CU_Q, CU_K, OK, batch, total_q, total_k, max_q, max_k, BLOCK: tl.constexpr):
    """One program: OK = 1 when both contiguous offset tensors rise from 0 to at most their token
    count and no sequence is longer than its max_seqlen, else 0; the lengths in blocks of BLOCK."""
    ok = (tl.load(CU_Q) == 0) & (tl.load(CU_K) == 0)
    ok = ok & (tl.load(CU_Q + batch).to(tl.int64) <= total_q)
    ok = ok & (tl.load(CU_K + batch).to(tl.int64) <= total_k)
    for start in range(0, batch, BLOCK):
        b = start + tl.arange(0, BLOCK)
        live = b < batch
        len_q = (tl.load(CU_Q + b + 1, mask=live, other=0).to(tl.int64)
                 - tl.load(CU_Q + b, mask=live, other=0).to(tl.int64))
        len_k = (tl.load(CU_K + b + 1, mask=live, other=0).to(tl.int64)
                 - tl.load(CU_K + b, mask=live, other=0).to(tl.int64))
        bad = (len_q < 0) | (len_q > max_q) | (len_k < 0) | (len_k > max_k)
        ok = ok & (tl.max(bad.to(tl.int32), 0) == 0)
    tl.store(OK, ok.to(tl.int32))


# fmt: on


# --------------------------------------------------------------------------- launchers

MAX_GRID_YZ = 65535  # heads and batch run on grid axes 1 and 2, which CUDA caps at this (`_grid_slices`)


def _strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int, int]:
    """(batch, head, row, dim) strides; packed tensors have no batch stride (rows carry it)."""
    if varlen:
        rows, heads, dim = t.stride()
        return 0, heads, rows, dim
    b, h, s, d = t.stride()
    return b, h, s, d


def _row_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """LSE/delta strides: dense (batch, heads, seq); packed (heads, tokens)."""
    if varlen:
        heads, rows = lse.stride()
        return 0, heads, rows
    b, h, s = lse.stride()
    return b, h, s


def _grid_slices(heads: int, batch: int) -> list[tuple[int, int, int, int]]:
    """(first head, heads, first batch, batches) of each launch: at most MAX_GRID_YZ of each (grid
    axes 1 and 2). The kernels add the firsts to their program ids, so a query head keeps its kv
    head (h // group) whichever slice it lands in. More batches (axial attention folds image rows
    into it; varlen's is its sequence count) or heads used to raise after validation: the call
    fell back, and the kernel was demoted for its signature's later calls."""
    return [
        (h, min(MAX_GRID_YZ, heads - h), b, min(MAX_GRID_YZ, batch - b))
        for h in range(0, heads, MAX_GRID_YZ)
        for b in range(0, batch, MAX_GRID_YZ)
    ]


def _common(problem: Problem, q: torch.Tensor) -> tuple[object, object, dict[str, object]]:
    """cu_seqlens pointers (q itself stands in when dense: the kernel never reads it) and flags."""
    cu_q = problem.cu_seqlens_q if problem.varlen else q
    cu_k = problem.cu_seqlens_k if problem.varlen else q
    flags: dict[str, object] = {
        "HEAD_DIM": problem.head_dim,
        "D_PAD": problem.head_dim_padded,
        "HAS_LEFT": problem.has_left,
        "HAS_RIGHT": problem.has_right,
        "VARLEN": problem.varlen,
        "PRECISION": "ieee" if q.dtype == torch.float32 else None,  # no tf32 behind an fp32 op
    }
    return cu_q, cu_k, flags


def _on_device_of(t: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current device: make it the tensors' one (torch >= 2.8 has a
    vendor-neutral way; older torch keeps the caller's current device, as set_device sets it)."""
    choose = getattr(torch.accelerator, "device_index", None) if hasattr(torch, "accelerator") else None
    if t.device.index is None or choose is None:
        return contextlib.nullcontext()
    return choose(t.device.index)  # type: ignore[no-any-return]


OFFSETS_BLOCK = 1024  # sequences per step of the offsets check's loop


def offsets_ok(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    total_q: int,
    total_k: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> torch.Tensor:
    """attention_varlen's offset rule as a one-element int32 flag (1: valid), computed on their
    device by one launch, without reading them back. Both have batch + 1 contiguous entries."""
    ok = torch.empty(1, dtype=torch.int32, device=cu_seqlens_q.device)
    with _on_device_of(cu_seqlens_q):
        _offsets_ok_kernel[(1,)](
            cu_seqlens_q, cu_seqlens_k, ok, cu_seqlens_q.shape[0] - 1, total_q, total_k, max_seqlen_q,
            max_seqlen_k, BLOCK=OFFSETS_BLOCK,
        )  # fmt: skip
    return ok


def dense_problem(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    window: Sequence[int] | None = None,
) -> Problem:
    """attention's problem from q, k and its arguments after v."""
    band = None if window is None else (int(window[0]), int(window[1]))
    return make_problem(
        q, k, seq_q=q.shape[2], seq_k=k.shape[2], batch=q.shape[0], causal=causal, scale=scale, window=band
    )


def packed_problem(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    scale: float | None = None,
) -> Problem:
    """attention_varlen's problem from q, k and its arguments after v, once `check_offsets` has
    queued the check of the offset rule the kernels trust (their grid covers max_seqlen rows per
    sequence): two launches, no sync, once per offset tensors. The kernels read sequence b's
    offsets at `CU + b`, so strided offsets (a column of a table, `cu[::2]`) are copied
    contiguous: batch + 1 integers, no sync."""
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    check_offsets(
        op, q, k, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
        lambda: offsets_ok(cu_q, cu_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k),
    )  # fmt: skip
    return make_problem(
        q, k, seq_q=max_seqlen_q, seq_k=max_seqlen_k, batch=cu_q.shape[0] - 1, causal=causal, scale=scale,
        window=None, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
    )  # fmt: skip


def forward_outputs(q: torch.Tensor, problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward's (out, lse), allocated unfilled: its kernels write every row (the packed rows
    after the last sequence too). Packed without sequences nothing is launched: 0 and -inf."""
    lse_shape = (problem.heads_q, q.shape[0]) if problem.varlen else q.shape[:-1]
    if problem.varlen and problem.batch == 0:
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        return out, torch.full(lse_shape, float("-inf"), device=q.device, dtype=torch.float32)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return out, torch.empty(lse_shape, device=q.device, dtype=torch.float32)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: Problem, configs: LaunchConfigs
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse), contiguous. Packed tokens outside every sequence read 0, lse -inf: the kernel
    writes them (`_fill_unowned_rows`), except without sequences, where nothing is launched."""
    varlen = problem.varlen
    out, lse = forward_outputs(q, problem)
    full_width = cdiv(problem.seq_q, configs.forward.block_m) * problem.heads_q * problem.batch
    tile = configs.forward_for(full_width)
    cu_q, cu_k, flags = _common(problem, q)
    reverse_m = problem.has_right and not problem.has_left
    with _on_device_of(q):
        for head0, heads, batch0, batches in _grid_slices(problem.heads_q, problem.batch):
            _attn_fwd_kernel[(cdiv(problem.seq_q, tile.block_m), heads, batches)](
                q, k, v, out, lse, cu_q, cu_k,
                _strides(q, varlen), _strides(k, varlen), _strides(v, varlen), _strides(out, varlen),
                _row_strides(lse, varlen),
                problem.heads_q // problem.heads_kv, problem.seq_q, problem.seq_k,
                math.copysign(1.0, problem.scale), abs(problem.scale) * LOG2E,
                problem.window_left, problem.window_right, head0, batch0, problem.batch, q.shape[0],
                BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, REVERSE_M=reverse_m,
                num_warps=tile.num_warps, num_stages=tile.num_stages, **flags,
            )  # fmt: skip
    return out, lse


def backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    problem: Problem,
    configs: LaunchConfigs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), contiguous: the dq kernel (which also writes delta) first, then the dk/dv kernel.
    Their kernels write every row, packed rows after the last sequence too, so the gradients are
    allocated unfilled (packed without sequences nothing is launched: zeros)."""
    varlen = problem.varlen
    lse = lse.contiguous()  # delta shares its strides; a no-op for the LSE the forwards return
    delta = torch.empty_like(lse)
    alloc = torch.zeros if varlen and problem.batch == 0 else torch.empty
    dq, dk, dv = (alloc(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    cu_q, cu_k, flags = _common(problem, q)
    scalars = (
        problem.heads_q // problem.heads_kv, problem.seq_q, problem.seq_k, problem.scale * LOG2E,
        problem.scale, problem.window_left, problem.window_right,
    )  # fmt: skip
    q_s, k_s, v_s, do_s = (_strides(t, varlen) for t in (q, k, v, grad_out))
    lse_s = _row_strides(lse, varlen)
    dq_tile, kv_tile = configs.backward_dq, configs.backward_dkdv
    with _on_device_of(q):
        # every dq launch first: the dk/dv launch of a kv head reads the delta rows of all its query
        # heads, which may lie in several dq launches
        for head0, heads, batch0, batches in _grid_slices(problem.heads_q, problem.batch):
            _attn_bwd_dq_kernel[(cdiv(problem.seq_q, dq_tile.block_m), heads, batches)](
                q, k, v, out, grad_out, lse, delta, dq, cu_q, cu_k,
                q_s, k_s, v_s, _strides(out, varlen), do_s, _strides(dq, varlen), lse_s, *scalars,
                head0, batch0, problem.batch, q.shape[0],
                BLOCK_M=dq_tile.block_m, BLOCK_N=dq_tile.block_n, num_warps=dq_tile.num_warps,
                num_stages=dq_tile.num_stages, **flags,
            )  # fmt: skip
        # at least one key tile: with max_seqlen_k 0 every packed key row is unowned, still written
        key_tiles = max(1, cdiv(problem.seq_k, kv_tile.block_n))
        for head0, heads, batch0, batches in _grid_slices(problem.heads_kv, problem.batch):
            _attn_bwd_dkdv_kernel[(key_tiles, heads, batches)](
                q, k, v, grad_out, lse, delta, dk, dv, cu_q, cu_k,
                q_s, k_s, v_s, do_s, _strides(dk, varlen), _strides(dv, varlen), lse_s, *scalars,
                head0, batch0, problem.batch, k.shape[0],
                BLOCK_M=kv_tile.block_m, BLOCK_N=kv_tile.block_n, num_warps=kv_tile.num_warps,
                num_stages=kv_tile.num_stages, **flags,
            )  # fmt: skip
    return dq, dk, dv
