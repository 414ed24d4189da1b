"""A communicator that wraps a group ends with the group: once the owner destroys it, every call
fails as a call on a destroyed communicator does (a world of one rank in this process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import CollectiveError
from torchhal.hal_core.collectives import Communicator

CALLS: dict[str, Callable[[Communicator, torch.Tensor], object]] = {
    "all_reduce": lambda c, t: c.all_reduce(t),
    "broadcast": lambda c, t: c.broadcast(t, src=0),
    "all_gather": lambda c, t: c.all_gather(t),
    "barrier": lambda c, t: c.barrier(),
    "new_group": lambda c, t: c.new_group([0]),
    "islands": lambda c, t: c.islands(),
}


@pytest.fixture
def hal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HardwareAbstractionLayer]:
    if dist.is_initialized():
        pytest.skip("another test left a default process group in this process; these tests need none")
    monkeypatch.setenv("TORCHHAL_DISABLE_PLUGIN_AUTOLOAD", "1")
    yield HardwareAbstractionLayer()
    if dist.is_initialized():
        dist.destroy_process_group()


def _assert_destroyed(comm: Communicator) -> None:
    for name, call in CALLS.items():
        with pytest.raises(CollectiveError, match=rf"^{name}: this communicator was destroyed$"):
            call(comm, torch.rand(3) + 0.5)


def test_wrappers_of_the_default_group_end_with_their_owner(
    hal: HardwareAbstractionLayer, tmp_path: Path
) -> None:
    owner = Communicator.create(hal, rank=0, world_size=1, init_method=(tmp_path / "rdv").as_uri())
    wrapper = Communicator.create(hal)
    made_by_wrapper = wrapper.new_group([0])
    assert made_by_wrapper is not None
    x = torch.rand(4, 3) + 0.5
    torch.testing.assert_close(wrapper.all_reduce(x.clone()), x, rtol=0, atol=0)
    owner.destroy()
    assert not dist.is_initialized()
    _assert_destroyed(wrapper)
    _assert_destroyed(made_by_wrapper)


def test_wrappers_of_a_subgroup_end_with_it_and_the_rest_goes_on(
    hal: HardwareAbstractionLayer, tmp_path: Path
) -> None:
    owner = Communicator.create(hal, rank=0, world_size=1, init_method=(tmp_path / "rdv").as_uri())
    sub = owner.new_group([0])
    assert sub is not None
    wrapper = Communicator.create(hal, group=sub.group)
    sub.destroy()
    _assert_destroyed(wrapper)
    x = torch.rand(5) + 0.5
    torch.testing.assert_close(owner.all_reduce(x.clone()), x, rtol=0, atol=0)
    owner.destroy()
    assert not dist.is_initialized()
