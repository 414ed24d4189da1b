"""One rank of the checkpoint checks where rank 0 alone acts on the shared directory (world 2,
CPU, gloo): a load of a checkpoint rank 0 finds incomplete, and a commit whose rename fails on
rank 0 (a full disk), fail on every rank at once with a CheckpointError naming the cause, where
the other rank waited for the group's timeout and got gloo's "Timed out ... recv"; the group
still works after, and the committed checkpoints are as they were.

Run as a script by test_checkpoint_ranks_fail_together.py, through `_worker.main` (same
arguments, same result files); this module adds the scenario "ranks_fail_together".
"""

from __future__ import annotations

import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchhal import distributed as thd
from torchhal.distributed import checkpoint
from torchhal.distributed.checkpoint import MANIFEST, Checkpointer, CheckpointError, latest_valid, step_dir

try:  # imported by a test: the checkout's root is on the path
    from tests.distributed import _worker as w
except ImportError:  # run as a script: its own directory is the path's first entry
    import _worker as w  # type: ignore[no-redef]
QUICK_S = w.TIMEOUT.total_seconds() / 2  # a failure told at once, not found by the timeout


def check_init(state: Any) -> None:
    store = dist.FileStore(str(state.out / "store"), state.world)
    state._ctx = thd.init(
        device="cpu", rank=state.rank, world_size=state.world, store=store, timeout=w.TIMEOUT
    )


def trained(state: Any, tag: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same model and optimizer on every rank, one Adam step from random values."""
    torch.manual_seed(zlib.crc32(f"{state.seed}:{tag}".encode()))
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(5, 6)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_a_checkpoint_rank_0_finds_incomplete_fails_the_load_on_every_rank_at_once(state: Any) -> None:
    directory = state.out / "incomplete"
    ckpt = Checkpointer(directory, state.ctx)
    model, optimizer = trained(state, "saved")
    ckpt.save(1, model, optimizer)
    dist.barrier()
    if state.rank == 0:
        (step_dir(directory, 1) / MANIFEST).unlink()  # as a crash before the manifest leaves it
    dist.barrier()
    other, other_optimizer = trained(state, "other")
    before = values(other)
    began = time.monotonic()
    try:
        ckpt.load(other, other_optimizer, path=step_dir(directory, 1))
    except CheckpointError as exc:
        message = str(exc)
    else:
        raise AssertionError("the load of an incomplete checkpoint went through")
    assert time.monotonic() - began < QUICK_S, "the error waited on the timeout"
    assert "failed on rank 0" in message and f"{MANIFEST} (incomplete)" in message, message
    assert all(torch.equal(v, before[k]) for k, v in values(other).items())
    ckpt.close()


def check_a_commit_that_fails_on_rank_0_fails_the_save_on_every_rank_at_once(state: Any) -> None:
    directory = state.out / "commit"
    ckpt = Checkpointer(directory, state.ctx)
    model, optimizer = trained(state, "commit")
    ckpt.save(1, model, optimizer)
    rename = checkpoint._rename_replacing

    def full_disk(tmp: Path, final: Path) -> None:
        raise OSError(28, "No space left on device (raised on purpose, in this test)")

    if state.rank == 0:
        checkpoint._rename_replacing = full_disk
    began = time.monotonic()
    try:
        ckpt.save(2, model, optimizer)
    except CheckpointError as exc:
        error: BaseException = exc
    else:
        raise AssertionError("the save whose commit failed went through")
    finally:
        checkpoint._rename_replacing = rename
    assert time.monotonic() - began < QUICK_S, "the error waited on the timeout"
    assert isinstance(error, OSError), type(error)  # `except OSError` still catches a full disk
    message = str(error)
    assert "commit of the checkpoint of step 2" in message and "No space left on device" in message, message
    info = latest_valid(directory)
    assert info is not None and info.step == 1
    assert ckpt.save(3, model, optimizer).step == 3  # the group goes on working
    ckpt.close()


w.SCENARIOS["ranks_fail_together"] = [
    check_init,
    check_a_checkpoint_rank_0_finds_incomplete_fails_the_load_on_every_rank_at_once,
    check_a_commit_that_fails_on_rank_0_fails_the_save_on_every_rank_at_once,
]
check_names = w.check_names

if __name__ == "__main__":
    w.main()
