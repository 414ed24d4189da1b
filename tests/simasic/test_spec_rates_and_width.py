"""Spec validation: every dtype the device lists has a MAC rate (one without ran its matmuls on the
host, uncharged), and the array is at most as wide as a SIMD width the conformance kit accepts."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from torchhal_simasic.adapter import SimASICAdapter
from torchhal_simasic.spec import MAX_COLS, SimASICSpec

import torchhal
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import ConfigurationError
from torchhal.testing import CheckStatus, ConformanceSuite, checks_adapter


@pytest.mark.parametrize("rateless", [["fp64"], ["fp16"], ["fp16", "int8"]])
def test_a_dtype_without_a_mac_rate_is_refused_naming_it(
    tiny: Callable[..., SimASICSpec], rateless: list[str]
) -> None:
    """fp64 listed without an fp64 rate: an fp64 matmul on the device ran on the host, its clock
    and ledger untouched, with a warning only."""
    with pytest.raises(ConfigurationError) as err:
        tiny(dtypes=["fp32", "bf16", *rateless])
    assert str(err.value) == (
        "simulated ASIC spec test: dtypes: every dtype needs a MAC rate in macs_per_cell_per_cycle "
        f"['bf16', 'fp32'] (the array computes the device's matmuls), got {sorted(rateless)} without one"
    )


def test_with_its_rate_fp64_matmul_is_charged(
    sim_hal: Callable[..., HardwareAbstractionLayer], tiny: Callable[..., SimASICSpec]
) -> None:
    spec = tiny(dtypes=["fp32", "bf16", "fp64"], macs_per_cell_per_cycle={"fp32": 1, "bf16": 2, "fp64": 1})
    hal = sim_hal(spec)
    a = torch.randn(random.randint(5, 12), 9, dtype=torch.float64)
    state = hal.device("simasic:0").adapter.state(0)  # type: ignore[attr-defined]
    with hal.use("simasic:0"):
        out = torchhal.ops.matmul(a, a.T)
    assert torch.equal(out, a @ a.T) and state.clock.now() > 0


def test_cols_past_the_kits_simd_width_are_refused(tiny: Callable[..., SimASICSpec]) -> None:
    """cols 8192 was a valid spec whose device then failed adapter.discover (simd_width = cols)."""
    cols = random.randint(MAX_COLS + 1, 4 * MAX_COLS)
    with pytest.raises(ConfigurationError) as err:
        tiny(cols=cols)
    assert str(err.value) == (
        f"simulated ASIC spec test: field 'cols': must be at most {MAX_COLS} (the array's columns are "
        f"the device's SIMD width, which the conformance kit bounds there), got {cols}"
    )


def test_the_widest_array_passes_discovery(tiny: Callable[..., SimASICSpec]) -> None:
    assert MAX_COLS == checks_adapter.MAX_SIMD_WIDTH
    suite = ConformanceSuite(SimASICAdapter(tiny(cols=MAX_COLS)), seed=random.randrange(2**63))
    (check,) = [c for c in suite.checks() if c.id == "adapter.discover"]
    result = suite.run_check(check)
    assert result.status is CheckStatus.PASSED, result.reason
