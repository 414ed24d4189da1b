"""Triton kernel for rope, forward and backward; imported only when a candidate binds.

One program per (batch, position, head tile): it loads that position's cos and sin rows (both
halves, so cos/sin need not repeat their halves) and rotates its tile of BLOCK_HQ heads of q and
BLOCK_HK heads of k. A tile holds every head unless heads x half the head dim passes
TILE_ELEMENTS; there is no loop over tiles, so q's and k's loads are issued together. Every
tensor is addressed through its strides (a unit stride is specialised by Triton into vector
loads), so q and k may be any view, e.g. (batch, seq, heads, dim) projections transposed to
(batch, heads, seq, dim), and cos/sin broadcast with stride 0.
The backward is the transposed rotation: the same kernel with sin's halves swapped and negated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchhal.kernels.rope import output_like
from torchhal.kernels.triton_rows import ROPE_THREADS, RowLaunch, cdiv, next_power_of_2

TILE_ELEMENTS = 8192  # heads x half-dim elements per half per program


@triton.jit
def _rotate_heads(
    X, OUT, x_sb, x_sh, x_ss, x_sd, o_sb, o_sh, o_ss, b, s, n_heads, half, c1, c2, s1, s2,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)  # this program's head tile
    mask = (h < n_heads)[:, None] & dmask[None, :]
    src = X + b * x_sb + s * x_ss + h[:, None] * x_sh + d[None, :] * x_sd
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half * x_sd, mask=mask, other=0.0).to(tl.float32)
    dst = OUT + b * o_sb + s * o_ss + h[:, None] * o_sh + d[None, :]
    tl.store(dst, (x1 * c1[None, :] - x2 * s1[None, :]).to(OUT.dtype.element_ty), mask=mask)
    tl.store(dst + half, (x2 * c2[None, :] + x1 * s2[None, :]).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope(
    Q, K, COS, SIN, QO, KO,
    q_sb, q_sh, q_ss, q_sd, k_sb, k_sh, k_ss, k_sd,
    qo_sb, qo_sh, qo_ss, ko_sb, ko_sh, ko_ss,
    c_sb, c_ss, c_sd, s_sb, s_ss, s_sd,
    seq_len, n_qh, n_kh, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = (pid // seq_len).to(tl.int64)
    s = (pid % seq_len).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    cos_row = COS + b * c_sb + s * c_ss
    sin_row = SIN + b * s_sb + s * s_ss
    c1 = tl.load(cos_row + d * c_sd, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + (d + half) * c_sd, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + d * s_sd, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + (d + half) * s_sd, mask=dmask, other=0.0).to(tl.float32)
    if BACKWARD:  # x1' = x1*c1 + x2*s2, x2' = x2*c2 - x1*s1
        first = -s2
        s2 = -s1
        s1 = first
    _rotate_heads(
        Q,
        QO,
        q_sb,
        q_sh,
        q_ss,
        q_sd,
        qo_sb,
        qo_sh,
        qo_ss,
        b,
        s,
        n_qh,
        half,
        c1,
        c2,
        s1,
        s2,
        BLOCK_HQ,
        BLOCK_D,
    )
    _rotate_heads(
        K,
        KO,
        k_sb,
        k_sh,
        k_ss,
        k_sd,
        ko_sb,
        ko_sh,
        ko_ss,
        b,
        s,
        n_kh,
        half,
        c1,
        c2,
        s1,
        s2,
        BLOCK_HK,
        BLOCK_D,
    )


def rope(
    launch: RowLaunch,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (or, with `backward`, their output gradients) by the angles in cos/sin."""
    batch, n_qh, seq, dim = q.shape
    n_kh = k.shape[1]
    qo, ko = output_like(q), output_like(k)  # unit stride along dim, as the stores assume
    if batch * seq * dim == 0:
        return qo, ko
    cos4, sin4 = cos.expand(batch, 1, seq, dim), sin.expand(batch, 1, seq, dim)
    half = dim // 2
    block_d = next_power_of_2(half)
    block_hq, block_hk = (min(next_power_of_2(h), max(1, TILE_ELEMENTS // block_d)) for h in (n_qh, n_kh))
    head_tiles = max(cdiv(n_qh, block_hq), cdiv(n_kh, block_hk))
    _rope[(batch * seq, head_tiles)](
        q, k, cos4, sin4, qo, ko,
        q.stride(0), q.stride(1), q.stride(2), q.stride(3),
        k.stride(0), k.stride(1), k.stride(2), k.stride(3),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        cos4.stride(0), cos4.stride(2), cos4.stride(3), sin4.stride(0), sin4.stride(2), sin4.stride(3),
        seq, n_qh, n_kh, half,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d, BACKWARD=backward,
        num_warps=launch.warps(2 * block_hq * block_d, q.element_size(), most_threads=ROPE_THREADS),
    )  # fmt: skip
    return qo, ko


def rope_backward(
    launch: RowLaunch, dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope(launch, dq_out, dk_out, cos, sin, backward=True)
