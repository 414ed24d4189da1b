"""A data loader's position in checkpoints (`data=`), in one process: round trip, what a checkpoint
without it (or a load without it) does, integrity, bad loaders. Two gloo ranks, each with its own
data, are in test_accumulation_multiprocess.py."""

from __future__ import annotations

import io
import json
import random

import pytest
import torch

from tests.distributed.test_checkpoint import assert_restored, make, snapshot, step
from torchhal.distributed.checkpoint import MANIFEST, Checkpointer, CheckpointError, step_dir, verify
from torchhal.hal_core import InvalidArgumentError, telemetry

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Shuffled:
    """Batches of a fixed random set in a per-epoch shuffled order; its position is its state."""

    def __init__(self, seed: int, samples: int = 11) -> None:
        self.data = torch.randn(samples, 3, generator=torch.Generator().manual_seed(seed))
        self.seed, self.epoch, self.position = seed, 0, 0

    def next_batch(self) -> torch.Tensor:
        order = torch.randperm(
            len(self.data), generator=torch.Generator().manual_seed(self.seed + self.epoch)
        )
        batch = self.data[order[self.position]]
        self.position += 1
        if self.position == len(self.data):
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def test_a_loader_resumes_mid_epoch_at_the_exact_next_batch(tmp_path):
    seed, consumed = random.randrange(10**6), random.randint(1, 20)
    loader = Shuffled(seed)
    for _ in range(consumed):
        loader.next_batch()
    model, optimizer = make(1)
    step(model, optimizer)
    info = Checkpointer(tmp_path).save(1, model, optimizer, data=loader)
    assert info is not None and "data_rank0.pt" in json.loads((info.path / MANIFEST).read_text())["files"]
    expected = [loader.next_batch() for _ in range(15)]  # into the next epoch

    resumed = Shuffled(seed)
    resumed.next_batch()  # elsewhere: the load must move it
    other, other_optimizer = make(2)
    Checkpointer(tmp_path).load(other, other_optimizer, data=resumed)
    for index, want in enumerate(expected):
        assert torch.equal(resumed.next_batch(), want), index


def test_a_saved_position_loaded_without_a_loader_is_logged_and_counted(tmp_path):
    model, optimizer = make(1)
    step(model, optimizer)
    Checkpointer(tmp_path).save(1, model, optimizer, data=Shuffled(0))
    expected = snapshot(model, optimizer)
    key = "torchhal.checkpoint.data_not_restored"
    before = telemetry.counts().get(key, 0)
    stream = io.StringIO()
    telemetry.configure(log_level="warning", log_stream=stream)
    other, other_optimizer = make(2)
    assert Checkpointer(tmp_path).load(other, other_optimizer).step == 1
    assert_restored(other, other_optimizer, expected)  # the model still loads
    assert telemetry.counts()[key] == before + 1
    assert "data state not restored: load got no data=" in stream.getvalue()


def test_a_loader_given_to_load_a_checkpoint_without_positions_is_refused_before_loading(tmp_path):
    model, optimizer = make(1)
    step(model, optimizer)
    Checkpointer(tmp_path).save(1, model, optimizer)
    other, other_optimizer = make(2)
    step(other, other_optimizer)
    untouched = snapshot(other, other_optimizer)
    loader = Shuffled(3)
    loader.next_batch()
    with pytest.raises(
        CheckpointError, match=r"holds no data loader state \(none\): it was saved without data="
    ):
        Checkpointer(tmp_path).load(other, other_optimizer, data=loader)
    assert_restored(other, other_optimizer, untouched)
    assert loader.state_dict() == {"epoch": 0, "position": 1}


def test_an_edited_position_fails_the_checkpoints_hash(tmp_path):
    model, optimizer = make(1)
    Checkpointer(tmp_path).save(1, model, optimizer, data=Shuffled(0))
    file = step_dir(tmp_path, 1) / "data_rank0.pt"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"data_rank0\.pt has sha256"):
        verify(step_dir(tmp_path, 1))


class NoLoad:
    def state_dict(self) -> dict:
        return {}


class Opaque(Shuffled):
    def state_dict(self) -> dict:
        return {"sampler": object()}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            NoLoad(),
            r"data must have state_dict\(\) and load_state_dict\(\).*got NoLoad without load_state_dict",
        ),
        ([1, 2], r"got list without state_dict, load_state_dict"),
        (Opaque(0), r"state_dict\(\) of data \(Opaque\) cannot be saved and read back.*Unsupported global"),
    ],
)
def test_a_loader_whose_position_cannot_be_restored_fails_the_save_and_writes_nothing(
    tmp_path, data, message
):
    model, optimizer = make(1)
    with pytest.raises(InvalidArgumentError, match=message):
        Checkpointer(tmp_path).save(1, model, optimizer, data=data)
    assert list(tmp_path.iterdir()) == []


def test_load_refuses_a_loader_without_load_state_dict_before_loading(tmp_path):
    model, optimizer = make(1)
    Checkpointer(tmp_path).save(1, model, optimizer)
    with pytest.raises(InvalidArgumentError, match=r"Checkpointer\.load: data must have"):
        Checkpointer(tmp_path).load(model, optimizer, data=NoLoad())


def test_a_scaler_asked_of_a_checkpoint_saved_without_one_is_refused_before_loading(tmp_path):
    """It was DCP's "Missing key in checkpoint state_dict: scaler.scale" inside a CheckpointException
    (a BaseException, past `except Exception`), after get_state_dict had built the fresh optimizer's
    state; the check after the load that meant to say so could never run."""
    model, optimizer = make(1)
    step(model, optimizer)
    Checkpointer(tmp_path).save(1, model, optimizer)
    other, other_optimizer = make(2)
    untouched = snapshot(other, other_optimizer)
    with pytest.raises(CheckpointError, match=r"holds no gradient scaler state \(saved without scaler=\)"):
        Checkpointer(tmp_path).load(other, other_optimizer, scaler=torch.amp.GradScaler("cpu"))
    assert_restored(other, other_optimizer, untouched)
    disabled = torch.amp.GradScaler("cpu", enabled=False)  # holds no state, so asks for none
    assert Checkpointer(tmp_path).load(other, other_optimizer, scaler=disabled).step == 1
