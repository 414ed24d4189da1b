"""Device.empty and to_device with the integer and bool tensors every device stores (labels,
indices, masks): the declared dtypes are the formats a device computes in."""

from __future__ import annotations

import random

import pytest
import torch

from tests.core.adapters import FakeAdapter
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import UnsupportedError


@pytest.fixture
def hal(settings):
    return HardwareAbstractionLayer(adapters=[FakeAdapter()], settings=settings(disable_plugin_autoload="1"))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool])
def test_integer_and_bool_tensors_go_to_the_device(hal, dtype):
    """`to_device(labels)` was refused on every device, the CPU and GPUs included: torchhal tracks
    no int64 format, so no device could declare it."""
    dev = hal.device("cpu")
    host = torch.randint(0, 2 if dtype is torch.bool else 100, (random.randint(1, 500),)).to(dtype)
    moved = dev.to_device(host)
    assert moved.dtype == dtype and moved.device == dev.torch_device and torch.equal(moved, host)
    assert dev.empty((3, 5), dtype).shape == (3, 5)


def test_a_tracked_format_the_device_does_not_declare_is_still_refused(hal):
    dev = hal.device("acme:0")  # declares fp32 and bf16
    with pytest.raises(UnsupportedError, match=r"allocation on acme:0: dtype torch.float16 is not supported"):
        dev.empty((4,), torch.float16)
