"""matmul's backward op: torch's gradients for every operand shape torch.matmul takes, and its errors."""

from __future__ import annotations

import pytest
import torch

from torchhal.hal_core import InvalidArgumentError
from torchhal.kernels import matmul

SHAPES = [
    ((7, 13), (13, 5)),  # plain
    ((3, 9, 17), (17, 6)),  # a batched over a 2-D b: the batch folds into a's rows
    ((2, 3, 4, 7), (2, 3, 7, 5)),  # equal batches
    ((2, 3, 4, 7), (1, 3, 7, 5)),  # b broadcast over a's batch
    ((4, 13), (2, 1, 13, 5)),  # a broadcast over b's batch
    ((13,), (13, 5)),  # vector @ matrix
    ((13,), (3, 13, 5)),  # vector @ batched matrices
    ((3, 7, 13), (13,)),  # batched matrices @ vector
    ((13,), (13,)),  # dot
    ((4, 0), (0, 5)),  # an empty inner dimension: zeros, and empty gradients
    ((3, 2, 0), (0, 4)),
    ((0,), (2, 0, 5)),
    ((3, 7, 0), (0,)),
]


@pytest.mark.parametrize(("a_shape", "b_shape"), SHAPES)
def test_gradients_are_torchs(fresh_ops, a_shape, b_shape):
    """Through torchhal's ops (autograd, the registry's matmul_backward) against torch.matmul's own
    gradients, in fp64 on fresh random inputs; the product's shape is torch's too."""
    a = torch.randn(a_shape, dtype=torch.float64, requires_grad=True)
    b = torch.randn(b_shape, dtype=torch.float64, requires_grad=True)
    out = fresh_ops.matmul(a, b)
    want = torch.matmul(a, b)
    assert out.shape == want.shape == matmul.output_shape(a_shape, b_shape)
    grad = torch.randn_like(want)
    got = torch.autograd.grad(out, (a, b), grad)
    expected = torch.autograd.grad(want, (a, b), grad)
    for g, e, x in zip(got, expected, (a, b), strict=True):
        assert g.shape == x.shape
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_only_the_operand_that_needs_it_gets_a_gradient(fresh_ops):
    a, b = torch.randn(5, 6, requires_grad=True), torch.randn(6, 4)
    fresh_ops.matmul(a, b).sum().backward()
    torch.testing.assert_close(a.grad, torch.ones(5, 4) @ b.t())
    assert b.grad is None


def test_a_grad_out_of_the_wrong_shape_is_refused(plain_hal):
    a, b = torch.randn(5, 6), torch.randn(6, 4)
    with pytest.raises(
        InvalidArgumentError,
        match=r"matmul_backward: grad_out must have the product's shape \(5, 4\), got \(4, 5\)",
    ):
        plain_hal.kernels.call("matmul_backward", plain_hal.device("cpu"), torch.randn(4, 5), a, b)


def test_a_scalar_operand_is_refused_by_its_rank(plain_hal):
    with pytest.raises(
        InvalidArgumentError, match=r"matmul: a must have at least 1 dimension, got shape \(\)"
    ):
        plain_hal.kernels.call("matmul", plain_hal.device("cpu"), torch.tensor(2.0), torch.randn(3))


def test_mismatched_inner_dimensions_are_refused(plain_hal):
    with pytest.raises(
        InvalidArgumentError, match=r"matmul: inner dimensions must agree, got a \(5, 6\) and b \(5, 4\)"
    ):
        plain_hal.kernels.call("matmul", plain_hal.device("cpu"), torch.randn(5, 6), torch.randn(5, 4))


def test_batch_dimensions_that_do_not_broadcast_are_refused(fresh_ops):
    """Refused by validation, not by the kernel: a kernel's error would be logged as a failure and
    counted against it."""
    with pytest.raises(
        InvalidArgumentError,
        match=r"matmul: batch dimensions must broadcast, got a \(2, 3, 4\) and b \(5, 4, 6\)",
    ):
        fresh_ops.matmul(torch.randn(2, 3, 4), torch.randn(5, 4, 6))
    a, b = torch.randn(2, 3, 4), torch.randn(1, 4, 6)  # the same signature, valid: still runs
    torch.testing.assert_close(fresh_ops.matmul(a, b), torch.matmul(a, b))
