"""What saving and loading must never do to a run, in one process: a save before the first step
changes nothing (torch's get_state_dict would step the optimizer to make its state), a failed
re-save of a step keeps the committed one, DCP's failures are CheckpointErrors naming the step and
the rank's error, and a load refused or failed late leaves the model, a fresh optimizer and the
loader as they were; states a load cannot apply (scaler not asked for, RNG of another device
type) are logged and counted."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from torch import nn

from tests.distributed.test_checkpoint import make, step
from tests.distributed.test_checkpoint_data import Shuffled
from torchhal.distributed import checkpoint
from torchhal.distributed.checkpoint import Checkpointer, CheckpointError, latest_valid
from torchhal.hal_core import telemetry

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run(tmp_path: Path | None, optimizer_class, steps: int = 4) -> dict[str, torch.Tensor]:
    model, _ = make(3)
    optimizer = optimizer_class(model.parameters(), lr=1e-2)
    hooked = []
    optimizer.register_step_post_hook(lambda *_: hooked.append(1))
    if tmp_path is not None:
        Checkpointer(tmp_path).save(0, model, optimizer)
        assert not optimizer.state and not hooked  # still fresh, no step hook ran
    torch.manual_seed(7)
    for _ in range(steps):
        step(model, optimizer)
    assert len(hooked) == steps
    return params(model)


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.Rprop], ids=["adam", "rprop"])
def test_a_save_before_the_first_step_changes_nothing_and_loads_fresh(tmp_path, optimizer_class):
    assert_same(run(tmp_path, optimizer_class), run(None, optimizer_class))
    model, optimizer = make(5)
    optimizer = optimizer_class(model.parameters(), lr=1e-2)
    step(model, optimizer)  # a stepped optimizer, loaded from a fresh checkpoint, is fresh again
    assert Checkpointer(tmp_path).load(model, optimizer).step == 0
    saved, _ = make(3)
    assert_same(params(model), params(saved))
    assert not optimizer.state


def test_a_failed_resave_of_a_step_keeps_the_committed_checkpoint(tmp_path, monkeypatch):
    model, optimizer = make(1)
    step(model, optimizer)
    Checkpointer(tmp_path).save(1, model, optimizer)
    rename = Path.rename

    def failing(self, target):
        if self.name == ".step_1.tmp":
            raise OSError(28, "No space left on device (raised on purpose, in this test)")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing)
    with pytest.raises(OSError, match="on purpose"):
        Checkpointer(tmp_path).save(1, model, optimizer)
    monkeypatch.undo()
    assert latest_valid(tmp_path).step == 1


def test_a_failed_async_write_is_a_checkpoint_error_naming_the_step_and_the_ranks_error(
    tmp_path, monkeypatch
):
    model, optimizer = make(1)
    step(model, optimizer)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, model, optimizer)

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device (raised on purpose, in this test)")

    monkeypatch.setattr(dcp_filesystem.FileSystemWriter, "write_data", failing)
    with pytest.raises(CheckpointError, match=r"step 2 .* rank 0: OSError: .*on purpose") as err:
        ckpt.save(2, model, optimizer, blocking=False)
        ckpt.wait()
    assert isinstance(err.value, Exception)  # DCP's own CheckpointException is not
    monkeypatch.undo()
    assert latest_valid(tmp_path).step == 1


def two_groups(model: nn.Module) -> torch.optim.Optimizer:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW(
        [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]
    )


def test_another_parameter_group_layout_is_refused_before_loading(tmp_path):
    model, _ = make(1)
    optimizer = two_groups(model)
    step(model, optimizer)
    Checkpointer(tmp_path).save(1, model, optimizer)
    other, one_group = make(2)
    before = params(other)
    with pytest.raises(
        CheckpointError, match=r"parameter groups hold \[2, 2\] parameters, the optimizer's \[4\]"
    ):
        Checkpointer(tmp_path).load(other, one_group)
    assert_same(params(other), before)
    assert not one_group.state


def test_another_optimizer_type_is_a_checkpoint_error_and_leaves_a_fresh_optimizer_fresh(tmp_path):
    model, _ = make(1)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    step(model, sgd)
    Checkpointer(tmp_path).save(1, model, sgd)
    other, adam = make(2)
    with pytest.raises(
        CheckpointError, match=r"load of 1 at .* rank 0: RuntimeError: Missing key .*optimizer\.state\."
    ):
        Checkpointer(tmp_path).load(other, adam)
    assert not adam.state


def test_a_loader_that_refuses_its_state_leaves_everything_as_it_was(tmp_path):
    model, optimizer = make(1)
    step(model, optimizer)
    Checkpointer(tmp_path).save(1, model, optimizer, data=Shuffled(seed=4))

    class Refusing(Shuffled):
        def load_state_dict(self, state: dict) -> None:
            raise ValueError("the dataset changed size (raised on purpose, in this test)")

    other, fresh = make(2)
    loader = Refusing(seed=9)
    loader.next_batch()
    before, position = params(other), copy.deepcopy(loader.state_dict())
    with pytest.raises(ValueError, match="on purpose"):
        Checkpointer(tmp_path).load(other, fresh, data=loader)
    assert_same(params(other), before)
    assert not fresh.state and loader.state_dict() == position


def test_a_saved_scaler_state_load_is_not_given_is_logged_and_counted(tmp_path):
    model, optimizer = make(1)
    step(model, optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    Checkpointer(tmp_path).save(1, model, optimizer, scaler=scaler)
    key = "torchhal.checkpoint.scaler_not_restored"
    before = telemetry.counts().get(key, 0)
    Checkpointer(tmp_path).load(*make(2))
    assert telemetry.counts().get(key, 0) == before + 1


def test_rng_states_of_another_device_type_are_not_restored_and_the_rest_loads(tmp_path, monkeypatch):
    model, optimizer = make(1)
    step(model, optimizer)
    host_only = checkpoint.rng_state
    monkeypatch.setattr(checkpoint, "rng_state", lambda device: {**host_only(device), "device_type": "cuda"})
    Checkpointer(tmp_path).save(1, model, optimizer)  # as a GPU run saves it
    monkeypatch.undo()
    key = "torchhal.checkpoint.rng_not_restored"
    other, adam = make(2)
    before, generator = telemetry.counts().get(key, 0), torch.get_rng_state()
    assert Checkpointer(tmp_path).load(other, adam).step == 1
    assert telemetry.counts().get(key, 0) == before + 1 and torch.equal(torch.get_rng_state(), generator)
    assert_same(params(other), params(model))


def warmup(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 6))


def test_a_resume_mid_warmup_continues_the_schedule_as_an_uninterrupted_run(tmp_path):
    def train(model, optimizer, scheduler, steps):
        for _ in range(steps):
            step(model, optimizer)
            scheduler.step()

    model, optimizer = make(1)
    scheduler = warmup(optimizer)
    torch.manual_seed(11)
    train(model, optimizer, scheduler, 3)
    Checkpointer(tmp_path).save(3, model, optimizer, scheduler=scheduler)
    train(model, optimizer, scheduler, 4)
    resumed, resumed_optimizer = make(2)
    resumed_scheduler = warmup(resumed_optimizer)
    assert Checkpointer(tmp_path).load(resumed, resumed_optimizer, scheduler=resumed_scheduler).step == 3
    train(resumed, resumed_optimizer, resumed_scheduler, 4)  # the RNG was restored to step 3's too
    assert_same(params(resumed), params(model))
    assert resumed_scheduler.get_last_lr() == scheduler.get_last_lr()


def test_a_scheduler_asked_of_a_checkpoint_without_one_is_refused_and_one_not_asked_is_counted(tmp_path):
    model, optimizer = make(1)
    step(model, optimizer)
    Checkpointer(tmp_path / "without").save(1, model, optimizer)
    other, other_optimizer = make(2)
    before = params(other)
    with pytest.raises(CheckpointError, match="holds no learning-rate scheduler state"):
        Checkpointer(tmp_path / "without").load(other, other_optimizer, scheduler=warmup(other_optimizer))
    assert_same(params(other), before)
    Checkpointer(tmp_path / "with").save(1, model, optimizer, scheduler=warmup(optimizer))
    key = "torchhal.checkpoint.scheduler_not_restored"
    count = telemetry.counts().get(key, 0)
    Checkpointer(tmp_path / "with").load(other, other_optimizer)
    assert telemetry.counts().get(key, 0) == count + 1
