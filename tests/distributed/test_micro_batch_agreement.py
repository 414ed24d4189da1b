"""The agreement before each micro-batch (`_MicroBatches`): each rank's value carries its code and
its place in the `train` call, and must stay exact where a group gathers on its device in fp32."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from torchhal.distributed.loop import _MicroBatches
from torchhal.hal_core import CollectiveError


def world(*shifts: int):
    """A DistContext stand-in of len(shifts) ranks whose host_all_gather goes through fp32 (as a
    group without a host backend gathers on its device); rank r reports this rank's value moved
    by shifts[r] places."""

    def gather(value: float) -> list[float]:
        return [float(torch.tensor(value + 4 * shift, dtype=torch.float32)) for shift in shifts]

    return SimpleNamespace(communicator=SimpleNamespace(host_all_gather=gather))


@pytest.mark.parametrize("done", [0, 2**21, 2**22, 2**22 + 1, 3 * 2**22 + 5])
def test_a_long_call_still_agrees_through_an_fp32_gather(done):
    """Fails before: past 2**22 micro-batches in one call the place no longer fit fp32, a rank
    that had its batch decoded as one that ran out, and the run stopped."""
    feed = _MicroBatches(iter([("batch",)]), world(0, 0), 1, True, done, done + 1)
    feed.fetch_first()
    assert feed.take(0) == ("batch",)


@pytest.mark.parametrize(("done", "shift"), [(0, 1), (5, -1), (2**22 + 3, 2)])
def test_ranks_at_different_places_are_told_where_the_others_are(done, shift):
    feed = _MicroBatches(iter([("batch",)]), world(0, shift), 1, True, done, done + 5)
    with pytest.raises(
        CollectiveError, match=rf"ranks out of step: rank\(s\) \[1\] at step {done + shift} micro-batch 0"
    ):
        feed.fetch_first()
