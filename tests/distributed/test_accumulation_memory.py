"""Gradient accumulation holds one micro-batch at a time.

`train(gradient_accumulation_steps=k)` fetched a step's k micro-batches before running any, so
all k were alive at once (on the device, where the loader puts them): k times the memory of the
one micro-batch DeepSpeed, Lightning or Hugging Face's Trainer hold. Single-process checks here;
DDP, FSDP2 and a grad_sync on 2 gloo ranks (one micro-batch held; a rank running out at each
micro-batch of a step) in `_accum_worker.py`, each reported as its own test.
"""

from __future__ import annotations

import copy
import io
import random
import time

import pytest
import torch

from tests.distributed.launch import check_outcome, run_world
from tests.distributed.test_accumulation_multiprocess import WORKER, load_worker
from tests.distributed.test_grad_accumulation import DIM, Net, assert_same_parameters, sgd
from torchhal import distributed as thd
from torchhal.hal_core import InvalidArgumentError, telemetry

worker = load_worker()


def tracked(count: int, rows: int, seed: int):
    return worker.Tracked(count, rows, DIM, seed)


@pytest.mark.parametrize("strategy", ["local", "ddp"])
def test_a_step_holds_one_micro_batch_at_a_time(ctx, strategy):
    """Fails before: every fetch of a step found the step's earlier micro-batches alive (k - 1 at
    the last), and each forward saw all k. The parameters match training from a list."""
    steps, k, rows, seed = 2, random.randint(3, 5), random.randint(2, 4), random.randrange(2**31)
    model = Net()
    loader = tracked(steps * k, rows, seed)
    prepared = thd.prepare(copy.deepcopy(model), sgd, ctx=ctx, strategy=strategy)
    stats = thd.train(
        prepared.model, prepared.optimizer, loader, steps=steps, ctx=ctx, policy=prepared.policy,
        loss_fn=loader.loss, gradient_accumulation_steps=k,
    )  # fmt: skip
    assert loader.at_fetch == [0] * (steps * k)
    assert loader.in_forward == [1] * (steps * k)
    reference = thd.prepare(copy.deepcopy(model), sgd, ctx=ctx, strategy=strategy)
    expected = thd.train(
        reference.model, reference.optimizer, list(tracked(steps * k, rows, seed)), steps=steps, ctx=ctx,
        policy=reference.policy, gradient_accumulation_steps=k,
    )  # fmt: skip
    assert_same_parameters(prepared.model, reference.model)
    assert [s.loss for s in stats] == [s.loss for s in expected]
    assert [s.tokens for s in stats] == [k * rows] * steps  # a floating (rows, DIM) batch: its rows


def test_waiting_on_the_loader_is_not_step_time(ctx):
    """The loader's time stays out of step_time_s (and tokens_per_s), as when every micro-batch
    was fetched before the step began; compute_s sums the micro-batches' forwards and backwards."""
    k, pause = 3, 0.5  # a slow loader: 1 s over the step, against a step of milliseconds

    class Slow(worker.Tracked):
        def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
            time.sleep(pause)
            return super().__next__()

    prepared = thd.prepare(Net(), sgd, ctx=ctx, strategy="local")
    stats = thd.train(
        prepared.model, prepared.optimizer, Slow(k, 2, DIM, random.randrange(2**31)), steps=1, ctx=ctx,
        policy=prepared.policy, grad_sync=lambda m: None, gradient_accumulation_steps=k,
    )  # fmt: skip
    assert stats[0].step_time_s < pause
    assert 0 < stats[0].forward_s <= stats[0].compute_s <= stats[0].step_time_s


def test_a_step_that_runs_out_drops_its_gradients_logged_and_counted(ctx):
    """Its first micro-batch ran before the second was found missing: that gradient goes, said."""
    stream = io.StringIO()
    telemetry.configure(log_level="warning", log_stream=stream)
    before = telemetry.counts().get("torchhal.train.dropped_micro_batches", 0)
    prepared = thd.prepare(Net(), sgd, ctx=ctx, strategy="ddp")
    with pytest.raises(
        InvalidArgumentError, match=r"after 1 of 2 steps \(gradient_accumulation_steps 2: this rank had 1 of"
    ):
        thd.train(
            prepared.model, prepared.optimizer, tracked(3, 2, random.randrange(2**31)), steps=2, ctx=ctx,
            policy=prepared.policy, gradient_accumulation_steps=2,
        )  # fmt: skip
    assert all(p.grad is None for p in prepared.model.parameters())
    assert telemetry.counts()["torchhal.train.dropped_micro_batches"] == before + 1
    assert (
        "accumulated gradients were dropped" in stream.getvalue() and "micro_batches=1" in stream.getvalue()
    )


@pytest.fixture(scope="module")
def memory_world(tmp_path_factory):
    return run_world(
        WORKER, "micro_batch_memory", 2, tmp_path_factory.mktemp("micro_batch_memory"), wall_limit_s=120
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", worker.check_names("micro_batch_memory"))
def test_memory_world(memory_world, name):
    results, seed = memory_world
    check_outcome(results, seed, name)
