"""A profile that lost a figure to a passing condition (out of memory) is not cached as the
device's profile: the next run measures again."""

from __future__ import annotations

import json
import random

import pytest
import torch
from torchhal_simasic.adapter import SimASICAdapter

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import DeviceOutOfMemoryError, DType, telemetry
from torchhal.hal_core.profile import cache_path
from torchhal.hal_core.settings import Settings

MiB = 2**20


@pytest.mark.parametrize(
    "error",
    [
        lambda: DeviceOutOfMemoryError("simasic:0", MiB, random.randint(1, 63) * MiB, 64 * MiB),
        lambda: torch.OutOfMemoryError("out of memory: tried to allocate 1.00 MiB"),  # a GPU's
    ],
    ids=["simulated-ledger", "torch"],
)
def test_a_dtype_that_ran_out_of_memory_is_measured_again_next_run(
    tiny, tmp_path, capsys, monkeypatch, error
):
    """Another allocation held the memory while fp32 was measured: "matmul fp32 not measured:
    out of memory" was cached, and every later run read a profile without fp32 until --refresh."""
    adapter = SimASICAdapter(tiny(memory_bytes=64 * MiB))
    env = {"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1", "TORCHHAL_CACHE_DIR": str(tmp_path)}
    allocate, pending = adapter.allocate, [error()]

    def busy_once(index, torch_device, shape, dtype):
        """fp32's first operand meets memory that something else holds, once."""
        if dtype == torch.float32 and len(shape) == 2 and pending:
            raise pending.pop()
        return allocate(index, torch_device, shape, dtype)

    monkeypatch.setattr(adapter, "allocate", busy_once)

    def run() -> HardwareAbstractionLayer:  # a new process's HAL: only the disk cache carries over
        return HardwareAbstractionLayer(adapters=[adapter], settings=Settings.from_env(env))

    telemetry.configure(log_format="json")
    before = telemetry.counts().get("torchhal.profile.not_cached", 0)
    capsys.readouterr()

    short = run().profile("simasic:0")

    assert DType.FP32 not in short.matmul_tflops and DType.BF16 in short.matmul_tflops
    (note,) = (n for n in short.notes if n.startswith("matmul fp32 not measured: "))
    assert note.endswith("(out of memory passes: this profile is not cached, the next run measures again)")
    assert not cache_path(tmp_path, run().device("simasic:0")).exists()
    lines = [json.loads(raw) for raw in capsys.readouterr().err.splitlines()]
    (warned,) = (
        x for x in lines if x["event"] == "device profile not cached: out of memory cost it a figure"
    )
    assert warned["device"] == "simasic:0" and warned["dtypes"] == ["fp32"]
    assert telemetry.counts().get("torchhal.profile.not_cached", 0) == before + 1

    full = run().profile("simasic:0")
    assert full.matmul_tflops.keys() == {DType.FP32, DType.BF16}
    assert full.matmul_tflops[DType.BF16] == pytest.approx(short.matmul_tflops[DType.BF16], rel=1e-9)
    assert cache_path(tmp_path, run().device("simasic:0")).exists()
    assert run().profile("simasic:0") == full  # read from the cache now
