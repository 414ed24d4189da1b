"""Gradient accumulation through a model that wraps its DDP module."""

from __future__ import annotations

import copy
import random

import torch

from tests.distributed.test_grad_accumulation import Net, assert_same_parameters, micro_batches, sgd
from torchhal import distributed as thd


def test_a_compiled_ddp_model_reduces_once_per_step(ctx):
    """torch.compile(DDP(model)), the order torch's DDP notes give, is not itself a DDP module:
    each micro-batch's backward reduced the gradients (k all-reduces a step, silently), where
    no_sync of the DDP inside holds them to the last. The parameters match those without it."""
    steps, k = 2, random.randint(2, 4)
    model, micro = Net(), micro_batches(steps, k, random.randint(2, 4))
    reductions = 0

    def counting(state, bucket):  # unannotated: DDP checks the annotations' objects, not strings
        nonlocal reductions
        reductions += 1
        future = torch.futures.Future()
        future.set_result(bucket.buffer())  # a world of one: the sum is the buffer
        return future

    trained = []
    for compiled in (True, False):
        prepared = thd.prepare(copy.deepcopy(model), sgd, ctx=ctx, strategy="ddp")
        prepared.model.register_comm_hook(None, counting)
        wrapped = torch.compile(prepared.model, backend="eager") if compiled else prepared.model
        reductions = 0
        thd.train(
            wrapped, prepared.optimizer, micro, steps=steps, ctx=ctx, policy=prepared.policy,
            gradient_accumulation_steps=k,
        )  # fmt: skip
        assert reductions == steps, f"compiled={compiled}: {reductions} reductions for {steps} steps of {k}"
        trained.append(prepared.model.module)
    assert_same_parameters(*trained)
