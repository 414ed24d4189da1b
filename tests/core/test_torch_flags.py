"""torch's numerics switches: read without the legacy getters, set for a block and put back exactly."""

from __future__ import annotations

import pytest
import torch

from torchhal.hal_core import torch_flags

pytestmark = pytest.mark.skipif(
    not torch_flags.per_backend_precision(),
    reason="this torch keeps no per-backend fp32 precision (before 2.9)",
)

MATMULS = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)


@pytest.fixture
def restored_precisions():
    saved = [(owner, owner.fp32_precision) for owner in (torch.backends, *MATMULS)]
    yield
    for owner, value in saved:  # the general precision first, then each backend's
        owner.fp32_precision = value


def test_the_block_sets_each_backends_matmul_precision_and_puts_it_back(restored_precisions, monkeypatch):
    torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = "tf32", "bf16"

    def legacy_getter_raises() -> str:  # as torch's may after the per-backend API was used
        raise RuntimeError("you have used mix of the legacy and new APIs to set the matmul precision")

    monkeypatch.setattr(torch, "get_float32_matmul_precision", legacy_getter_raises)
    with torch_flags.float32_matmul_precision("highest"):
        assert [m.fp32_precision for m in MATMULS] == ["ieee", "ieee"]
    assert [m.fp32_precision for m in MATMULS] == ["tf32", "bf16"]


def test_the_block_puts_the_precisions_back_when_it_raises(restored_precisions):
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    with pytest.raises(ValueError, match="inside"), torch_flags.float32_matmul_precision("high"):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        raise ValueError("inside")
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"


def test_flags_are_read_where_this_torch_has_them_and_legacy_ones_only_before_2_9():
    flags = torch_flags.backend_flags(
        ("cudnn.benchmark", "cuda.matmul.fp32_precision", "no_such_backend.flag", "cudnn.no_such_flag"),
        legacy=("cuda.matmul.allow_tf32",),
    )
    assert flags == {
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cuda.matmul.fp32_precision": torch.backends.cuda.matmul.fp32_precision,
    }


def test_the_block_puts_the_legacy_level_back_too(restored_precisions):
    """The legacy setter also moves torch's legacy level, which Inductor reads (flex attention's
    precision): restoring only the per-backend flags left "high" behind after a TF32 block."""
    torch.set_float32_matmul_precision("highest")
    with torch_flags.float32_matmul_precision("high"):
        assert torch.get_float32_matmul_precision() == "high"
        assert [m.fp32_precision for m in MATMULS] == ["tf32", "tf32"]
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert [m.fp32_precision for m in MATMULS] == ["ieee", "ieee"]


def test_an_unknown_level_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"level must be one of \['high', 'highest'\], got 'medium'"):
        with torch_flags.float32_matmul_precision("medium"):
            pass
