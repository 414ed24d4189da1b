"""attention's split-KV (flash-decoding) Triton candidate, `triton_decode`: the kernel on the CPU
interpreter (fp32) against the fp64 reference under FlashAttention's rule, with the keys cut in
one slice, several, and slices no query sees; through the registry (forward, and gradients through
the FlashAttention backward from its LSE); where it applies; and its split count."""

from __future__ import annotations

import math

import pytest
import torch

import torchhal.ops
from tests.core.adapters import fake_caps
from torchhal.hal_core import RejectionReason
from torchhal.kernels import attention
from torchhal.kernels.triton_attention_config import (
    DECODE_MAX_ROWS,
    DECODE_MAX_SPLITS,
    decode_splits,
)

from .conftest import assert_out_and_lse_within_pytorch_error, assert_within_pytorch_error, new_memory_as_nan


def _qkv(batch, heads_q, heads_kv, seq_q, seq_k, dim, layout="contiguous"):
    def make(heads, seq):
        if layout == "bshd":  # (batch, seq, heads, dim) memory, as a projection's output reshaped
            return torch.randn(batch, seq, heads, dim).transpose(1, 2)
        return torch.randn(batch, heads, seq, dim)

    return make(heads_q, seq_q), make(heads_kv, seq_k), make(heads_kv, seq_k)


CASES = [  # (batch, heads_q, heads_kv, seq_q, seq_k, dim, causal, scale, window, layout)
    pytest.param(2, 4, 2, 1, 203, 32, False, None, None, "contiguous", id="gqa-one-row-d32"),
    pytest.param(1, 8, 1, 1, 130, 64, True, None, None, "bshd", id="mqa-one-row-causal-bshd"),
    pytest.param(1, 2, 2, 5, 97, 24, True, -0.5, None, "contiguous", id="mha-5-rows-d24-negative-scale"),
    pytest.param(2, 6, 3, 4, 150, 40, True, None, (33, 0), "bshd", id="sliding-window-33"),
    pytest.param(1, 4, 2, 3, 77, 16, False, 0.3, (10, 6), "contiguous", id="window-both-sides"),
    pytest.param(1, 2, 1, 9, 6, 16, True, None, None, "contiguous", id="more-rows-than-keys"),
    # more slices than the combine pass reads per step (COMBINE_SPLITS): 22 key tiles
    pytest.param(1, 4, 2, 2, 700, 16, True, None, None, "contiguous", id="more-slices-than-one-combine-step"),
    # slices from the band's first tile, far from the cache's start
    pytest.param(1, 4, 1, 1, 700, 16, False, None, (100, 0), "bshd", id="window-at-the-end-of-the-cache"),
]
FIELDS = ("batch", "heads_q", "heads_kv", "seq_q", "seq_k", "dim", "causal", "scale", "window", "layout")


def _forward(caps, q, k, v, causal, scale, window, splits):
    """The kernel called with `splits` slices (the bound candidate sizes them from the device)."""
    from torchhal.kernels import triton_attention_decode as decode
    from torchhal.kernels.triton_attention_config import decode_tile
    from torchhal.kernels.triton_attention_kernels import make_problem

    problem = make_problem(
        q, k, seq_q=q.shape[2], seq_k=k.shape[2], batch=q.shape[0], causal=causal, scale=scale, window=window
    )
    rows = decode.query_tile_rows(q.shape[1], k.shape[1], q.shape[2])
    tile = decode_tile(caps, problem.head_dim_padded, q.element_size(), rows)
    keys = decode.visible_keys(problem, tile.block_n)
    tiles = math.ceil(keys / tile.block_n)
    per_split = math.ceil(tiles / splits) * tile.block_n
    return decode.forward(q, k, v, problem, tile, math.ceil(keys / per_split), per_split)


@pytest.mark.parametrize("splits", [1, 3, 64], ids=["one-slice", "three-slices", "a-slice-per-tile"])
@pytest.mark.parametrize(FIELDS, CASES)
def test_kernel_within_pytorch_error(
    triton_hal, splits, batch, heads_q, heads_kv, seq_q, seq_k, dim, causal, scale, window, layout
):
    """Output and LSE against fp64 under FlashAttention's rule, however the keys are sliced: a
    window leaves whole slices unseen (their partials are empty), more query rows than keys leave
    the first queries with no key at all (output 0, lse -inf)."""
    q, k, v = _qkv(batch, heads_q, heads_kv, seq_q, seq_k, dim, layout)
    args = (causal, scale, window)
    out, lse = _forward(triton_hal.device("cpu").capabilities, q, k, v, *args, splits)
    assert_out_and_lse_within_pytorch_error(out, lse, attention.reference_forward, (q, k, v), args)


@pytest.mark.parametrize(FIELDS, CASES[:4])
def test_selected_for_decoding_with_gradients_through_its_lse(
    triton_hal,
    on_triton,
    check_op,
    batch,
    heads_q,
    heads_kv,
    seq_q,
    seq_k,
    dim,
    causal,
    scale,
    window,
    layout,
):
    """Where selection does not measure (the CPU), the split-KV candidate is preferred for a few
    query rows per kv head; a training step's backward (the FlashAttention kernels) takes its LSE."""
    q, k, v = _qkv(batch, heads_q, heads_kv, seq_q, seq_k, dim, layout)
    args = (q, k, v, causal, scale, window)

    def op(q, k, v, causal, scale, window):
        return torchhal.ops.attention(q, k, v, causal=causal, scale=scale, window=window)

    check_op(op, attention.reference, args, (torch.randn_like(q),), (0, 1, 2))
    assert set(on_triton) == {("attention_forward", "triton_decode"), ("attention_backward", "triton")}
    with torch.no_grad():
        out = op(*args)
    assert on_triton[-1] == ("attention", "triton_decode")
    truth = attention.reference(q.double(), k.double(), v.double(), causal, scale, window)
    assert_within_pytorch_error("no-grad output", out, attention.reference(*args), truth, 2.0)


def test_not_offered_past_its_query_tile(triton_hal):
    """Query heads per kv head x query length above DECODE_MAX_ROWS is a prefill: the FlashAttention
    kernel's, and the decode candidate says why it stepped aside."""
    q, k, v = _qkv(1, 4, 1, DECODE_MAX_ROWS // 4 + 1, 100, 16)
    selection = triton_hal.kernels.select("attention", triton_hal.device("cpu"), q, k, v)
    assert selection.candidate.name == "triton"
    (rejection,) = [r for r in selection.rejected if r.candidate == "torchhal/triton_decode"]
    assert rejection.reason is RejectionReason.SHAPE
    assert f"above {DECODE_MAX_ROWS}, got up to 128" in rejection.detail
    at_limit = _qkv(1, 4, 1, DECODE_MAX_ROWS // 4, 100, 16)
    assert triton_hal.kernels.select("attention", triton_hal.device("cpu"), *at_limit).candidate.name == (
        "triton_decode"
    )


@pytest.mark.parametrize(
    ("units", "work_keys", "seq_k", "expected"),
    [
        (132, 8 * 131072, 131072, (17, 8000)),  # batch 1, 8 kv heads: 132 programs' worth, 17 slices
        (132, 64 * 32768, 32768, (3, 15936)),  # batch 8: two slices of a 132th of the work, and a tail
        (132, 256 * 16384, 16384, (1, 16384)),  # more groups than compute units: one slice
        (132, 8 * 130560, 65536, (9, 7936)),  # packed, 130,560 keys in all, the longest 65,536
        (132, 8 * 100, 100, (2, 64)),  # never shorter than one tile: 2 tiles, 2 slices
        (1000, 10**7, 10**7, (DECODE_MAX_SPLITS, 39104)),  # at most DECODE_MAX_SPLITS
    ],
)
def test_slices_share_the_work_over_the_device(units, work_keys, seq_k, expected):
    """Slices of about work_keys / (DECODE_PROGRAMS_PER_UNIT x compute units) keys, in whole key
    tiles, every slice with keys."""
    splits, keys = decode_splits(fake_caps(compute_units=units), work_keys, seq_k, 64)
    assert (splits, keys) == expected
    assert keys % 64 == 0 and (splits - 1) * keys < seq_k <= splits * keys


def test_keys_read_counts_packed_tokens_once():
    """The work the slices share: every sequence's visible keys, dense; packed, no more than the
    packed tokens (a batch of short caches is not max_seqlen_k keys each)."""
    from torchhal.kernels import triton_attention_decode as decode
    from torchhal.kernels.triton_attention_kernels import make_problem

    q, k, _ = _qkv(3, 4, 2, 1, 50, 16)
    dense = make_problem(q, k, seq_q=1, seq_k=50, batch=3, causal=True, scale=None, window=None)
    assert decode.keys_read(dense, k, 50) == 150
    q_packed, k_packed = torch.randn(3, 4, 16), torch.randn(70, 2, 16)
    cu_q, cu_k = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 10, 60, 70])
    packed = make_problem(
        q_packed, k_packed, seq_q=1, seq_k=50, batch=3, causal=True, scale=None, window=None,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
    )  # fmt: skip
    assert decode.keys_read(packed, k_packed, 50) == 70
    assert decode.keys_read(packed, k_packed, 20) == 60  # a window's band: at most 20 a sequence


def test_the_decode_signature_tells_decoding_from_prefill():
    """One cache length, one query row against all of them: the selection cache must not hand a
    prefill's winner to a decoding step (they share seq_bucket)."""
    q1, k, v = _qkv(1, 8, 2, 1, 4096, 16)
    q_long = torch.randn(1, 8, 4096, 16)
    decode_sig = attention.signature(q1, k, v)
    prefill_sig = attention.signature(q_long, k, v)
    assert decode_sig.seq_bucket == prefill_sig.seq_bucket
    assert decode_sig != prefill_sig
    assert (decode_sig.group_rows_bucket, prefill_sig.group_rows_bucket) == (2, 14)


def test_slices_must_be_whole_key_tiles(triton_hal):
    """Slices of another length overlapped and read past the cache (errors of 1e24 in the lse)."""
    from torchhal.hal_core import InvalidArgumentError
    from torchhal.kernels import triton_attention_decode as decode
    from torchhal.kernels.triton_attention_config import decode_tile
    from torchhal.kernels.triton_attention_kernels import make_problem

    q, k, v = _qkv(1, 2, 1, 1, 100, 16)
    problem = make_problem(q, k, seq_q=1, seq_k=100, batch=1, causal=False, scale=None, window=None)
    tile = decode_tile(triton_hal.device("cpu").capabilities, 16, 4, 16)
    with pytest.raises(InvalidArgumentError, match=f"multiple of the key tile {tile.block_n}, got 40"):
        decode.forward(q, k, v, problem, tile, 3, 40)


@pytest.mark.parametrize(
    ("seq_q", "seq_k", "causal", "window", "expected"),
    [
        (1, 32768, True, None, 32768),  # causal: the whole cache
        (1, 32768, True, (4096, 0), 1 + 4096 + 0 + 64),  # a window: its band and the rounding tile
        (3, 32768, False, (100, 20), 3 + 100 + 20 + 64),
        (1, 300, True, (4096, 0), 300),  # never more than the cache
    ],
)
def test_slices_cover_the_band_a_window_leaves(seq_q, seq_k, causal, window, expected):
    """Sized over the whole cache, a 4k window over 32k keys left 7 of 8 slices idle."""
    from torchhal.kernels import triton_attention_decode as decode
    from torchhal.kernels.triton_attention_kernels import make_problem

    q, k = torch.empty(1, 8, seq_q, 64), torch.empty(1, 2, seq_k, 64)
    problem = make_problem(q, k, seq_q=seq_q, seq_k=seq_k, batch=1, causal=causal, scale=None, window=window)
    assert decode.visible_keys(problem, 64) == expected


def test_the_tile_fits_a_small_shared_memory():
    """64 fp32 rows at head dim 256 beside one stage of keys: on a 64 KB device the key tile
    halves as far as it goes, and the accumulator takes 8 warps, not 4."""
    from torchhal.kernels.triton_attention_config import decode_tile

    tile = decode_tile(fake_caps(shared_memory_per_block_bytes=64 * 1024, simd_width=32), 256, 4, 64)
    assert (tile.block_n, tile.num_warps, tile.num_stages) == (16, 8, 1)
    roomy = decode_tile(fake_caps(shared_memory_per_block_bytes=228 * 1024, simd_width=32), 128, 2, 16)
    assert (roomy.block_n, roomy.num_warps, roomy.num_stages) == (64, 4, 3)


def _packed(lens_q, lens_k, heads_q, heads_kv, dim, spare_q):
    """Packed q, k, v and int32 offsets, with `spare_q` query tokens after the last sequence."""

    def offsets(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    q = torch.randn(sum(lens_q) + spare_q, heads_q, dim)
    k, v = (torch.randn(sum(lens_k), heads_kv, dim) for _ in range(2))
    return q, k, v, offsets(lens_q), offsets(lens_k)


VARLEN_CASES = [  # lengths of q and k per sequence, heads, dim, causal, tokens after the last sequence
    pytest.param([1, 1, 1, 1], [300, 0, 57, 129], 8, 2, 32, True, 5, id="decoding-steps-one-empty-cache"),
    pytest.param([3, 0, 2], [200, 90, 1], 4, 1, 24, True, 40, id="chunks-an-empty-query-more-rows-than-keys"),
    pytest.param([2, 4], [700, 33], 2, 2, 16, False, 0, id="more-slices-than-one-combine-step"),
]


@pytest.mark.parametrize("splits", [1, 4, 64], ids=["one-slice", "four-slices", "a-slice-per-tile"])
@pytest.mark.parametrize(("lens_q", "lens_k", "heads_q", "heads_kv", "dim", "causal", "spare"), VARLEN_CASES)
def test_packed_kernel_within_pytorch_error(
    triton_hal, splits, lens_q, lens_k, heads_q, heads_kv, dim, causal, spare
):
    """Packed sequences, each with its own query and key lengths, sliced by max_seqlen_k: output
    and LSE per sequence against fp64 under the rule, tokens after the last sequence 0 and -inf
    (new memory is NaN under deterministic algorithms, so a row left unwritten shows)."""
    from torchhal.kernels import attention_varlen
    from torchhal.kernels import triton_attention_decode as decode
    from torchhal.kernels.triton_attention_config import decode_tile
    from torchhal.kernels.triton_attention_kernels import make_problem

    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, heads_q, heads_kv, dim, spare)
    fixed = (cu_q, cu_k, max(lens_q), max(lens_k), causal, None)
    problem = make_problem(
        q, k, seq_q=max(lens_q), seq_k=max(lens_k), batch=len(lens_q), causal=causal, scale=None,
        window=None, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
    )  # fmt: skip
    rows = decode.query_tile_rows(heads_q, heads_kv, max(lens_q))
    tile = decode_tile(triton_hal.device("cpu").capabilities, problem.head_dim_padded, 4, rows)
    per_split = math.ceil(math.ceil(max(lens_k) / tile.block_n) / splits) * tile.block_n
    with new_memory_as_nan():
        out, lse = decode.forward(q, k, v, problem, tile, math.ceil(max(lens_k) / per_split), per_split)
    assert_out_and_lse_within_pytorch_error(out, lse, attention_varlen.reference_forward, (q, k, v), fixed)


@pytest.mark.parametrize(
    ("lens_q", "lens_k", "heads_q", "heads_kv", "dim", "causal", "spare"), VARLEN_CASES[:2]
)
def test_packed_decoding_selected_with_gradients(
    triton_hal, on_triton, check_op, lens_q, lens_k, heads_q, heads_kv, dim, causal, spare
):
    """torchhal.ops.attention_varlen on the split-KV forward where few rows per kv head, the
    FlashAttention varlen backward from its LSE; and the no-gradient op on it too."""
    from torchhal.kernels import attention_varlen

    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, heads_q, heads_kv, dim, spare)
    fixed = (cu_q, cu_k, max(lens_q), max(lens_k))

    def op(q, k, v):
        return torchhal.ops.attention_varlen(q, k, v, *fixed, causal=causal)

    check_op(
        op,
        lambda q, k, v: attention_varlen.reference(q, k, v, *fixed, causal),
        (q, k, v),
        (torch.randn_like(q),),
        (0, 1, 2),
    )
    assert set(on_triton) == {
        ("attention_varlen_forward", "triton_decode"),
        ("attention_varlen_backward", "triton"),
    }
    with torch.no_grad():
        out = op(q, k, v)
    assert on_triton[-1] == ("attention_varlen", "triton_decode")
    truth = attention_varlen.reference(q.double(), k.double(), v.double(), *fixed, causal)
    assert_within_pytorch_error(
        "no-grad output", out, attention_varlen.reference(q, k, v, *fixed, causal), truth, 2.0
    )


def test_no_sequences_give_zeros_and_a_float32_lse(triton_hal, candidate):
    """Offsets of one entry (no sequence): nothing is launched; every token reads 0 and lse -inf,
    in float32 whatever torch's default dtype (the lse was made in the default dtype)."""
    q, k, v = torch.randn(3, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    cu = torch.zeros(1, dtype=torch.int32)
    args = (q, k, v, cu, cu, 1, 1, False, None)
    forward = candidate(triton_hal, "attention_varlen_forward", "triton_decode", *args)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out, lse = forward(*args)
    finally:
        torch.set_default_dtype(default)
    assert lse.dtype == torch.float32 and lse.shape == (4, 3) and torch.isneginf(lse).all()
    assert out.dtype == q.dtype and torch.count_nonzero(out) == 0


def test_packed_short_sequences_under_a_large_max_seqlen_k_get_bounded_partials(triton_hal, monkeypatch):
    """max_seqlen_k may exceed every sequence (a graph-captured decoder passes its cache's
    capacity): the slices were sized by it, and 256 short sequences at 131072 took 256 splits and
    1 GiB of partials for 16 MiB of keys and values. The partials stay within
    DECODE_SCRATCH_PER_KV times the keys and values, and the answer is unchanged."""
    from torchhal.kernels import attention_varlen, triton_attention
    from torchhal.kernels.triton_attention_config import DECODE_SCRATCH_PER_KV

    caps = triton_hal.device("cpu").capabilities.model_copy(update={"compute_units": 132})
    forward = triton_attention.bind_decode_varlen_forward(caps)
    q, k, v, cu_q, cu_k = _packed([1] * 8, [4] * 8, 4, 1, 16, 0)
    made: list[int] = []
    empty = torch.empty

    def recording_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        made.append(t.numel() * t.element_size())
        return t

    outputs = []
    for max_k in (4, 1 << 14):
        made.clear()
        monkeypatch.setattr(torch, "empty", recording_empty)
        outputs.append(forward(q, k, v, cu_q, cu_k, 1, max_k, True, None))
        monkeypatch.setattr(torch, "empty", empty)
        assert max(made) <= DECODE_SCRATCH_PER_KV * (k.numel() + v.numel()) * 4, (max_k, made)
    reference = attention_varlen.reference_forward(q, k, v, cu_q, cu_k, 1, 4, True, None)
    for out, lse in outputs:
        assert_out_and_lse_within_pytorch_error(
            out, lse, attention_varlen.reference_forward, (q, k, v), (cu_q, cu_k, 1, 4, True, None)
        )
    torch.testing.assert_close(outputs[1][0], reference[0])
