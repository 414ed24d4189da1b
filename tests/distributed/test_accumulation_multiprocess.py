"""Gradient accumulation under DDP and FSDP2, and data positions in checkpoints, on 2 gloo CPU ranks.

The checks run in one world of processes (`_accum_worker.py`); each is reported here as its own test.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.distributed.launch import check_outcome, run_world
from torchhal.distributed.checkpoint import Checkpointer, CheckpointError, latest_valid

WORKER = Path(__file__).with_name("_accum_worker.py")
pytestmark = pytest.mark.multiprocess


def load_worker():
    """The worker script as a module (its scenarios' check names, its helpers)."""
    spec = importlib.util.spec_from_file_location("torchhal_accum_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_names() -> list[str]:
    return load_worker().check_names("accumulate")


@pytest.fixture(scope="module")
def accumulate_world(tmp_path_factory):
    out = tmp_path_factory.mktemp("accumulate")
    return run_world(WORKER, "accumulate", 2, out), out


@pytest.mark.parametrize("name", _check_names())
def test_accumulate_world(accumulate_world, name):
    (results, seed), _ = accumulate_world
    check_outcome(results, seed, name)


def test_data_states_saved_by_two_ranks_do_not_load_into_one(accumulate_world):
    """Each rank's loader position belongs to its rank: one process cannot take them over, and is
    refused before anything is loaded; without data= the model alone loads."""
    _, out = accumulate_world
    info = latest_valid(out / "data_ckpt")
    assert info is not None and info.world_size == 2
    assert {"data_rank0.pt", "data_rank1.pt"} <= {p.name for p in info.path.iterdir()}
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"belong to the 2 ranks that saved them, and this job has 1"):
        Checkpointer(out / "data_ckpt").load(
            model, torch.optim.SGD(model.parameters(), lr=0.1), data=_Inert()
        )
    assert torch.equal(model.weight, before)


class _Inert:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        raise AssertionError("nothing may be loaded")
