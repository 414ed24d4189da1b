"""swiglu and geglu: the Triton forward and backward (CPU interpreter, fp32) against the fp64 reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchhal.hal_core import InvalidArgumentError, RejectionReason, UnsupportedError

OPS = ("swiglu", "geglu")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(97, 123), (2, 3, 1023), (5, 4100)])
def test_triton_forward_and_gradients_within_pytorch_error(ops, check_op, op, shape):
    """(5, 4100) in fp32: two column blocks a row forward and three backward (RowLaunch.elementwise
    on the gated tiles), the last one partial."""
    gate, up, dy = 2 * torch.randn(shape), torch.randn(shape), torch.randn(shape)
    cpu = ops.hal.device("cpu")
    assert ops.hal.kernels.select(op, cpu, gate, up).candidate.name == "triton"
    assert ops.hal.kernels.select(f"{op}_backward", cpu, dy, gate, up).candidate.name == "triton"
    check_op(getattr(ops, op), ops.hal.kernels.op(op).reference, (gate, up), (dy,), (0, 1))


@pytest.mark.parametrize("op", OPS)
def test_halves_of_a_fused_projection_need_no_copy(ops, check_op, op):
    """gate and up as the two halves of one (rows, 2 * cols) projection: row stride 2 * cols."""
    fused, dy = 2 * torch.randn(17, 2 * 77), torch.randn(17, 77)
    gate, up = fused.chunk(2, dim=-1)
    assert ops.hal.kernels.select(op, ops.hal.device("cpu"), gate, up).candidate.name == "triton"
    check_op(getattr(ops, op), ops.hal.kernels.op(op).reference, (gate, up), (dy,), (0, 1))


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    op=st.sampled_from(OPS),
    rows=st.integers(1, 6),
    cols=st.integers(1, 300),
    gap=st.integers(0, 3),
    transposed=st.booleans(),
)
def test_shapes_and_strides_property(ops, check_op, op, rows, cols, gap, transposed):
    """Row-strided views go to the kernel; transposed ones to the reference; both are right."""
    gate = 2 * torch.randn(rows, cols + gap)[:, :cols]
    up = torch.randn(cols, rows).t() if transposed else torch.randn(rows, cols)
    dy = torch.randn(rows, cols)
    sel = ops.hal.kernels.select(op, ops.hal.device("cpu"), gate, up)
    assert sel.candidate.name == ("reference" if transposed and rows > 1 and cols > 1 else "triton")
    check_op(getattr(ops, op), ops.hal.kernels.op(op).reference, (gate, up), (dy,), (0, 1))


def test_rejected_layout_is_explained(ops):
    gate, up = torch.randn(8, 5), torch.randn(5, 8).t()
    sel = ops.hal.kernels.select("swiglu", ops.hal.device("cpu"), gate, up)
    assert {r.candidate: r.reason for r in sel.rejected}["torchhal/triton"] is RejectionReason.LAYOUT


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((torch.randn(4, 8), torch.randn(4, 9)), InvalidArgumentError, r"swiglu: shapes must agree"),
        ((torch.randn(4, 8), torch.randn(4, 8).double()), InvalidArgumentError, r"swiglu: dtypes must agree"),
        ((torch.ones(4, 8, dtype=torch.int64),) * 2, UnsupportedError, r"swiglu: gate must be a floating"),
        ((torch.randn(4, 8), "up"), InvalidArgumentError, r"swiglu: up must be a torch.Tensor"),
    ],
)
def test_bad_input_is_refused(ops, args, error, match):
    with pytest.raises(error, match=match):
        ops.swiglu(*args)
