"""Fixtures shared by the single-process distributed tests."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from torchhal import HardwareAbstractionLayer
from torchhal import distributed as thd
from torchhal.hal_core.settings import Settings


@pytest.fixture
def ctx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[thd.DistContext]:
    """A world of one rank on the CPU over gloo (torchrun's variables cleared), shut down after."""
    hal = HardwareAbstractionLayer(settings=Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"}))
    yield from world_of_one(hal, "cpu", tmp_path, monkeypatch, timedelta(seconds=10))


def world_of_one(
    hal: HardwareAbstractionLayer,
    device: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    timeout: timedelta,
) -> Iterator[thd.DistContext]:
    """A world of one rank on `device` (torchrun's variables cleared), shut down after."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized(), "an earlier test left a process group behind"
    store = dist.FileStore(str(tmp_path / "store"), 1)
    context = thd.init(hal, device=device, rank=0, world_size=1, store=store, timeout=timeout)
    try:
        yield context
    finally:
        context.shutdown()
