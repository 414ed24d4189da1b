"""A step that stops after its micro-batches (in grad_sync, clipping or the optimizer's step)
leaves the model, the optimizer and the gradient scaler as the step found them, so that the
step can be run again: retried, the run equals one that never stopped."""

from __future__ import annotations

import copy
import io
import random
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from tests.distributed.test_grad_accumulation import (
    DIM,
    Normed,
    assert_same_buffers,
    assert_same_parameters,
    micro_batches,
    seeded,
    sgd,
    train_prepared,
)
from torchhal import distributed as thd
from torchhal.hal_core import InvalidArgumentError, telemetry

STEPS, K = 3, 2


class Failure(RuntimeError):
    """The error a test injects."""


def failing_on_call(n: int, then: Callable[..., object]) -> Callable[..., object]:
    """`then`, except that its `n`th call raises Failure."""
    calls = []

    def call(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == n:
            raise Failure(f"call {n} fails")
        return then(*args, **kwargs)

    return call


class SGDFailingOnce(torch.optim.SGD):
    """SGD whose second step raises before it updates anything (inside torch's step wrapper, as
    an optimizer's own failure is: after its step pre-hooks)."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.1, momentum=0.9)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls == 2:
            raise Failure("call 2 fails")
        return super().step(closure)


def train_on(prepared: thd.Prepared, ctx, data, steps: int, k: int = K, **options) -> None:
    train_prepared(ctx, prepared, data, steps, gradient_accumulation_steps=k, **options)


CLIPPED = {"clip_grad_norm": 50.0}
"""Clipping unscales the gradients before the optimizer's step (GradScaler's record of it)."""


def scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10)


@pytest.mark.parametrize("where", ["grad_sync", "clip", "optimizer"])
def test_a_step_stopped_after_its_micro_batches_can_be_run_again(ctx, monkeypatch, where):
    """The second step fails after both micro-batches ran forward and backward; it is then run
    again with the same batches, and the third after it: the model equals one trained without
    the failure. Fails before: the failed step's gradients stayed in .grad (doubling the
    retried step's) and its forwards in BatchNorm's statistics; after clipping had unscaled,
    the retry's unscale_ raised."""
    seed = random.randrange(2**31)
    data = micro_batches(STEPS, K, 4)
    options: dict[str, object] = {}
    make_optimizer = SGDFailingOnce if where == "optimizer" else sgd
    if where == "grad_sync":
        options["grad_sync"] = failing_on_call(2, lambda model: None)
    prepared = thd.prepare(seeded(Normed, seed), make_optimizer, ctx=ctx, strategy="local")
    shared = scaler()
    if where == "clip":
        monkeypatch.setattr(
            torch.nn.utils, "clip_grad_norm_", failing_on_call(2, torch.nn.utils.clip_grad_norm_)
        )
    stream = io.StringIO()
    telemetry.configure(log_level="warning", log_stream=stream)
    partial = telemetry.counts().get("torchhal.train.partial_optimizer_steps", 0)
    with pytest.raises(Failure):
        train_on(prepared, ctx, data, STEPS, scaler=shared, **CLIPPED, **options)
    assert all(p.grad is None for p in prepared.model.parameters())
    assert "step stopped; its accumulated gradients were dropped" in stream.getvalue()
    told = telemetry.counts().get("torchhal.train.partial_optimizer_steps", 0) - partial
    assert told == (1 if where == "optimizer" else 0)
    assert ("may be partly updated" in stream.getvalue()) == (where == "optimizer")

    train_on(
        prepared, ctx, data[K:], STEPS - 1, scaler=shared, **CLIPPED, **options
    )  # the failed step again, then the last
    reference, its_scaler = thd.prepare(seeded(Normed, seed), sgd, ctx=ctx, strategy="local"), scaler()
    train_on(reference, ctx, data, STEPS, scaler=its_scaler, **CLIPPED)
    assert_same_buffers(prepared.model, reference.model)
    assert_same_parameters(prepared.model, reference.model)
    assert shared.state_dict() == its_scaler.state_dict()  # the growth tracker too: the step never happened


class ScalerFailingUpdateOnce(torch.amp.GradScaler):
    """GradScaler whose second update() raises before it changes anything."""

    def __init__(self) -> None:
        super().__init__("cpu", init_scale=2.0**10)
        self.calls = 0

    def update(self, new_scale=None):
        self.calls += 1
        if self.calls == 2:
            raise Failure("update 2 fails")
        super().update(new_scale)


def test_a_scaler_update_that_raises_leaves_its_step_taken_and_the_next_call_clean(ctx):
    """The second step's optimizer update is done when the scaler's update() raises: the step
    stands, its gradients are dropped and the scaler's record of it cleared, so training goes on
    from the third step and equals a run without the failure. Fails before: the next train call
    raised on the scaler's record ("unscale_() is being called after step()": it clips)."""
    seed = random.randrange(2**31)
    data = micro_batches(STEPS, K, 4)
    prepared = thd.prepare(seeded(Normed, seed), sgd, ctx=ctx, strategy="local")
    shared = ScalerFailingUpdateOnce()
    failures = telemetry.counts().get("torchhal.train.scaler_update_failures", 0)
    with pytest.raises(Failure):
        train_on(prepared, ctx, data, STEPS, scaler=shared, **CLIPPED)
    assert telemetry.counts().get("torchhal.train.scaler_update_failures", 0) == failures + 1
    assert all(p.grad is None for p in prepared.model.parameters())
    train_on(prepared, ctx, data[2 * K :], STEPS - 2, scaler=shared, **CLIPPED)
    reference, its_scaler = thd.prepare(seeded(Normed, seed), sgd, ctx=ctx, strategy="local"), scaler()
    train_on(reference, ctx, data, STEPS, scaler=its_scaler, **CLIPPED)
    assert_same_buffers(prepared.model, reference.model)
    assert_same_parameters(prepared.model, reference.model)
    assert shared.get_scale() == its_scaler.get_scale()


class FusedAdamFailingOnce(torch.optim.Adam):
    """Fused Adam (it unscales inside its own step, from the `grad_scale` GradScaler sets on it)
    whose second step raises before it updates anything."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=1e-2, fused=True)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls == 2:
            raise Failure("call 2 fails")
        return super().step(closure)


def test_an_optimizer_that_unscales_in_its_step_is_not_left_the_scalers_attributes(ctx):
    """GradScaler sets `grad_scale` on a fused optimizer for its step and deletes it after; the
    step raised, so it stayed. Fails before: the retried step took the scale times the stale
    `grad_scale` as its scale, unscaling the gradients by the scale squared."""
    seed = random.randrange(2**31)
    data = micro_batches(STEPS, K, 4)
    prepared = thd.prepare(seeded(Normed, seed), FusedAdamFailingOnce, ctx=ctx, strategy="local")
    shared = scaler()
    with pytest.raises(Failure):
        train_on(prepared, ctx, data, STEPS, scaler=shared)
    assert not hasattr(prepared.optimizer, "grad_scale")
    assert not hasattr(prepared.optimizer, "found_inf")
    train_on(prepared, ctx, data[K:], STEPS - 1, scaler=shared)
    reference = thd.prepare(
        seeded(Normed, seed), lambda p: torch.optim.Adam(p, lr=1e-2, fused=True), ctx=ctx, strategy="local"
    )
    train_on(reference, ctx, data, STEPS, scaler=scaler())
    assert_same_buffers(prepared.model, reference.model)
    assert_same_parameters(prepared.model, reference.model)


def test_a_stopped_step_with_a_scaler_can_be_checkpointed(ctx, monkeypatch):
    """GradScaler refuses to be pickled while it holds a step's record; a step stopped after
    unscale_ drops it. Fails before: the scaler kept the stopped step's record, and pickling it
    raised."""
    prepared = thd.prepare(Normed(), sgd, ctx=ctx, strategy="local")
    shared = scaler()
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", failing_on_call(1, torch.nn.utils.clip_grad_norm_))
    with pytest.raises(Failure):
        train_on(prepared, ctx, micro_batches(STEPS, K, 4), STEPS, scaler=shared, **CLIPPED)
    again = copy.deepcopy(shared)  # deepcopy pickles through __getstate__
    assert again.get_scale() == shared.get_scale()


def test_a_step_the_scaler_refuses_is_not_called_a_partial_update(ctx):
    """GradScaler refuses fp16 gradients before the optimizer's step begins: the step stops with
    its gradients dropped, and nothing says the parameters may be partly updated (they are not)."""
    stream = io.StringIO()
    telemetry.configure(log_level="warning", log_stream=stream)
    partial = telemetry.counts().get("torchhal.train.partial_optimizer_steps", 0)
    prepared = thd.prepare(Normed().half(), sgd, ctx=ctx, strategy="local")
    before = [p.detach().clone() for p in prepared.model.parameters()]
    data = [tuple(t.half() for t in batch) for batch in micro_batches(1, K, 4)]
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        train_on(prepared, ctx, data, 1, scaler=scaler())
    assert telemetry.counts().get("torchhal.train.partial_optimizer_steps", 0) == partial
    assert "may be partly updated" not in stream.getvalue()
    assert "step stopped; its accumulated gradients were dropped" in stream.getvalue()
    assert all(p.grad is None for p in prepared.model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(prepared.model.parameters(), before, strict=True))


class FailingBackward(torch.autograd.Function):
    """Identity whose backward raises on its `at`th call (counted across instances of a run)."""

    calls = 0
    at: int | None = None

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        FailingBackward.calls += 1
        if FailingBackward.calls == FailingBackward.at:
            raise Failure("backward fails half-way")
        return grad


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class HalfBackward(nn.Module):
    """Two blocks FSDP shards one by one and a head; backward fails between the blocks, after
    the head's and the second block's gradients were made (and, under DDP, their bucket reduced)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.layers[1](FailingBackward.apply(self.layers[0](x)))
        return nn.functional.mse_loss(self.head(x).squeeze(-1), y)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}


WITHOUT_RESET_ITER_STATE = "fsdp, as torch before 2.13 (no reset_iter_state)"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", WITHOUT_RESET_ITER_STATE])
@pytest.mark.parametrize(
    ("k", "at"),
    # k micro-batches a step; the backward that raises: the first (sync off when k = 2), the
    # second (synced; with k = 1, the second step's)
    [(2, 1), (2, 2), (1, 1), (1, 2)],
)
def test_a_backward_that_raised_part_way_leaves_the_wrapper_ready_for_a_retry(
    ctx, monkeypatch, strategy, k, at
):
    """The stopped step is run again (and the rest after it), and the model equals one trained
    without the failure. Fails before: DDP's reducer, left waiting for the rest of its buckets,
    raised "Expected to have finished reduction in the prior iteration"; FSDP2's iteration stayed
    open, and the gradients its groups had made before their post-backward stayed in their
    unsharded parameters (k = 1 too), so the retried steps computed other updates, silently. A
    torch without `reset_iter_state` says so instead."""
    if strategy == WITHOUT_RESET_ITER_STATE and hasattr(FSDPModule, "reset_iter_state"):
        monkeypatch.delattr(FSDPModule, "reset_iter_state")
    reset = strategy == "ddp" or hasattr(FSDPModule, "reset_iter_state")
    strategy = strategy.split(",")[0]
    seed = random.randrange(2**31)
    data = micro_batches(2, k, 4)
    prepared = thd.prepare(seeded(HalfBackward, seed), sgd, ctx=ctx, strategy=strategy)
    stream = io.StringIO()
    telemetry.configure(log_level="warning", log_stream=stream)
    FailingBackward.calls, FailingBackward.at = 0, at
    try:
        with pytest.raises(Failure, match="half-way"):
            train_on(prepared, ctx, data, 2, k)
    finally:
        FailingBackward.at = None
    if not reset:
        assert "the stopped step left the model's wrapper mid-iteration" in stream.getvalue()
        return
    assert "mid-iteration" not in stream.getvalue()
    stopped = (at - 1) // k
    train_on(prepared, ctx, data[stopped * k :], 2 - stopped, k)
    reference = thd.prepare(seeded(HalfBackward, seed), sgd, ctx=ctx, strategy=strategy)
    train_on(reference, ctx, data, 2, k)
    torch.testing.assert_close(full_state(prepared.model), full_state(reference.model))


def test_a_step_stopped_between_micro_batches_is_not_called_mid_iteration(ctx, monkeypatch):
    """Batches run out after a whole micro-batch: FSDP2's iteration is closed, so a torch without
    `reset_iter_state` has nothing to say either."""
    if hasattr(FSDPModule, "reset_iter_state"):
        monkeypatch.delattr(FSDPModule, "reset_iter_state")
    prepared = thd.prepare(HalfBackward(), sgd, ctx=ctx, strategy="fsdp")
    stream = io.StringIO()
    telemetry.configure(log_level="warning", log_stream=stream)
    with pytest.raises(InvalidArgumentError, match="batches ran out"):
        train_on(prepared, ctx, micro_batches(2, 2, 4)[:3], 2, 2)
    assert "step stopped" in stream.getvalue() and "mid-iteration" not in stream.getvalue()


def test_a_step_stopped_before_fsdps_first_forward_is_not_called_mid_iteration(ctx):
    """The loss_fn checks the batch and raises before the model ever ran: FSDP2 has no iteration
    to reset. Fails before: torch's reset_iter_state raised on the uninitialised root, and the
    stop asked for the model to be rebuilt."""
    prepared = thd.prepare(HalfBackward(), sgd, ctx=ctx, strategy="fsdp")
    stream = io.StringIO()
    telemetry.configure(log_level="warning", log_stream=stream)

    def refusing(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        raise Failure("the batch is refused before the forward")

    with pytest.raises(Failure, match="refused"):
        train_on(prepared, ctx, micro_batches(1, 2, 4), 1, 2, loss_fn=refusing)
    assert "mid-iteration" not in stream.getvalue()
