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

from tests.distributed.test_grad_accumulation import (
    Normed,
    assert_same_buffers,
    assert_same_parameters,
    micro_batches,
    seeded,
    sgd,
)
from torchhal import distributed as thd
from torchhal.hal_core import telemetry

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
    """SGD whose second step raises before it updates anything."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.1, momentum=0.9)
        self.step = failing_on_call(2, self.step)  # type: ignore[method-assign]


def train_on(prepared: thd.Prepared, ctx, data, steps: int, scaler, **options) -> None:
    thd.train(
        prepared.model,
        prepared.optimizer,
        data,
        steps=steps,
        ctx=ctx,
        policy=prepared.policy,
        scaler=scaler,
        clip_grad_norm=50.0,
        gradient_accumulation_steps=K,
        **options,
    )


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
        train_on(prepared, ctx, data, STEPS, shared, **options)
    assert all(p.grad is None for p in prepared.model.parameters())
    assert "step stopped; its accumulated gradients were dropped" in stream.getvalue()
    told = telemetry.counts().get("torchhal.train.partial_optimizer_steps", 0) - partial
    assert told == (1 if where == "optimizer" else 0)
    assert ("may be partly updated" in stream.getvalue()) == (where == "optimizer")

    train_on(prepared, ctx, data[K:], STEPS - 1, shared, **options)  # the failed step again, then the last
    reference, its_scaler = thd.prepare(seeded(Normed, seed), sgd, ctx=ctx, strategy="local"), scaler()
    train_on(reference, ctx, data, STEPS, its_scaler)
    assert_same_buffers(prepared.model, reference.model)
    assert_same_parameters(prepared.model, reference.model)
    assert shared.get_scale() == its_scaler.get_scale()


class FusedAdamFailingOnce(torch.optim.Adam):
    """Fused Adam (it unscales inside its own step, from the `grad_scale` GradScaler sets on it)
    whose second step raises before it updates anything."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=1e-2, fused=True)
        self.step = failing_on_call(2, self.step)  # type: ignore[method-assign]


def test_an_optimizer_that_unscales_in_its_step_is_not_left_the_scalers_attributes(ctx):
    """GradScaler sets `grad_scale` on a fused optimizer for its step and deletes it after; the
    step raised, so it stayed. Fails before: the retried step took the scale times the stale
    `grad_scale` as its scale, unscaling the gradients by the scale squared."""
    seed = random.randrange(2**31)
    data = micro_batches(STEPS, K, 4)
    prepared = thd.prepare(seeded(Normed, seed), FusedAdamFailingOnce, ctx=ctx, strategy="local")
    shared = scaler()
    with pytest.raises(Failure):
        train_on_unclipped(prepared, ctx, data, STEPS, shared)
    assert not hasattr(prepared.optimizer, "grad_scale")
    assert not hasattr(prepared.optimizer, "found_inf")
    train_on_unclipped(prepared, ctx, data[K:], STEPS - 1, shared)
    reference = thd.prepare(
        seeded(Normed, seed), lambda p: torch.optim.Adam(p, lr=1e-2, fused=True), ctx=ctx, strategy="local"
    )
    train_on_unclipped(reference, ctx, data, STEPS, scaler())
    assert_same_buffers(prepared.model, reference.model)
    assert_same_parameters(prepared.model, reference.model)


def train_on_unclipped(prepared: thd.Prepared, ctx, data, steps: int, scaler) -> None:
    """Without clipping: GradScaler.step unscales, inside the fused optimizer's step."""
    thd.train(
        prepared.model,
        prepared.optimizer,
        data,
        steps=steps,
        ctx=ctx,
        policy=prepared.policy,
        scaler=scaler,
        gradient_accumulation_steps=K,
    )


def test_a_stopped_step_with_a_scaler_can_be_checkpointed(ctx, monkeypatch):
    """GradScaler refuses to be pickled while it holds a step's record; a step stopped after
    unscale_ drops it. Fails before: the scaler kept the stopped step's record, and pickling it
    raised."""
    prepared = thd.prepare(Normed(), sgd, ctx=ctx, strategy="local")
    shared = scaler()
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", failing_on_call(1, torch.nn.utils.clip_grad_norm_))
    with pytest.raises(Failure):
        train_on(prepared, ctx, micro_batches(STEPS, K, 4), STEPS, shared)
    again = copy.deepcopy(shared)  # deepcopy pickles through __getstate__
    assert again.get_scale() == shared.get_scale()
