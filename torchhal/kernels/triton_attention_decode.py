"""Split-KV ("flash-decoding") attention forward in Triton: a few query rows against a long cache.

The FlashAttention forward (`triton_attention_kernels`) gives each (query tile, head, batch) one
program that walks every key. Decoding has one query row per head: a batch of one is 32 programs
on a GPU of 132 compute units, each a serial walk of the whole cache, and every query head of a
GQA group reads its kv head's cache again (an H100 read a 1x32x131072 cache at 313 GB/s, SDPA at
2,983: benchmarks.md, twenty-fifth session). Here one program takes every query row of a kv
head's group (query heads x query length, at most DECODE_MAX_ROWS) as its query tile and one slice
of the keys, so the cache is read once per kv head, by as many programs as the device holds
(`decode_splits`); a second pass merges the slices by their log-sum-exp.

Same rule and numerics as the FlashAttention forward, whose key loop (`_fwd_tiles`) and block
split (`_key_blocks`) it runs per slice: bottom-right causal and sliding windows as one band,
scores in the log2 domain, fp32 accumulation, output 0 and lse -inf for a query that sees no key.
Each slice's partial output is normalised and kept in fp32 with its log2-sum-exp. Dense
(batch, heads, seq, dim) and packed (tokens, heads, dim) layouts with any strides, as the
FlashAttention kernels take them: packed, each sequence reads its own offsets and lengths, the
slices follow max_seqlen_k, and a slice past a sequence's own keys does nothing.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from torchhal.hal_core import InvalidArgumentError
from torchhal.kernels.attention import LOG2E
from torchhal.kernels.triton_attention_config import TileConfig
from torchhal.kernels.triton_attention_kernels import (
    Problem,
    _common,
    _fill_unowned_rows,
    _fwd_tiles,
    _key_blocks,
    _on_device_of,
    _row_strides,
    _sequence,
    _strides,
    _tile_base,
    forward_outputs,
)
from torchhal.kernels.triton_rows import next_power_of_2

COMBINE_SPLITS = 16  # slices the combine pass reads per step

# fmt: off


@triton.jit(do_not_specialize=("group", "seq_q", "seq_k", "heads_kv", "splits", "left", "right",
                               "keys_per_split"))
def _split_kernel(Q, K, V, Part, CU_Q, CU_K, q_strides, k_strides, v_strides,
                  group, seq_q, seq_k, heads_kv, splits, q_sign, qk_scale, left, right, keys_per_split,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                  VARLEN: tl.constexpr, PRECISION: tl.constexpr):
    """One slice of one kv head's keys of sequence b against all its group's query rows: row r is
    query head hk * group + r // seq_q at position r % seq_q (seq_q: max_seqlen_q when VARLEN,
    where a shorter sequence leaves rows empty). Writes the slice's normalised output and
    log2-sum-exp (-inf where its keys are all out of the rows' sight) into `Part`: every slice's
    output rows (D_PAD wide), then every slice's log2-sum-exps."""
    pid = tl.program_id(0)
    split = pid % splits
    hk = (pid // splits) % heads_kv
    b = pid // (splits * heads_kv)
    q_start, len_q = _sequence(CU_Q, b, seq_q, VARLEN)
    k_start, len_k = _sequence(CU_K, b, seq_k, VARLEN)
    n_rows = group * seq_q
    rows = tl.arange(0, BLOCK_M)
    query = rows % seq_q
    heads = hk * group + rows // seq_q
    offs_d = tl.arange(0, D_PAD)
    q_ptrs = (Q + b.to(tl.int64) * q_strides[0] + heads[:, None].to(tl.int64) * q_strides[1]
              + (q_start + query[:, None]).to(tl.int64) * q_strides[2] + offs_d[None, :] * q_strides[3])
    in_sequence = (rows < n_rows) & (query < len_q)
    q = tl.load(q_ptrs, mask=in_sequence[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    q = (q * q_sign).to(Q.dtype.element_ty)  # exact: the sign of the scale moves onto q
    band = (len_k - len_q, left, right)
    K_base = _tile_base(K, k_strides, b, hk, k_start)
    V_base = _tile_base(V, v_strides, b, hk, k_start)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # the group's key blocks (its queries are 0 .. seq_q - 1) from the first one any row sees, cut
    # into the slices' whole tiles: a window's slices cover its band, not the whole cache
    lo, mid_lo, mid_hi, hi = _key_blocks(0, len_q, len_k, band, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    first = lo + split * keys_per_split
    last = tl.where(len_q > 0, first + keys_per_split, first)  # no query row: no key to read
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_base, V_base, k_strides, v_strides, query, offs_d,
                               tl.maximum(lo, first), tl.minimum(mid_lo, last), len_k, band, qk_scale,
                               BLOCK_N, HEAD_DIM, D_PAD, True, HAS_LEFT, HAS_RIGHT, PRECISION)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_base, V_base, k_strides, v_strides, query, offs_d,
                               tl.maximum(mid_lo, first), tl.minimum(mid_hi, last), len_k, band, qk_scale,
                               BLOCK_N, HEAD_DIM, D_PAD, False, HAS_LEFT, HAS_RIGHT, PRECISION)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_base, V_base, k_strides, v_strides, query, offs_d,
                               tl.maximum(mid_hi, first), tl.minimum(hi, last), len_k, band, qk_scale,
                               BLOCK_N, HEAD_DIM, D_PAD, True, HAS_LEFT, HAS_RIGHT, PRECISION)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    part = pid.to(tl.int64) * n_rows + rows  # (b, hk, split) flattened, as pid is, then the row
    keep = rows < n_rows
    L_part = Part + tl.num_programs(0).to(tl.int64) * n_rows * D_PAD
    tl.store(Part + part[:, None] * D_PAD + offs_d[None, :], acc / l_safe[:, None], mask=keep[:, None])
    tl.store(L_part + part, tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe)), mask=keep)


@triton.jit(do_not_specialize=("group", "seq_q", "heads_kv", "splits", "n_batch", "total_q"))
def _combine_kernel(Part, Out, LSE, CU_Q, o_strides, lse_strides, group, seq_q, heads_kv, splits,
                    n_batch, total_q, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
                    VARLEN: tl.constexpr):
    """One query row: its slices weighted by exp2(their log2-sum-exp - the largest); output 0 and
    lse -inf where no slice saw a key. Packed, the first sequence's programs also write the rows
    after the last sequence (`_fill_unowned_rows`)."""
    pid = tl.program_id(0)
    n_rows = group * seq_q
    L_part = Part + (n_batch * heads_kv * splits).to(tl.int64) * n_rows * D_PAD  # as the split pass lays it
    r = pid % n_rows
    hk = (pid // n_rows) % heads_kv
    b = pid // (n_rows * heads_kv)
    head = hk * group + r // seq_q
    query = r % seq_q
    if VARLEN:
        if b == 0:
            _fill_unowned_rows(Out, LSE, CU_Q, o_strides, lse_strides, b, head, query, seq_q, n_batch,
                               total_q, HEAD_DIM, D_PAD, 16)
    q_start, len_q = _sequence(CU_Q, b, seq_q, VARLEN)
    first = ((b * heads_kv + hk).to(tl.int64) * splits) * n_rows + r  # this row in slice 0
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, D_PAD)
    best = tl.full([SPLITS], float("-inf"), tl.float32)
    for s0 in range(0, splits, SPLITS):
        s = s0 + offs_s
        best = tl.maximum(best, tl.load(L_part + first + s * n_rows, mask=s < splits, other=float("-inf")))
    m = tl.max(best, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    weights = tl.zeros([SPLITS], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for s0 in range(0, splits, SPLITS):
        s = s0 + offs_s
        w = tl.math.exp2(tl.load(L_part + first + s * n_rows, mask=s < splits, other=float("-inf")) - m_use)
        o = tl.load(Part + (first + s * n_rows)[:, None] * D_PAD + offs_d[None, :],
                    mask=(s < splits)[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
        weights += w
    total = tl.sum(weights, 0)
    empty = total == 0.0
    total_safe = tl.where(empty, 1.0, total)
    if query < len_q:  # a packed sequence shorter than max_seqlen_q has no such row
        base = _tile_base(Out, o_strides, b, head, q_start + query)
        out = (acc / total_safe).to(Out.dtype.element_ty)
        tl.store(base + offs_d * o_strides[3], out, mask=offs_d < HEAD_DIM)
        lse = tl.where(empty, float("-inf"), (m_use + tl.math.log2(total_safe)) * 0.6931471805599453)
        tl.store(_tile_base(LSE, lse_strides, b, head, q_start + query), lse)


# fmt: on


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: Problem,
    tile: TileConfig,
    splits: int,
    keys_per_split: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of dense or packed attention, contiguous, in `splits` slices of `keys_per_split`
    keys from the first key any query sees (`visible_keys` of them); `tile.block_m` holds every
    query row of a kv head's group. Packed tokens outside every sequence read 0 and lse -inf."""
    if keys_per_split <= 0 or keys_per_split % tile.block_n:  # slices would overlap or read past seq_k
        raise InvalidArgumentError(
            f"attention split-KV: keys_per_split must be a positive multiple of the key tile "
            f"{tile.block_n}, got {keys_per_split}"
        )
    varlen, device, batch = problem.varlen, q.device, problem.batch
    group = problem.heads_q // problem.heads_kv
    rows = group * problem.seq_q
    out, lse = forward_outputs(q, problem)
    if batch == 0:  # packed, no sequence: nothing to launch
        return out, lse
    d_pad = problem.head_dim_padded
    # every slice's fp32 output rows, then their log2-sum-exps: one allocation. The split grid is
    # 1-D, splits x heads_kv x batch programs; both kernels find the log2-sum-exps after that
    # many programs' rows (the split pass from its grid, the combine pass from those three)
    part = torch.empty(splits * split_scratch_bytes(problem) // 4, dtype=torch.float32, device=device)
    cu_q, cu_k, flags = _common(problem, q)
    with _on_device_of(q):
        _split_kernel[(splits * problem.heads_kv * batch,)](
            q, k, v, part, cu_q, cu_k,
            _strides(q, varlen), _strides(k, varlen), _strides(v, varlen),
            group, problem.seq_q, problem.seq_k, problem.heads_kv, splits,
            math.copysign(1.0, problem.scale), abs(problem.scale) * LOG2E,
            problem.window_left, problem.window_right, keys_per_split,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, num_warps=tile.num_warps,
            num_stages=tile.num_stages, **flags,
        )  # fmt: skip
        _combine_kernel[(rows * problem.heads_kv * batch,)](
            part, out, lse, cu_q, _strides(out, varlen), _row_strides(lse, varlen),
            group, problem.seq_q, problem.heads_kv, splits, batch, q.shape[0],
            HEAD_DIM=problem.head_dim, D_PAD=d_pad, SPLITS=COMBINE_SPLITS, VARLEN=varlen, num_warps=1,
        )  # fmt: skip
    return out, lse


def visible_keys(problem: Problem, block_n: int) -> int:
    """How many keys, from the first key tile any query row sees, the slices must cover: the whole
    cache, or under a sliding window its band (`seq_q` rows, `left` keys before the first, `right`
    after the last, and the tile the band's start is rounded down into)."""
    if not problem.has_left:
        return problem.seq_k
    band = problem.seq_q + problem.window_left + problem.window_right + block_n
    return min(problem.seq_k, band)


def keys_read(problem: Problem, k: torch.Tensor, visible: int) -> int:
    """Keys one kv head reads over the whole batch, at most: `visible` per sequence (dense), or
    packed, no more than the packed tokens (sequences of other lengths share them)."""
    if problem.varlen:
        return min(k.shape[0], problem.batch * visible)
    return problem.batch * visible


def split_scratch_bytes(problem: Problem) -> int:
    """Bytes of the split pass's partials per split: every group's fp32 output rows and their
    log2-sum-exps."""
    rows = problem.heads_q // problem.heads_kv * problem.seq_q
    return problem.batch * problem.heads_kv * rows * (problem.head_dim_padded + 1) * 4


def query_tile_rows(heads_q: int, heads_kv: int, seq_q: int) -> int:
    """The split pass's query tile: every row of a kv head's group, a power of two, at least 16
    (tl.dot's smallest)."""
    return max(16, next_power_of_2(heads_q // heads_kv * seq_q))
