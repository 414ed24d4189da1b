"""The profile's matmul sizes fit the device's free memory, as its copy does: a small device got
"matmul ... not measured: out of memory" for every dtype, on every run."""

from __future__ import annotations

import random

import pytest
import torch
from torchhal_simasic.adapter import SimASICAdapter
from torchhal_simasic.cost import matmul_cost
from torchhal_simasic.spec import parse_spec

from tests.simasic.tiny import TINY
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import DType
from torchhal.hal_core.profile import cache_path
from torchhal.hal_core.settings import Settings

MiB = 2**20


def _largest_fitting_n(free: int, itemsize: int) -> int:
    """The reference: the largest of 512, 256, ... whose a, b, product and the pair held while
    doubling (four n×n operands) take at most half of `free`."""
    return max(n for n in (512 >> k for k in range(6)) if 2 * 4 * n * n * itemsize <= free)


def test_a_small_device_is_profiled_at_matmul_sizes_that_fit(tmp_path, monkeypatch):
    memory = random.randint(2 * MiB, 3 * MiB - 1)  # 512² fp32: a, b and the product take 3 MiB
    spec = parse_spec({**TINY, "memory_bytes": memory}, "test")
    env = {"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1", "TORCHHAL_CACHE_DIR": str(tmp_path)}

    def run() -> HardwareAbstractionLayer:  # a new process's HAL: only the disk cache carries over
        return HardwareAbstractionLayer(adapters=[SimASICAdapter(spec)], settings=Settings.from_env(env))

    prof = run().profile("simasic:0")

    assert not [n for n in prof.notes if "not measured" in n], prof.notes
    for dtype, tdtype in ((DType.FP32, torch.float32), (DType.BF16, torch.bfloat16)):
        n = _largest_fitting_n(memory, tdtype.itemsize)
        assert prof.matmul_sizes[dtype] == n
        expected = 2 * n**3 / matmul_cost(spec, n, n, n, dtype).time_s / 1e12
        assert prof.matmul_tflops[dtype] == pytest.approx(expected, rel=1e-9)
        if n < 512:  # the smaller n is said, beside the figure it gives
            assert f"matmul {dtype.value} at n <= {n} (not 512): fitted to {memory} bytes free" in prof.notes
    # measured and cached: the next run reads it instead of measuring (and failing) again
    assert cache_path(tmp_path, run().device("simasic:0")).exists()
    again = run()
    monkeypatch.setattr("torchhal.hal_core.profile.measure", lambda *a: pytest.fail("measured again"))
    assert again.profile("simasic:0") == prof
