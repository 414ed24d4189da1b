"""row_stride: the one row stride of a (..., cols) tensor, or None, checked by indexing the storage."""

from __future__ import annotations

import pytest
import torch

from torchhal.kernels.triton_rows import row_stride

BASE = torch.arange(4 * 6 * 10, dtype=torch.float32).reshape(4, 6, 10)
INDEXABLE = {
    "contiguous 3-D": BASE,
    "contiguous, one row": BASE[:1, :1],
    "zero rows": BASE[:0],
    "row slice of a wider buffer": BASE[..., :7],
    "every other row": BASE.reshape(24, 10)[::2],
    "leading dims of size 1": BASE[None, 2:3, :, None, :][..., 0, :],
}
NOT_INDEXABLE = {
    "transposed": BASE.transpose(1, 2),
    "leading dims not collapsible": BASE.transpose(0, 1),
    "column step 2": BASE[..., ::2],
    "0-d": torch.tensor(1.0),
}


@pytest.mark.parametrize("name", INDEXABLE)
def test_rows_read_through_the_stride_are_the_tensor_s_rows(name):
    t = INDEXABLE[name]
    stride, cols = row_stride(t), t.shape[-1]
    assert stride is not None
    rows = t.numel() // cols
    through = torch.as_strided(t, (rows, cols), (stride, 1), t.storage_offset())
    torch.testing.assert_close(through, t.reshape(rows, cols), rtol=0, atol=0)


@pytest.mark.parametrize("name", NOT_INDEXABLE)
def test_layouts_without_one_row_stride_get_none(name):
    assert row_stride(NOT_INDEXABLE[name]) is None
