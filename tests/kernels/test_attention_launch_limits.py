"""Attention's Triton kernels on inputs that pass validation but that a
launch limit turned away after it (a candidate raising there falls back and is demoted for every
call of the signature)."""

from __future__ import annotations

import pytest
import torch

from torchhal.kernels import attention, attention_varlen

# imported by the tests only once the interpreter is on (conftest: triton_hal)
GRID_LIMIT = "torchhal.kernels.triton_attention_kernels.MAX_GRID_YZ"


@pytest.mark.parametrize("causal", [False, True])
def test_a_batch_beyond_the_grid_limit_runs_in_the_kernel(
    triton_hal, candidate, check_kernels, monkeypatch, causal
):
    """Batch rides grid axis 2, which CUDA caps at 65535: a larger batch (axial attention folds
    image rows into it) raised after validation, so it fell back to the reference and demoted the
    kernel for every later call of its signature. The limit is lowered here, as the interpreter
    takes 65536 programs too slowly."""
    monkeypatch.setattr(GRID_LIMIT, 3)
    torch.manual_seed(0)
    q, k, v = torch.randn(7, 2, 9, 16), torch.randn(7, 1, 11, 16), torch.randn(7, 1, 11, 16)
    _check_dense_triton(triton_hal, candidate, check_kernels, q, k, v, causal)


def test_more_sequences_than_the_grid_limit_run_in_the_kernel(
    triton_hal, candidate, check_kernels, monkeypatch
):
    """attention_varlen's batch is its sequence count: many short sequences passed the same limit."""
    monkeypatch.setattr(GRID_LIMIT, 2)
    torch.manual_seed(0)
    cu = torch.tensor([0, 3, 3, 8, 9, 15])
    q, k, v = torch.randn(15, 2, 16), torch.randn(15, 1, 16), torch.randn(15, 1, 16)
    fixed = (cu, cu, 6, 6, True, None)  # offsets stay int64 where check_kernels casts q, k, v to fp64
    _check_varlen_triton(triton_hal, candidate, check_kernels, q, k, v, fixed)


@pytest.mark.parametrize(("heads_q", "heads_kv"), [(8, 2), (8, 4), (7, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_more_heads_than_the_grid_limit_run_in_the_kernel(
    triton_hal, candidate, check_kernels, monkeypatch, heads_q, heads_kv, causal
):
    """Query heads ride grid axis 1 (kv heads, in the dk/dv kernel), which CUDA caps at 65535: more
    raised after validation (fell back, demoted the kernel). Launched in slices now; with the limit
    at 3, slices of 8 query heads cross kv-head groups (GQA 8/2), and 4 kv heads are sliced too."""
    monkeypatch.setattr(GRID_LIMIT, 3)
    torch.manual_seed(0)
    q = torch.randn(2, heads_q, 9, 16)
    k, v = torch.randn(2, heads_kv, 11, 16), torch.randn(2, heads_kv, 11, 16)
    _check_dense_triton(triton_hal, candidate, check_kernels, q, k, v, causal)


def test_more_packed_heads_than_the_grid_limit_run_in_the_kernel(
    triton_hal, candidate, check_kernels, monkeypatch
):
    """attention_varlen shares the launchers: 8 query heads over 4 kv heads, limit 3, and more
    sequences than the limit too (both axes sliced at once)."""
    monkeypatch.setattr(GRID_LIMIT, 3)
    torch.manual_seed(0)
    cu = torch.tensor([0, 3, 3, 8, 9, 15])
    q, k, v = torch.randn(15, 8, 16), torch.randn(15, 4, 16), torch.randn(15, 4, 16)
    fixed = (cu, cu, 6, 6, True, None)
    _check_varlen_triton(triton_hal, candidate, check_kernels, q, k, v, fixed)


def test_the_grid_limit_is_cudas_and_slices_cover_every_head_and_batch(triton_hal):
    """65535 is CUDA's cap on grid axes y and z; each launch takes at most that many heads and
    batches, and the slices tile both ranges exactly."""
    from torchhal.kernels import triton_attention_kernels as kernels

    assert kernels.MAX_GRID_YZ == 65535
    slices = kernels._grid_slices(2 * 65535 + 1, 65536)
    assert slices == [
        (h0, hn, b0, bn)
        for h0, hn in ((0, 65535), (65535, 65535), (131070, 1))
        for b0, bn in ((0, 65535), (65535, 1))
    ]
    assert kernels._grid_slices(8, 2) == [(0, 8, 0, 2)]


def _check_varlen_triton(triton_hal, candidate, check_kernels, q, k, v, fixed):
    """The Triton varlen forward and backward against the reference, every gradient."""
    forward = candidate(triton_hal, "attention_varlen_forward", "triton", q, k, v, *fixed)
    out, lse = forward(q, k, v, *fixed)
    grad_out = torch.randn_like(out)
    backward = candidate(
        triton_hal, "attention_varlen_backward", "triton", grad_out, q, k, v, out, lse, *fixed
    )
    check_kernels(
        attention_varlen.AUTOGRAD._replace(context=lambda inputs, results: (*inputs, *results)),
        lambda q, k, v: forward(q, k, v, *fixed),
        lambda grad_out, q, k, v, out, lse: backward(grad_out, q, k, v, out, lse, *fixed),
        lambda q, k, v: attention_varlen.reference(q, k, v, *fixed),
        (q, k, v),
        (grad_out,),
    )


def _check_dense_triton(triton_hal, candidate, check_kernels, q, k, v, causal):
    """The Triton dense forward and backward against the reference, every gradient."""
    args = (q, k, v, causal, None, None)
    forward = candidate(triton_hal, "attention_forward", "triton", *args)
    out, lse = forward(*args)
    grad_out = torch.randn_like(out)
    backward = candidate(triton_hal, "attention_backward", "triton", grad_out, q, k, v, out, lse, causal)
    check_kernels(attention.AUTOGRAD, forward, backward, attention.reference, args, (grad_out,))
