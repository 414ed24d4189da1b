"""`torchhal profile` on the simulated ASIC: its figures are the cost model's, worked out here,
and what it cannot measure is a note, never a figure."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from torchhal_simasic.adapter import SimASICAdapter
from torchhal_simasic.cost import copy_time_s, matmul_cost
from torchhal_simasic.spec import SimASICSpec

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import DType
from torchhal.hal_core.settings import Settings

MiB = 2**20


def _hal(spec: SimASICSpec, cache: Path) -> HardwareAbstractionLayer:
    env = {"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1", "TORCHHAL_CACHE_DIR": str(cache)}
    return HardwareAbstractionLayer(adapters=[SimASICAdapter(spec)], settings=Settings.from_env(env))


def test_figures_are_the_cost_models_and_labelled_simulated(tiny: Callable[..., SimASICSpec], tmp_path):
    """2n³ FLOPs over the modelled matmul time; copy bytes read plus written over the modelled
    copy; launch latency the modelled one-element copy, each in simulated time."""
    spec = tiny(memory_bytes=1 << 30)
    prof = _hal(spec, tmp_path).profile("simasic:0")
    assert prof.simulated and prof.direct_matmul_tflops is None and prof.direct_copy_bandwidth_gbps is None
    assert prof.direct_launch_latency_us is None
    assert prof.matmul_sizes == {DType.FP32: 512, DType.BF16: 512}
    for dtype in (DType.FP32, DType.BF16):
        expected = 2 * 512**3 / matmul_cost(spec, 512, 512, 512, dtype).time_s / 1e12
        assert prof.matmul_tflops[dtype] == pytest.approx(expected, rel=1e-9)
    assert prof.copy_bytes == 64 * MiB
    expected_gbps = 2 * 64 * MiB / copy_time_s(spec, 64 * MiB) / 1e9
    assert prof.copy_bandwidth_gbps == pytest.approx(expected_gbps, rel=1e-9)
    assert prof.launch_latency_us == pytest.approx(copy_time_s(spec, 4) * 1e6, rel=1e-9)
    assert prof.notes == ("times are simulated by the device's cost model; numerics are real",)


def test_a_dtype_the_array_cannot_multiply_is_a_note_not_a_figure(tiny, tmp_path):
    """fp16 stored but without a MAC rate: its matmul runs on the host and charges no simulated
    time, and the zero, clamped to 1e-6 ms, was reported as 268,435 TFLOP/s (and cached). Spec
    validation now refuses such a spec; one built without it (model_copy) still reaches the guard."""
    spec = tiny(memory_bytes=1 << 30).model_copy(
        update={"dtypes": frozenset({DType.FP32, DType.BF16, DType.FP16})}
    )
    prof = _hal(spec, tmp_path).profile("simasic:0")
    assert DType.FP16 not in prof.matmul_tflops and DType.FP16 not in prof.matmul_sizes
    assert prof.matmul_tflops.keys() == {DType.FP32, DType.BF16}
    assert (
        "matmul fp16 not measured: TorchHALError: simasic:0 charged no simulated time for it "
        "(it ran outside the simulation)"
    ) in prof.notes


def test_a_small_device_is_profiled_with_a_copy_that_fits(tiny, tmp_path):
    """The 64 MiB copy's source and destination did not fit 100 MiB: the profile raised
    DeviceOutOfMemoryError and measured nothing. The copy now takes at most half of what is free."""
    spec = tiny(memory_bytes=100 * MiB)
    hal = _hal(spec, tmp_path)
    prof = hal.profile("simasic:0")
    assert prof.copy_bytes == 16 * MiB
    expected_gbps = 2 * 16 * MiB / copy_time_s(spec, 16 * MiB) / 1e9
    assert prof.copy_bandwidth_gbps == pytest.approx(expected_gbps, rel=1e-9)
    assert prof.matmul_tflops.keys() == {DType.FP32, DType.BF16}


def test_every_declared_format_gets_a_figure_or_a_note(tiny, tmp_path):
    """Only fp8_e4m3 of the four fp8 formats was tried: a device declaring e5m2 (or AMD's fnuz
    pair) got neither a figure nor a note for it."""
    spec = tiny(
        memory_bytes=1 << 30,
        dtypes=["fp32", "bf16", "fp8_e5m2", "fp8_e4m3fnuz"],
        macs_per_cell_per_cycle={"fp32": 1, "bf16": 2, "fp8_e5m2": 4, "fp8_e4m3fnuz": 4},
    )
    prof = _hal(spec, tmp_path).profile("simasic:0")
    for fmt in ("fp8_e5m2", "fp8_e4m3fnuz"):
        assert (
            f"matmul {fmt} not measured: TorchHALError: fp8 matmul needs scaling factors; "
            "no vendor-neutral op measures it yet"
        ) in prof.notes


def test_a_device_that_fails_mid_profile_leaves_no_cache_file(tiny, tmp_path, monkeypatch):
    hal = _hal(tiny(memory_bytes=1 << 30), tmp_path)
    adapter = hal.device("simasic:0").adapter

    def broken(index, dst, src):
        raise RuntimeError("device lost")

    monkeypatch.setattr(adapter, "copy_", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        hal.profile("simasic:0")
    assert not (tmp_path / "profiles").exists() or not any((tmp_path / "profiles").iterdir())
