"""Memory tracking on a device whose runtime does not give used_bytes (MemoryInfo.unknown): refused
before anything runs, naming the device; its 0 was tracked as "allocates nothing"."""

from __future__ import annotations

import os

import pytest
import torch

from tests.evaluation.helpers import Counting, cpu_hal
from torchhal.evaluation.harness import Variant, measure
from torchhal.evaluation.inputs import Inputs
from torchhal.hal_core import UnsupportedError


def test_track_memory_without_used_bytes_is_refused_before_any_call(monkeypatch):
    monkeypatch.delattr(os, "sysconf")  # Windows: the host gives no memory figure
    device = cpu_hal().device("cpu")
    n = torch.randint(40, 90, ()).item()
    fn = Counting(torch.matmul)
    variant = Variant("mm", fn, device, Inputs([(torch.randn(n, 33), torch.randn(33, n))]))
    with pytest.raises(
        UnsupportedError, match=r"track_memory needs used_bytes, which cpu's adapter reports as unknown"
    ):
        measure(variant, warmup=1, repetitions=3, track_memory=True)
    assert fn.calls == 0
    # without memory tracking the device is measured as before
    result = measure(variant, warmup=1, repetitions=3).variants["mm"]
    assert result.memory_bytes is None and (result.latency_ms > 0).all()
