"""rope: the Triton forward and backward (CPU interpreter, fp32) against the fp64 reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchhal.hal_core import InvalidArgumentError, UnsupportedError
from torchhal.kernels import rope


def _tables(
    batch: int, seq: int, dim: int, *, shared_halves: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (batch, 1, seq, dim); HF repeats the angles in both halves, others need not."""
    positions = torch.arange(seq) + torch.randint(0, 1000, (batch, 1))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim)
    angles = positions.unsqueeze(-1) * inv_freq
    second = angles if shared_halves else angles + torch.rand_like(angles)
    emb = torch.cat((angles, second), dim=-1).unsqueeze(1)
    return emb.cos(), emb.sin()


def _check(ops, check_op, q, k, cos, sin):
    cpu = ops.hal.device("cpu")
    assert ops.hal.kernels.select("rope", cpu, q, k, cos, sin).candidate.name == "triton"
    assert ops.hal.kernels.select("rope_backward", cpu, q, k, cos, sin).candidate.name == "triton"
    grads = (torch.randn(q.shape), torch.randn(k.shape))
    check_op(ops.rope, rope.reference, (q, k, cos, sin), grads, (0, 1))


@pytest.mark.parametrize(
    ("batch", "heads_q", "heads_k", "seq", "dim"), [(2, 4, 2, 13, 64), (1, 6, 1, 7, 80), (3, 3, 3, 5, 6)]
)
def test_triton_forward_and_gradients_within_pytorch_error(ops, check_op, batch, heads_q, heads_k, seq, dim):
    q, k = torch.randn(batch, heads_q, seq, dim), torch.randn(batch, heads_k, seq, dim)
    _check(ops, check_op, q, k, *_tables(batch, seq, dim))


def test_heads_split_over_several_tiles(ops, check_op, monkeypatch):
    """More heads than one tile holds: q's 7 heads in tiles of 2, k's 3 in tiles of 2 (its last
    tiles empty), one program per (position, tile)."""
    from torchhal.kernels import triton_rope

    monkeypatch.setattr(triton_rope, "TILE_ELEMENTS", 2 * 16)
    q, k = torch.randn(2, 7, 5, 32), torch.randn(2, 3, 5, 32)
    _check(ops, check_op, q, k, *_tables(2, 5, 32))


def test_transposed_projections_and_distinct_halves(ops, check_op):
    """q and k as (batch, seq, heads, dim) projections viewed as (batch, heads, seq, dim); cos/sin
    whose halves differ, shared across the batch as a (seq, dim) table in fp32 with fp32 q."""
    q = torch.randn(2, 9, 4, 32).transpose(1, 2)
    k = torch.randn(2, 9, 2, 32).transpose(1, 2)
    cos, sin = _tables(1, 9, 32, shared_halves=False)
    _check(ops, check_op, q, k, cos[0, 0], sin[0, 0])


@pytest.mark.parametrize("path", ["triton", "reference", "compiled"])
def test_outputs_keep_the_projections_memory_layout(ops, plain_ops, path):
    """Projections viewed (batch, heads, seq, dim) come back laid out as they went in (what eager's
    element-wise rope gives), values as the reference's; a contiguous q stays contiguous."""
    q = torch.randn(2, 9, 4, 32).transpose(1, 2)
    k = torch.randn(2, 2, 9, 32)
    cos, sin = _tables(2, 9, 32)
    fn = {"triton": ops.rope, "reference": plain_ops.rope, "compiled": torch.compile(plain_ops.rope)}[path]
    got_q, got_k = fn(q, k, cos, sin)
    want_q, want_k = rope.reference(q.double(), k.double(), cos.double(), sin.double())
    assert got_q.stride() == q.stride() and got_k.stride() == k.stride(), (got_q.stride(), got_k.stride())
    torch.testing.assert_close(got_q, want_q.float())
    torch.testing.assert_close(got_k, want_k.float())


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.integers(1, 2),
    heads=st.tuples(st.integers(1, 5), st.integers(1, 3)),
    seq=st.integers(1, 9),
    half=st.integers(1, 20),
    table_rank=st.sampled_from([2, 3, 4]),
    permute=st.booleans(),
)
def test_shapes_and_strides_property(ops, check_op, batch, heads, seq, half, table_rank, permute):
    dim = 2 * half
    q = (
        torch.randn(batch, seq, heads[0], dim).transpose(1, 2)
        if permute
        else torch.randn(batch, heads[0], seq, dim)
    )
    k = torch.randn(batch, heads[1], seq, dim)
    cos, sin = _tables(batch if table_rank == 4 else 1, seq, dim)
    shape = cos.shape[4 - table_rank :]
    _check(ops, check_op, q, k, cos.reshape(shape), sin.reshape(shape))


def _qk(q_shape, k_shape=None, dtype=torch.float32):
    return torch.randn(q_shape).to(dtype), torch.randn(k_shape or q_shape).to(dtype)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((*_qk((2, 4, 5, 7)), *_tables(2, 5, 8)), InvalidArgumentError, r"rope: head dim must be even"),
        (
            (*_qk((2, 4, 5, 8), (2, 4, 6, 8)), *_tables(2, 5, 8)),
            InvalidArgumentError,
            r"rope: sequence lengths",
        ),
        ((*_qk((4, 5, 8)), *_tables(1, 5, 8)), InvalidArgumentError, r"rope: q must have 4 dim"),
        (
            (*_qk((2, 4, 5, 8)), *_qk((2, 4, 5, 8))),
            InvalidArgumentError,
            r"rope: cos and sin must be broadcastable",
        ),
        (
            (_qk((2, 4, 5, 8))[0], _qk((2, 4, 5, 8))[1].double(), *_tables(2, 5, 8)),
            InvalidArgumentError,
            "rope: dtypes",
        ),
        (
            (*_qk((2, 4, 5, 8), dtype=torch.int64), *_tables(2, 5, 8)),
            UnsupportedError,
            r"rope: q must be a floating",
        ),
        (
            (*_qk((2, 4, 5, 8)), *(t.to(torch.float8_e4m3fn) for t in _tables(2, 5, 8))),
            UnsupportedError,
            r"rope: cos and sin must be float64, float32, bfloat16 or float16, got dtype torch.float8_e4m3fn",
        ),
    ],
)
def test_bad_input_is_refused(ops, args, error, match):
    with pytest.raises(error, match=match):
        ops.rope(*args)
