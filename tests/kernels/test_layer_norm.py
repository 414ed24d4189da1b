"""layer_norm: the Triton forward and backward (CPU interpreter, fp32) against the fp64 reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchhal.hal_core import InvalidArgumentError, RejectionReason, UnsupportedError
from torchhal.kernels import layer_norm
from torchhal.kernels.triton_rows import RowLaunch


def _params(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return 1 + 0.2 * torch.randn(n), 0.2 * torch.randn(n)


def _stats(x: torch.Tensor, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and rstd layer_norm_forward saves for the backward."""
    _, mean, rstd = layer_norm.reference_forward(x, *_params(x.shape[-1]), eps)
    return mean, rstd


@pytest.mark.parametrize(
    ("shape", "eps", "offset"),
    [((97, 123), 1e-5, 0.0), ((9, 203), 0.1, 3.0), ((33, 1023), 1e-5, 300.0), ((6, 256), 1e-5, 3.0)],
)
def test_triton_forward_and_gradients_within_pytorch_error(ops, check_op, shape, eps, offset):
    """`offset` shifts the rows' mean away from 0, where a one-pass variance would lose digits.
    (6, 256): rows that fill the block, which the forward reads without a mask."""
    x, dy = torch.randn(shape) + offset, torch.randn(shape)
    w, b = _params(shape[-1])
    cpu = ops.hal.device("cpu")
    assert ops.hal.kernels.select("layer_norm", cpu, x, w, b, eps).candidate.name == "triton"
    assert ops.hal.kernels.select("layer_norm_forward", cpu, x, w, b, eps).candidate.name == "triton"
    assert (
        ops.hal.kernels.select("layer_norm_backward", cpu, dy, x, w, *_stats(x, eps)).candidate.name
        == "triton"
    )
    check_op(ops.layer_norm, layer_norm.reference, (x, w, b, eps), (dy,), (0, 1, 2))


@pytest.mark.parametrize("shape", [(7, 100), (5, 768), (4, 256)], ids=["100", "768", "256-even"])
def test_constant_rows_normalise_to_the_bias_exactly(ops, check_op, shape):
    """A row of equal values has x - mean = 0 exactly, so y = bias, as torch's CPU kernel gives:
    sum(x) / n rounded at x's scale left ~1 ulp of it, which rstd ~ 1/sqrt(eps) made 0.08 at 1000.1
    (hidden 768). Rows of other constants (1000.1, -3.7, ...) and one ordinary row among them."""
    constants = torch.tensor([1000.1, -3.7, 0.3, 12345.678, 1e-3, -77.7, 2.5])[: shape[0]]
    x = constants[:, None].expand(shape).clone()
    x[-1] = torch.randn(shape[-1]) + 100.0
    w, b = _params(shape[-1])
    assert (
        ops.hal.kernels.select("layer_norm", ops.hal.device("cpu"), x, w, b, 1e-5).candidate.name == "triton"
    )
    y = ops.layer_norm(x, w, b, 1e-5)
    assert torch.equal(y[:-1], b.expand(shape[0] - 1, -1))
    assert torch.equal(torch.nn.functional.layer_norm(x[:-1], shape[-1:], w, b, 1e-5), y[:-1])
    check_op(ops.layer_norm, layer_norm.reference, (x, w, b, 1e-5), (torch.randn(shape),), (0, 1, 2))


def test_long_rows_are_read_again_after_the_sums(ops, check_op):
    """At hidden 12289 (block 16384) each interpreted thread holds 32 fp32 elements, so the backward
    reads the row and the weight again after the sums (RowLaunch.reload_row); the mean is far from
    0 so that a second read recentred differently from the first would show."""
    x, dy = torch.randn(3, 12289) + 3.0, torch.randn(3, 12289)
    w, b = _params(12289)
    launch = RowLaunch.from_caps(ops.hal.device("cpu").capabilities)
    assert launch.reload_row(16384, launch.norm_warps(16384, x.element_size()))
    check_op(ops.layer_norm, layer_norm.reference, (x, w, b, 1e-5), (dy,), (0, 1, 2))


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(1, 5),
    hidden=st.integers(4, 130),
    row_gap=st.integers(0, 5),
    leading=st.sampled_from([(), (2,), (1, 2)]),
)
def test_strided_rows_property(ops, check_op, rows, hidden, row_gap, leading):
    """Row-strided views of wider buffers. Hidden <= 3 is left out of the gradient comparison:
    (x - mean) / std is then pinned by its two constraints (zero mean, unit variance) to a few
    points, the exact dx is ~0 up to eps terms, and every fp32 dx is cancellation noise."""
    x = torch.randn(*leading, rows, hidden + row_gap)[..., :hidden]
    dy = torch.randn(*leading, rows, hidden + 2 * row_gap)[..., row_gap : row_gap + hidden]
    w, b = _params(hidden)
    cpu = ops.hal.device("cpu")
    assert ops.hal.kernels.select("layer_norm_backward", cpu, dy, x, w, *_stats(x)).candidate.name == "triton"
    check_op(ops.layer_norm, layer_norm.reference, (x, w, b, 1e-5), (dy,), (0, 1, 2))


def test_layout_the_kernel_cannot_index_goes_to_the_reference(ops):
    x = torch.randn(5, 3, 40).transpose(0, 1)  # leading dims not collapsible into one row stride
    w, b = _params(40)
    sel = ops.hal.kernels.select("layer_norm", ops.hal.device("cpu"), x, w, b, 1e-5)
    assert sel.candidate.name == "reference"
    assert {r.candidate: r.reason for r in sel.rejected}["torchhal/triton"] is RejectionReason.LAYOUT
    torch.testing.assert_close(ops.layer_norm(x, w, b, 1e-5), layer_norm.reference(x.contiguous(), w, b))


@pytest.mark.parametrize("hal_ops", ["ops", "plain_ops"])  # the Triton kernels and the references
def test_empty_rows(request, hal_ops):
    """Hidden size 0: empty outputs and gradients, as torch gives."""
    ops = request.getfixturevalue(hal_ops)
    x = torch.randn(4, 0, requires_grad=True)
    w, b = (t.requires_grad_(True) for t in _params(0))
    ops.layer_norm(x, w, b, 1e-5).backward(torch.randn(4, 0))
    assert x.grad.shape == (4, 0) and w.grad.shape == b.grad.shape == (0,)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (
            (torch.randn(4, 8), torch.randn(8), torch.randn(7)),
            InvalidArgumentError,
            r"layer_norm: weight and bias",
        ),
        (
            (torch.randn(4, 8), torch.randn(8), None),
            InvalidArgumentError,
            r"layer_norm: bias must be a torch",
        ),
        ((torch.randn(4, 9), torch.randn(8), torch.randn(8)), InvalidArgumentError, r"layer_norm: x's last"),
        (
            (torch.ones(4, 8, dtype=torch.int32), *_params(8)),
            UnsupportedError,
            r"layer_norm: x must be a float",
        ),
        (
            (torch.randn(4, 8), torch.randn(8), torch.randn(8).half()),
            InvalidArgumentError,
            r"layer_norm: dtypes",
        ),
    ],
)
def test_bad_input_is_refused(ops, args, error, match):
    with pytest.raises(error, match=match):
        ops.layer_norm(*args, 1e-5)


def test_a_tensor_eps_is_refused(ops):
    with pytest.raises(
        InvalidArgumentError, match=r"layer_norm: eps must be a finite Python float or int >= 0"
    ):
        ops.layer_norm(torch.randn(4, 8), *_params(8), torch.tensor(1e-5, requires_grad=True))


def test_forward_without_gradients_saves_nothing_and_matches_the_training_forward(ops):
    """No gradient: the plain layer_norm op, whose kernel writes no statistics (None pointers)."""
    x = torch.randn(5, 203) * 2 + 1
    w, b = _params(203)
    cpu = ops.hal.device("cpu")
    assert ops.hal.kernels.select("layer_norm", cpu, x, w, b, 1e-5).candidate.name == "triton"
    with torch.no_grad():
        y = ops.layer_norm(x, w, b, 1e-5)
    training_y, _, _ = ops.hal.dispatch("layer_norm_forward", x, w, b, 1e-5)
    torch.testing.assert_close(y, training_y, rtol=0, atol=0)
    torch.testing.assert_close(y, layer_norm.reference(x, w, b, 1e-5))


def test_training_forward_saves_the_reference_statistics(ops):
    """The Triton forward's mean and rstd, which its backward trusts, against the reference's."""
    x = torch.randn(2, 7, 203) * 3 + 5
    w, b = _params(203)
    y, mean, rstd = ops.hal.dispatch("layer_norm_forward", x, w, b, 1e-5)
    want_y, want_mean, want_rstd = layer_norm.reference_forward(x, w, b, 1e-5)
    assert mean.shape == rstd.shape == (2, 7) and mean.dtype == rstd.dtype == torch.float32
    torch.testing.assert_close(mean, want_mean)
    torch.testing.assert_close(rstd, want_rstd)
    torch.testing.assert_close(y, want_y)


@pytest.mark.parametrize(
    ("stat", "match"),
    [
        (
            torch.zeros(4),
            r"layer_norm_backward: mean must be layer_norm_forward's statistics, shape \(4, 3\).*\(4,\)",
        ),
        (
            torch.zeros(4, 3, dtype=torch.float64),
            r"mean must be .* dtype torch.float32 .* got shape \(4, 3\), dtype torch.float64",
        ),
    ],
)
def test_backward_refuses_statistics_that_are_not_the_forward_s(ops, stat, match):
    x, dy = torch.randn(4, 3, 8), torch.randn(4, 3, 8)
    w, _ = _params(8)
    _, rstd = _stats(x)
    with pytest.raises(InvalidArgumentError, match=match):
        ops.hal.dispatch("layer_norm_backward", dy, x, w, stat, rstd)


def test_strided_statistics_go_to_the_reference(ops):
    x, dy = torch.randn(6, 40), torch.randn(6, 40)
    w, _ = _params(40)
    mean, rstd = _stats(x)
    strided_mean = torch.stack((mean, mean), -1)[:, 0]
    sel = ops.hal.kernels.select("layer_norm_backward", ops.hal.device("cpu"), dy, x, w, strided_mean, rstd)
    assert sel.candidate.name == "reference"
    assert {r.candidate: r.reason for r in sel.rejected}["torchhal/triton"] is RejectionReason.LAYOUT
    # the reference reading the strided mean against the kernel reading the contiguous one
    for got, want in zip(
        ops.hal.dispatch("layer_norm_backward", dy, x, w, strided_mean, rstd),
        ops.hal.dispatch("layer_norm_backward", dy, x, w, mean, rstd),
        strict=True,
    ):
        torch.testing.assert_close(got, want)


def test_a_vmap_call_falls_back_without_demoting_the_kernel_for_plain_calls(monkeypatch):
    """Under torch.func.vmap the tensors have no storage and the Triton kernel cannot run: the call
    falls back (logged, counted) but demotes nothing, since the signature does not tell batched
    tensors from plain ones: a demotion sent every later plain call of it to the reference."""
    import torchhal.ops

    from .conftest import make_hal

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    hal = make_hal(interpret=True)  # its own: the session HALs' guard fails any fallback
    cpu = hal.device("cpu")
    (weight, bias), x = _params(16), torch.randn(3, 8, 16)
    with hal.use(cpu):
        batched = torch.func.vmap(lambda rows: torchhal.ops.layer_norm(rows, weight, bias))(x)
    torch.testing.assert_close(batched, torch.nn.functional.layer_norm(x, (16,), weight, bias))
    assert hal.kernels.fallback_counts == {"layer_norm:torchhal/triton": 1}
    assert hal.kernels.select("layer_norm", cpu, x[0], weight, bias, 1e-5).candidate.name == "triton"
