"""device.memory_accounting on the simulated ASIC, whose ledger is exact: used_bytes and free_bytes
must move by exactly the buffer on allocating it and back on freeing it. Ledger bugs the kit passed
(a ledger that never credits a free, free memory that never moves, a double charge) now fail."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import torch
from torchhal_simasic.adapter import SimASICAdapter
from torchhal_simasic.spec import SimASICSpec

from torchhal.hal_core import MemoryInfo
from torchhal.testing import CheckStatus, format_report, run_conformance
from torchhal.testing.checks_device import ACCOUNTING_BUFFER_BYTES


class NeverReleases(SimASICAdapter):
    """Charges every allocation and never credits it back."""

    def allocate(
        self, index: int, torch_device: torch.device, shape: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor:
        self.state(index).ledger.charge(math.prod(shape) * dtype.itemsize)
        return torch.empty(tuple(shape), dtype=dtype)


class FrozenFree(SimASICAdapter):
    """free_bytes always the whole capacity, whatever is in use."""

    def memory_info(self, index: int) -> MemoryInfo:
        info = super().memory_info(index)
        return info.model_copy(update={"free_bytes": info.total_bytes})


class DoubleCharge(SimASICAdapter):
    """Charges every allocation twice (and credits both back): half the capacity is lost."""

    def allocate(
        self, index: int, torch_device: torch.device, shape: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor:
        tensor = super().allocate(index, torch_device, shape, dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        ledger = self.state(index).ledger
        ledger.charge(nbytes)
        ledger.release_with(tensor, nbytes)
        return tensor


def _accounting(adapter: SimASICAdapter) -> tuple[CheckStatus, str, str]:
    report = run_conformance(adapter, seed=random.randrange(2**63))
    result = report.result("device.memory_accounting")
    return result.status, result.reason, format_report(report)


def _buffer(memory_bytes: int) -> int:
    """The kit's buffer: 64 MiB or 1% of the capacity, in whole fp32 elements (tiny's first dtype)."""
    return min(ACCOUNTING_BUFFER_BYTES, memory_bytes // 100) // 4 * 4


def _spec(tiny: Callable[..., SimASICSpec], memory_bytes: int) -> SimASICSpec:
    return tiny(memory_bytes=memory_bytes)


def test_an_exact_ledger_passes_saying_so(tiny: Callable[..., SimASICSpec]) -> None:
    memory = random.randint(64, 512) << 20
    status, reason, report = _accounting(SimASICAdapter(_spec(tiny, memory)))
    assert status is CheckStatus.PASSED, report
    assert reason.startswith("simasic:0: used_bytes and free_bytes moved by exactly the "), reason


def test_a_ledger_that_never_credits_a_free_fails(tiny: Callable[..., SimASICSpec]) -> None:
    memory = random.randint(64, 512) << 20
    status, reason, report = _accounting(NeverReleases(_spec(tiny, memory)))
    n = _buffer(memory)
    assert status is CheckStatus.FAILED, report
    assert f"used_bytes moved by +0 bytes ({n} -> {n}) on freeing a {n}-byte buffer" in reason, reason
    assert f"must move by exactly -{n}" in reason


def test_free_bytes_that_never_moves_fails(tiny: Callable[..., SimASICSpec]) -> None:
    memory = random.randint(64, 512) << 20
    status, reason, report = _accounting(FrozenFree(_spec(tiny, memory)))
    n = _buffer(memory)
    assert status is CheckStatus.FAILED, report
    assert f"free_bytes moved by +0 bytes ({memory} -> {memory}) on allocating a {n}-byte buffer" in reason
    assert (
        f"after allocating {n} bytes: free_bytes {memory} + used_bytes {n} > total_bytes {memory}" in reason
    )


def test_a_double_charge_fails(tiny: Callable[..., SimASICSpec]) -> None:
    """2x the buffer was within the bound (2x plus 64 MiB)."""
    memory = random.randint(64, 512) << 20
    status, reason, report = _accounting(DoubleCharge(_spec(tiny, memory)))
    n = _buffer(memory)
    assert status is CheckStatus.FAILED, report
    assert f"used_bytes moved by +{2 * n} bytes (0 -> {2 * n}) on allocating a {n}-byte buffer" in reason
