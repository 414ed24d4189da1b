"""Ranks given to a Communicator (src, dst, new_group's ranks, create's rank and world_size).

Integers of any type are taken (numpy's too, through operator.index) and bools are refused, as
Communicator.create refuses them. Validation runs before anything is communicated, so a world of
one rank in this process shows every case.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import InvalidArgumentError
from torchhal.hal_core.collectives import Communicator


@pytest.fixture
def url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A file:// rendezvous for a one-rank world, in a process with no default group."""
    if dist.is_initialized():
        pytest.skip("another test left a default process group in this process; these tests need none")
    monkeypatch.setenv("TORCHHAL_DISABLE_PLUGIN_AUTOLOAD", "1")
    return (tmp_path / "rendezvous").as_uri()


@pytest.fixture
def comm(url: str) -> Iterator[Communicator]:
    with Communicator.create(HardwareAbstractionLayer(), rank=0, world_size=1, init_method=url) as made:
        yield made


def test_create_takes_numpy_integers(url: str) -> None:
    hal = HardwareAbstractionLayer()
    with Communicator.create(hal, rank=np.int64(0), world_size=np.int32(1), init_method=url) as made:
        assert (made.rank, made.world_size) == (0, 1)
        assert type(dist.get_world_size()) is int


def test_numpy_integer_ranks_are_taken(comm: Communicator) -> None:
    assert (comm.rank, comm.world_size) == (0, 1)
    x = torch.rand(4, 3) + 0.5
    t = x.clone()
    assert comm.broadcast(t, src=np.int64(0)) is t
    torch.testing.assert_close(t, x, rtol=0, atol=0)
    comm.reduce(t, dst=np.int32(0), op="max")
    torch.testing.assert_close(t, x, rtol=0, atol=0)
    sub = comm.new_group(np.array([0]))
    assert sub is not None and sub.world_size == 1
    torch.testing.assert_close(sub.all_reduce(t), x, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c, t: c.broadcast(t, src=False), r"broadcast: src must be an integer rank, got bool False"),
        (lambda c, t: c.reduce(t, dst=True), r"reduce: dst must be an integer rank, got bool True"),
        (
            lambda c, t: c.reduce(t, dst=torch.tensor(False)),
            r"reduce: dst must be an integer rank, got Tensor tensor\(False\)",
        ),
        (lambda c, t: c.broadcast(t, src=0.0), r"broadcast: src must be an integer rank, got float 0.0"),
        (lambda c, t: c.broadcast(t, src="0"), r"broadcast: src must be an integer rank, got str '0'"),
        (lambda c, t: c.broadcast(t, src=np.int64(1)), r"broadcast: src must be a rank in \[0, 1\), got 1"),
        (
            lambda c, t: c.new_group([False]),
            r"new_group: every entry of ranks must be an integer rank, got bool False",
        ),
        (
            lambda c, t: c.new_group("0"),
            r"new_group: ranks must be an iterable of integer ranks, got str '0'",
        ),
        (lambda c, t: c.new_group(0), r"new_group: ranks must be an iterable of integer ranks, got int 0"),
        (
            lambda c, t: c.new_group(iter([0, 0])),
            r"new_group: ranks must be distinct and non-empty, got \[0, 0\]",
        ),
        (
            lambda c, t: c.new_group(r for r in ()),
            r"new_group: ranks must be distinct and non-empty, got \[\]",
        ),
    ],
    ids=[
        "src-bool",
        "dst-bool",
        "dst-bool-tensor",
        "src-float",
        "src-str",
        "src-numpy-out-of-range",
        "new_group-bool",
        "new_group-str",
        "new_group-int",
        "new_group-iterator-repeats",
        "new_group-empty-generator",
    ],
)
def test_bad_ranks_are_refused_by_name(comm: Communicator, call, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        call(comm, torch.rand(3) + 0.5)


def test_new_group_takes_a_generator(comm: Communicator) -> None:
    sub = comm.new_group(r for r in range(comm.world_size))
    assert sub is not None and (sub.rank, sub.world_size) == (0, 1)
    x = torch.rand(5) + 0.5
    torch.testing.assert_close(sub.all_reduce(x.clone(), op="sum"), x, rtol=0, atol=0)
