"""init(prefix=...) when the caller already made the default process group: refused before any rendezvous."""

from __future__ import annotations

import random
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.ports import free_port
from torchhal import HardwareAbstractionLayer
from torchhal import distributed as thd
from torchhal.hal_core import ConfigurationError
from torchhal.hal_core.settings import Settings

NO_AUTOLOAD = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})


@pytest.fixture
def own_group(tmp_path, monkeypatch):
    """The user's own default group (world of one, gloo), destroyed after the test."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized(), "an earlier test left a process group behind"
    store = dist.FileStore(str(tmp_path / "own_store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=10))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _assert_group_untouched() -> None:
    assert dist.is_initialized() and dist.get_world_size() == 1
    t = torch.randn(3)
    reduced = t.clone()
    dist.all_reduce(reduced)  # a world of one: the sum is the tensor itself
    torch.testing.assert_close(reduced, t)


def test_a_prefix_over_an_existing_group_is_refused_before_the_file_rendezvous(own_group, tmp_path):
    """It made the rendezvous' file store first (a network wait for a real world), then raised."""
    rendezvous = tmp_path / f"rdzv{random.randrange(10**6)}"
    with pytest.raises(ConfigurationError, match=r"prefix 'gen1': the default process group already exists"):
        thd.init(
            HardwareAbstractionLayer(settings=NO_AUTOLOAD),
            device="cpu",
            rank=0,
            world_size=1,
            init_method=f"file://{rendezvous}",
            prefix="gen1",
        )
    assert not rendezvous.exists(), "the rendezvous ran before the refusal"
    _assert_group_untouched()


def test_a_prefix_over_an_existing_group_does_not_wait_for_absent_peers(own_group, monkeypatch):
    """Through env:// with a world of two and no peer, it waited in the rendezvous for the timeout."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    began = time.monotonic()
    with pytest.raises(ConfigurationError, match=r"a prefix applies only to a group torchhal makes"):
        thd.init(
            HardwareAbstractionLayer(settings=NO_AUTOLOAD),
            device="cpu",
            rank=0,
            world_size=2,
            prefix="gen2",
            timeout=timedelta(seconds=4),
        )
    assert time.monotonic() - began < 2
    _assert_group_untouched()
