"""float8 is a storage format torch computes nothing in: the ops refuse float8 inputs by name,
where on a device declaring fp8 every candidate raised (KernelFailedError: "Promotion for Float8
Types is not supported")."""

from __future__ import annotations

import pytest
import torch
from torchhal_simasic.adapter import SimASICAdapter
from torchhal_simasic.spec import parse_spec

import torchhal
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import UnsupportedError
from torchhal.hal_core.settings import Settings

FP8 = {
    "name": "fp8-declaring",
    "rows": 16,
    "cols": 16,
    "clock_hz": 1e9,
    "sram_bytes": 1 << 20,
    "memory_bytes": 1 << 30,
    "memory_bandwidth_bytes_per_s": 1e11,
    "dtypes": ["fp32", "fp8_e4m3"],
    "launch_overhead_s": 1e-6,
    "macs_per_cell_per_cycle": {"fp32": 1, "fp8_e4m3": 4},
}


@pytest.fixture
def fp8_device():
    hal = HardwareAbstractionLayer(
        adapters=[SimASICAdapter(parse_spec(FP8, "test"))],
        settings=Settings(disable_plugin_autoload=True),
    )
    with hal.use("simasic:0") as dev:
        yield dev


def _fp8(*shape):
    return torch.randn(*shape).to(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("op", "args", "name"),
    [
        ("rms_norm", lambda: (_fp8(4, 8), _fp8(8)), "x"),
        ("layer_norm", lambda: (_fp8(4, 8), _fp8(8), _fp8(8)), "x"),
        ("swiglu", lambda: (_fp8(4, 8), _fp8(4, 8)), "gate"),
        ("attention", lambda: (_fp8(1, 2, 4, 8), _fp8(1, 2, 4, 8), _fp8(1, 2, 4, 8)), "q"),
    ],
)
def test_float8_inputs_are_refused_naming_the_op_and_the_dtypes(fp8_device, op, args, name):
    with pytest.raises(
        UnsupportedError,
        match=rf"{op}: {name} must be a floating-point tensor of float64, float32, bfloat16 or "
        r"float16, got dtype torch.float8_e4m3fn \(a float8 storage format",
    ):
        getattr(torchhal.ops, op)(*args())
    x, w = fp8_device.to_device(torch.randn(4, 8)), fp8_device.to_device(torch.randn(8))
    torch.testing.assert_close(torchhal.ops.rms_norm(x, w), torch.nn.functional.rms_norm(x, (8,), w))
