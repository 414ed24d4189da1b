"""A communicator that wraps a group ends with the group: once the owner destroys it, every call
fails as a call on a destroyed communicator does (a world of one rank in this process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import CollectiveError, InvalidArgumentError
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


def test_a_stale_owner_leaves_the_default_group_made_after_its_own(
    hal: HardwareAbstractionLayer, tmp_path: Path
) -> None:
    """Its group destroyed behind its back and another made, the first owner's destroy() tore
    down the new default group, which the second owner then found destroyed."""
    old = Communicator.create(hal, rank=0, world_size=1, init_method=(tmp_path / "rdv1").as_uri())
    dist.destroy_process_group()
    new = Communicator.create(hal, rank=0, world_size=1, init_method=(tmp_path / "rdv2").as_uri())
    old.destroy()
    assert dist.is_initialized()
    x = torch.rand(3) + 0.5
    torch.testing.assert_close(new.all_reduce(x.clone()), x, rtol=0, atol=0)
    new.destroy()
    assert not dist.is_initialized()


@pytest.fixture
def comm(hal: HardwareAbstractionLayer, tmp_path: Path) -> Iterator[Communicator]:
    owner = Communicator.create(hal, rank=0, world_size=1, init_method=(tmp_path / "rdv").as_uri())
    yield owner
    owner.destroy()


def _raising(message: str, error: type[Exception] = RuntimeError) -> Callable[..., object]:
    def issue(*args: object, **kwargs: object) -> object:
        raise error(message)

    return issue


@pytest.mark.parametrize(
    ("name", "patched", "call"),
    [
        ("send", "isend", lambda c, t: c.send(t, 0)),  # raw RuntimeError: issued outside any try
        ("recv", "irecv", lambda c, t: c.recv(t, 0)),
        ("broadcast", "broadcast", lambda c, t: c.broadcast(t, 0)),
        ("barrier", "barrier", lambda c, t: c.barrier()),
    ],
)
def test_a_collective_that_fails_as_it_is_issued_is_a_collective_error(
    comm: Communicator, monkeypatch: pytest.MonkeyPatch, name: str, patched: str, call: Callable[..., object]
) -> None:
    monkeypatch.setattr(comm, "_check_rank", lambda what, label, rank, peer=False: rank)  # a peer of itself
    monkeypatch.setattr(dist, patched, _raising("Connection closed by peer [127.0.0.1]:8626"))
    with pytest.raises(CollectiveError, match=rf"^{name} failed on rank 0 of 1 .*Connection closed by peer"):
        call(comm, torch.rand(3))


def test_only_a_backend_refusal_switches_a_collective_to_its_composed_form(
    comm: Communicator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any error at issue time (a mismatch TORCH_DISTRIBUTED_DEBUG=DETAIL detects, a dead peer)
    switched the communicator to the composed all_gather for good, and a reduce_scatter's
    mismatch was reported as an all_reduce's."""
    fused = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real = getattr(dist, fused)
    monkeypatch.setattr(dist, fused, _raising("Detected mismatch between collectives on ranks"))
    x = torch.rand(2, 3)
    with pytest.raises(CollectiveError, match=r"^all_gather failed .*Detected mismatch"):
        comm.all_gather(x)
    assert comm._refused == {}
    monkeypatch.setattr(dist, fused, real)
    torch.testing.assert_close(comm.all_gather(x), x, rtol=0, atol=0)
    monkeypatch.setattr(dist, fused, _raising("ProcessGroupX does not support all_gather_into_tensor"))
    torch.testing.assert_close(comm.all_gather(x), x, rtol=0, atol=0)  # composed, and said so
    assert "does not support" in comm._refused["all_gather"]


def test_a_coalescing_block_refuses_what_it_would_get_wrong(
    comm: Communicator, hal: HardwareAbstractionLayer
) -> None:
    """torch reduces every tensor of a block with the first one's op (a sum after an avg came back
    averaged); the composed avg and the other collectives cannot be recorded (their async
    handles raised on wait and left the group recording, so later all-reduces did nothing)."""
    coalescing = dist.distributed_c10d._coalescing_manager
    composed = Communicator.create(hal, fused=False)
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: (comm.all_reduce(torch.rand(3), op="avg"), comm.all_reduce(torch.rand(2))), "reduces with"),
        (lambda: composed.all_reduce(torch.rand(3), op="avg"), "needs backend 'gloo''s own AVG"),
        (lambda: comm.all_gather(torch.rand(3)), "coalesces all_reduce only"),
    ]
    for record, refusal in cases:
        with pytest.raises(InvalidArgumentError, match=refusal), coalescing(group=comm.group):
            record()
        dist.distributed_c10d._world.pg_coalesce_state.pop(comm.group, None)  # torch leaves it on a raise
    x, y = torch.rand(4), torch.rand(2)
    with coalescing(group=comm.group):
        comm.all_reduce(xs := x.clone(), op="max")
        comm.all_reduce(ys := y.clone(), op="max")
        # collectives torch issues at once, not recorded, work there as before
        torch.testing.assert_close(comm.reduce(x.clone(), 0), x, rtol=0, atol=0)
        torch.testing.assert_close(comm.all_to_all(x.clone()), x, rtol=0, atol=0)
    torch.testing.assert_close((xs, ys), (x, y), rtol=0, atol=0)
