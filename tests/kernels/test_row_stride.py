"""row_stride: the one row stride of a (..., cols) tensor, or None, against the storage offsets
of the tensor's elements; unit_stride: whether the last dim is read one element at a time."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchhal.kernels.triton_rows import row_stride, unit_stride


def _expected(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[bool, int | None]:
    """(indexable, stride) from the elements' storage offsets: indexable as (rows, cols) with unit
    column stride and one row stride; the stride is None where any would do (one row)."""
    offsets = torch.arange(1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))).as_strided(
        shape, strides
    )
    rows = offsets.reshape(-1, shape[-1])
    if shape[-1] > 1 and not bool((rows.diff(dim=1) == 1).all()):
        return False, None
    if rows.shape[0] == 1:
        return True, None
    steps = rows[:, 0].diff()
    return bool((steps == steps[0]).all()), int(steps[0])


@settings(max_examples=300, deadline=None)
@given(
    dims=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 12)), min_size=1, max_size=4),
)
def test_row_stride_agrees_with_the_storage_offsets(dims):
    """Non-empty tensors of every small shape and (non-negative) stride, contiguous ones included."""
    shape = tuple(n for n, _ in dims)
    strides = tuple(s for _, s in dims)
    t = torch.empty_strided(shape, strides)
    indexable, stride = _expected(shape, strides)
    got = row_stride(t)
    if not indexable:
        assert got is None
    else:
        assert got is not None and (stride is None or got == stride)
        rows = t.numel() // shape[-1]
        storage = torch.arange(t.untyped_storage().nbytes() // 4, dtype=torch.float32)
        view = storage.as_strided(shape, strides)
        torch.testing.assert_close(storage.as_strided((rows, shape[-1]), (got, 1)), view.reshape(rows, -1))


@pytest.mark.parametrize(
    "t",
    [torch.randn(4, 6, 10), torch.randn(7), torch.randn(5, 1), torch.randn(3, 4)[:, :1]],
    ids=["contiguous", "1-D", "trailing size 1", "column slice of width 1"],
)
def test_common_layouts(t):
    assert row_stride(t) == (t.stride(-2) if t.dim() > 1 else t.shape[-1])


def test_a_0_d_tensor_has_no_rows():
    assert row_stride(torch.tensor(1.0)) is None


@pytest.mark.parametrize(
    ("t", "expected"),
    [
        (torch.randn(4, 6), True),
        (torch.randn(6, 4).t(), False),
        (torch.randn(4, 1).as_strided((4, 1), (1, 9)), True),  # one column: its stride is never stepped
        (torch.randn(4, 8).as_strided((4, 0), (8, 3)), True),  # no elements at all
        (torch.randn(0, 3, 2).transpose(1, 2), True),  # no rows: torch calls it contiguous too
        (torch.randn(4, 8)[:, ::2], False),
    ],
    ids=["contiguous", "transposed", "one column, stride 9", "zero columns", "zero rows", "every other"],
)
def test_unit_stride_ignores_a_last_dim_that_is_never_stepped(t, expected):
    assert unit_stride(t) is expected
