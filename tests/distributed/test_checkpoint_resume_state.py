"""A resume holds what the run held, in one process: the hyperparameters of an optimizer without
state (SGD without momentum, its learning rate lowered by a scheduler), the state of an optimizer
some of whose parameters never had a gradient (an unused expert), or whose loading optimizer lacks
state the checkpoint holds; a load never steps the optimizer (its step hooks stay quiet); a
checkpoint of other dtypes is refused naming them; a checkpoint an interrupted commit left aside
is put back; and without a ctx the RNG of the device the model is on is checkpointed."""

from __future__ import annotations

import io
import random
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from torchhal.distributed import checkpoint
from torchhal.distributed.checkpoint import Checkpointer, CheckpointError, latest_valid, step_dir
from torchhal.hal_core import telemetry

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """The model's tensors, each parameter's optimizer state (by name) and the group values."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {
        names[id(p)]: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for p, s in optimizer.state.items()
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "state": state,
        "groups": groups,
    }


def assert_equal(a: object, b: object, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for key in a:
            assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def train(model: nn.Module, optimizer, steps: int, seed: int, scheduler=None, **forward) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, model.width, generator=generator)
        model(x, **forward).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


class Experts(nn.Module):
    """Two branches; `route` picks which run (a mixture of experts routing every token to some)."""

    def __init__(self, width: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.width = width
        self.a = nn.Linear(width, 3)
        self.b = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor, route: str = "ab") -> torch.Tensor:
        return sum(getattr(self, name)(x) for name in route)


# -- an optimizer without state keeps its hyperparameters --------------------------------------


def test_sgd_without_momentum_resumes_at_its_scheduled_learning_rate_and_hand_set_values(tmp_path):
    """SGD without momentum keeps no state, so it was saved as fresh with nothing of its groups: a
    resume restarted at the initial learning rate and lost a hand-set weight decay."""
    width, lr, gamma = random.randint(3, 6), random.uniform(0.05, 0.2), random.uniform(0.3, 0.8)
    model = Experts(width, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=gamma)
    steps = random.randint(2, 4)
    train(model, optimizer, steps, seed=3, scheduler=scheduler)
    optimizer.param_groups[0]["weight_decay"] = random.uniform(0.01, 0.1)
    assert not optimizer.state
    Checkpointer(tmp_path).save(steps, model, optimizer, scheduler=scheduler)
    expected = snapshot(model, optimizer)

    resumed = Experts(width, 2)
    resumed_optimizer = torch.optim.SGD(resumed.parameters(), lr=lr)
    resumed_scheduler = torch.optim.lr_scheduler.StepLR(resumed_optimizer, step_size=1, gamma=gamma)
    assert Checkpointer(tmp_path).load(resumed, resumed_optimizer, scheduler=resumed_scheduler).step == steps
    assert_equal(snapshot(resumed, resumed_optimizer), expected)
    train(model, optimizer, 3, seed=4, scheduler=scheduler)
    train(resumed, resumed_optimizer, 3, seed=4, scheduler=resumed_scheduler)
    assert_equal(snapshot(resumed, resumed_optimizer), snapshot(model, optimizer))


def test_a_fresh_checkpoint_of_an_earlier_version_still_loads_keeping_the_optimizers_values(
    tmp_path, monkeypatch
):
    """Checkpoints saved fresh before the groups were saved hold no hyperparameters: they load,
    the optimizer keeps its own, and that is logged and counted."""
    model = Experts(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=random.uniform(1e-3, 1e-2))

    def earlier(model, optimizer, scaler, step, *, fresh):
        return {
            "step": step,
            "model": checkpoint.get_model_state_dict(model),
            checkpoint.FRESH_OPTIMIZER: True,
        }

    monkeypatch.setattr(checkpoint, "_training_state", earlier)
    Checkpointer(tmp_path).save(0, model, optimizer)
    monkeypatch.undo()
    other = Experts(4, 2)
    other_optimizer = torch.optim.Adam(other.parameters(), lr=0.5)
    train(other, other_optimizer, 1, seed=5)
    key = "torchhal.checkpoint.hyperparameters_not_restored"
    before = telemetry.counts().get(key, 0)
    assert Checkpointer(tmp_path).load(other, other_optimizer).step == 0
    assert telemetry.counts().get(key, 0) == before + 1
    assert not other_optimizer.state and other_optimizer.param_groups[0]["lr"] == 0.5
    assert_equal(snapshot(other, other_optimizer)["model"], snapshot(model, optimizer)["model"])


# -- the state the checkpoint holds, no more and no less ----------------------------------------


def test_adam_with_a_parameter_that_never_had_a_gradient_resumes_as_the_run_went_on(tmp_path):
    """The save committed, and the load into a fresh Adam failed: 'Missing key ... step' for the
    parameter without state (torch's set_state_dict steps a fresh optimizer, giving every
    parameter state, and asks the checkpoint for all of it)."""
    width = random.randint(3, 6)
    model = Experts(width, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, optimizer, random.randint(1, 3), seed=6, route="a")  # b never had a gradient
    Checkpointer(tmp_path).save(1, model, optimizer)
    expected = snapshot(model, optimizer)
    assert set(expected["state"]) == {"a.weight", "a.bias"}

    resumed = Experts(width, 2)
    resumed_optimizer = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    Checkpointer(tmp_path).load(resumed, resumed_optimizer)
    assert_equal(snapshot(resumed, resumed_optimizer), expected)
    train(model, optimizer, 2, seed=7)  # now b is used too: its state starts where it would have
    train(resumed, resumed_optimizer, 2, seed=7)
    assert_equal(snapshot(resumed, resumed_optimizer), snapshot(model, optimizer))


def test_state_the_loading_optimizer_lacks_is_restored_from_the_checkpoint(tmp_path):
    """A rollback into an optimizer that had state for some parameters only: the load raised a raw
    RuntimeError ("Missing optimizer state ... in checkpoint", which it held) after the model
    had been loaded."""
    width = random.randint(3, 6)
    model = Experts(width, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, 2, seed=8)
    Checkpointer(tmp_path).save(2, model, optimizer)
    expected = snapshot(model, optimizer)

    rolled_back = Experts(width, 2)
    rolled_back_optimizer = torch.optim.AdamW(rolled_back.parameters(), lr=1e-2)
    train(rolled_back, rolled_back_optimizer, 3, seed=9, route="a")
    assert Checkpointer(tmp_path).load(rolled_back, rolled_back_optimizer).step == 2
    assert_equal(snapshot(rolled_back, rolled_back_optimizer), expected)
    train(model, optimizer, 2, seed=10)
    train(rolled_back, rolled_back_optimizer, 2, seed=10)
    assert_equal(snapshot(rolled_back, rolled_back_optimizer), snapshot(model, optimizer))


def test_state_for_parameters_the_optimizer_does_not_hold_is_refused_before_anything_changes(tmp_path):
    width = random.randint(3, 6)
    model = Experts(width, 1)
    optimizer = torch.optim.Adam(model.a.parameters(), lr=1e-2)
    train(model, optimizer, 1, seed=11)
    Checkpointer(tmp_path).save(1, model, optimizer)
    other = Experts(width, 2)
    other_optimizer = torch.optim.Adam(other.b.parameters(), lr=1e-2)  # as many, but others
    train(other, other_optimizer, 1, seed=12)
    before = snapshot(other, other_optimizer)
    with pytest.raises(
        CheckpointError,
        match=r"holds optimizer state for 2 parameter\(s\) the optimizer does not hold "
        r"\('a\.bias', 'a\.weight'\)",
    ):
        Checkpointer(tmp_path).load(other, other_optimizer)
    assert_equal(snapshot(other, other_optimizer), before)


def test_groups_holding_other_parameters_are_refused_naming_them_before_anything_changes(tmp_path):
    """Two groups of two parameters each, split by weights and biases when saved and by branches
    when loaded: torch matched them by name and gave one group the values of both, silently."""
    width = random.randint(3, 6)
    model = Experts(width, 1)
    by_kind = [
        {"params": [model.a.weight, model.b.weight], "weight_decay": 0.1},
        {"params": [model.a.bias, model.b.bias], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(by_kind, lr=1e-2)
    train(model, optimizer, 1, seed=13)
    Checkpointer(tmp_path).save(1, model, optimizer)
    other = Experts(width, 2)
    by_branch = torch.optim.AdamW(
        [{"params": other.a.parameters()}, {"params": other.b.parameters()}], lr=1e-2
    )
    before = snapshot(other, by_branch)
    with pytest.raises(
        CheckpointError,
        match=r"parameter group 0 holds \['a\.bias', 'a\.weight'\], which no saved group holds exactly "
        r"\(saved group 0 holds \['a\.weight', 'b\.weight'\]\)",
    ):
        Checkpointer(tmp_path).load(other, by_branch)
    assert_equal(snapshot(other, by_branch), before)


def test_state_of_another_optimizer_type_is_refused_naming_what_it_lacks_and_changes_nothing(tmp_path):
    model = Experts(4, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    train(model, sgd, 1, seed=14)
    Checkpointer(tmp_path).save(1, model, sgd)
    other = Experts(4, 2)
    adam = torch.optim.Adam(other.parameters())
    before = snapshot(other, adam)
    with pytest.raises(CheckpointError, match=r"lacks optimizer state this Adam keeps for 4 parameter\(s\)"):
        Checkpointer(tmp_path).load(other, adam)
    assert_equal(snapshot(other, adam), before)


def test_a_fresh_checkpoint_of_another_optimizer_type_is_refused_naming_the_hyperparameters(tmp_path):
    """A checkpoint without state holds the groups' hyperparameters: SGD's given to an Adam would
    leave it without betas, failing at its next step."""
    model = Experts(4, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, sgd, 1, seed=17)  # SGD without momentum keeps no state: saved fresh
    Checkpointer(tmp_path).save(1, model, sgd)
    other = Experts(4, 2)
    adam = torch.optim.Adam(other.parameters())
    train(other, adam, 1, seed=18)
    before = snapshot(other, adam)
    with pytest.raises(
        CheckpointError,
        match=r"saved with hyperparameters \['dampening', 'momentum', 'nesterov'\] this Adam does not "
        r"have, and without \['amsgrad', 'betas', ",
    ):
        Checkpointer(tmp_path).load(other, adam)
    assert_equal(snapshot(other, adam), before)


# -- a load never steps the optimizer ---------------------------------------------------------


def test_a_load_into_a_fresh_optimizer_runs_none_of_its_step_hooks(tmp_path):
    """torch's set_state_dict made a fresh optimizer's state by stepping it at learning rate 0:
    its post-step hook (an EMA's update) ran once during the load."""
    model = Experts(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, optimizer, 2, seed=15)
    Checkpointer(tmp_path).save(2, model, optimizer)
    resumed = Experts(4, 2)
    resumed_optimizer = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    ema = torch.optim.swa_utils.AveragedModel(
        resumed, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    )
    calls: list[str] = []
    resumed_optimizer.register_step_pre_hook(lambda *_: calls.append("pre"))
    resumed_optimizer.register_step_post_hook(
        lambda *_: (calls.append("post"), ema.update_parameters(resumed))
    )
    handle = register_optimizer_step_post_hook(lambda *_: calls.append("global"))
    try:
        Checkpointer(tmp_path).load(resumed, resumed_optimizer)
    finally:
        handle.remove()
    assert calls == [] and int(ema.n_averaged) == 0
    assert all(p.grad is None for p in resumed.parameters())
    assert_equal(snapshot(resumed, resumed_optimizer), snapshot(model, optimizer))


# -- dtypes ---------------------------------------------------------------------------------------


def test_a_checkpoint_of_other_dtypes_is_refused_naming_them_before_anything_changes(tmp_path):
    """An fp32 checkpoint loaded into a bf16 model rounded every weight, silently."""
    model = Experts(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, 1, seed=16)
    Checkpointer(tmp_path).save(1, model, optimizer)
    low = Experts(4, 2).to(torch.bfloat16)
    low_optimizer = torch.optim.AdamW(low.parameters(), lr=1e-2)
    before = snapshot(low, low_optimizer)
    with pytest.raises(
        CheckpointError,
        match=r"4 dtype\(s\) differ \('a\.bias': saved float32, model bfloat16; .*\); .*cast the model to "
        r"the checkpoint's dtypes before load",
    ):
        Checkpointer(tmp_path).load(low, low_optimizer)
    assert_equal(snapshot(low, low_optimizer), before)
    low.float()  # cast first, as the error says: it loads exactly
    Checkpointer(tmp_path).load(low, low_optimizer)
    assert_equal(snapshot(low, low_optimizer), snapshot(model, optimizer))


# -- a commit interrupted between its renames ---------------------------------------------------


def save_steps(directory: Path, steps: list[int], keep: int = 3) -> tuple[Checkpointer, nn.Module, object]:
    model = Experts(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpointer(directory, keep=keep)
    for n in steps:
        train(model, optimizer, 1, seed=n)
        ckpt.save(n, model, optimizer)
    return ckpt, model, optimizer


def interrupt_between_renames(directory: Path, step: int) -> None:
    """What a re-save of `step` leaves when it stops after moving the committed one aside: the
    committed checkpoint as `.step_<n>.replaced` and the new one, complete, still temporary."""
    final = step_dir(directory, step)
    shutil.copytree(final, directory / f".step_{step}.tmp")
    final.rename(directory / f".step_{step}.replaced")


def test_a_checkpoint_left_aside_by_an_interrupted_commit_is_found_and_put_back(tmp_path):
    save_steps(tmp_path, [1, 2])
    interrupt_between_renames(tmp_path, 2)
    key = "torchhal.checkpoint.replaced_recovered"
    before = telemetry.counts().get(key, 0)
    telemetry.configure(log_level="warning", log_stream=(stream := io.StringIO()))
    info = latest_valid(tmp_path)  # read-only: found where it lies (a rename could break a commit)
    assert info is not None and info.step == 2 and info.path == tmp_path / ".step_2.replaced"
    assert telemetry.counts().get(key, 0) == before
    model = Experts(3, 9)
    loaded = Checkpointer(tmp_path).load(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert loaded is not None and loaded.step == 2 and loaded.path == step_dir(tmp_path, 2)
    assert telemetry.counts().get(key, 0) == before + 1
    assert "put back" in stream.getvalue()
    assert not (tmp_path / ".step_2.replaced").exists()


def test_the_next_prune_puts_it_back_instead_of_deleting_it(tmp_path):
    ckpt, model, optimizer = save_steps(tmp_path, [1, 2, 3], keep=3)
    interrupt_between_renames(tmp_path, 3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    key = "torchhal.checkpoint.replaced_recovered"
    before = telemetry.counts().get(key, 0)
    train(model, optimizer, 1, seed=4)
    ckpt.save(4, model, optimizer)  # keep=3: steps 2, 3 and 4 stay
    assert telemetry.counts().get(key, 0) == before + 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".step_3.tmp")) == [
        "step_2",
        "step_3",
        "step_4",
    ]
    other = Experts(3, 9)
    Checkpointer(tmp_path).load(
        other, torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9), path=step_dir(tmp_path, 3)
    )
    assert_equal({k: v.clone() for k, v in other.state_dict().items()}, expected)


# -- the device RNG without a ctx --------------------------------------------------------------


class FakeGenerators:
    """A device module's generator calls (no accelerator here), recorded."""

    def __init__(self) -> None:
        self.state = torch.randint(0, 255, (16,), dtype=torch.uint8)
        self.calls: list[tuple] = []

    def get_rng_state(self, index=None) -> torch.Tensor:
        self.calls.append(("get", index))
        return self.state.clone()

    def set_rng_state(self, state: torch.Tensor, index=None) -> None:
        self.calls.append(("set", index))
        self.state = state.clone()


class OnDevice(Experts):
    """Tells the device choice (which reads `parameters()`) that it is on cuda:1; its tensors stay
    on the host, and the optimizer is made over `named_parameters()`."""

    def parameters(self, recurse: bool = True):
        for _ in super().parameters(recurse):
            yield Reported()


class Reported:
    device = torch.device("cuda", 1)


def test_without_a_ctx_the_rng_of_the_device_the_model_is_on_is_saved_and_restored(tmp_path, monkeypatch):
    """The docstring promised its device's RNG state; without a ctx none was saved."""
    fake = FakeGenerators()
    real = torch.get_device_module
    monkeypatch.setattr(torch, "get_device_module", lambda kind=None: fake if kind == "cuda" else real(kind))
    model, other = OnDevice(3, 1), OnDevice(3, 2)
    saved_state = fake.state.clone()
    Checkpointer(tmp_path).save(0, model, torch.optim.SGD([p for _, p in model.named_parameters()], lr=0.1))
    assert fake.calls == [("get", 1)]
    fake.state = torch.zeros(16, dtype=torch.uint8)  # the device's generator moved on
    Checkpointer(tmp_path).load(other, torch.optim.SGD([p for _, p in other.named_parameters()], lr=0.1))
    assert fake.calls[-1] == ("set", 1) and torch.equal(fake.state, saved_state)
