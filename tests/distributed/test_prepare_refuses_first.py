"""`prepare(strategy="fsdp")` refuses what it cannot prepare before FSDP2 shards the model, which
cannot be undone: an optimizer with state from its making (Adagrad) and a model without
parameters were refused only after sharding, and the corrected retry was then refused as
"already sharded". A world of one over gloo."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchhal import distributed as thd
from torchhal.hal_core import InvalidArgumentError, telemetry


class Blocks(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def fp32(ctx: thd.DistContext) -> thd.PrecisionPolicy:
    return thd.choose_precision(ctx.device, prefer="fp32")


def test_an_optimizer_with_state_from_its_making_is_refused_before_sharding_and_a_retry_trains(ctx):
    width = random.randint(3, 8)
    model = Blocks(width)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    key = "torchhal.distributed.prepare_failed_sharded"
    failed = telemetry.counts().get(key, 0)
    with pytest.raises(InvalidArgumentError, match=r"the optimizer has state \(it has stepped") as refused:
        thd.prepare(
            model, torch.optim.Adagrad(model.parameters()), ctx=ctx, strategy="fsdp", policy=fp32(ctx)
        )
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    assert telemetry.counts().get(key, 0) == failed
    assert "this Adagrad holds state for 4)" in str(refused.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # the retry the message asks for: the same model, an optimizer made by a factory
    prepared = thd.prepare(
        model, lambda params: torch.optim.Adagrad(params, lr=0.1), ctx=ctx, strategy="fsdp", policy=fp32(ctx)
    )
    x = torch.randn(4, width)
    reference = Blocks(width)
    reference.load_state_dict(before)
    expected = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    for model_, optimizer in ((prepared.model, prepared.optimizer), (reference, expected)):
        model_(x).backward()
        optimizer.step()
    for name, param in prepared.model.named_parameters():
        torch.testing.assert_close(param.full_tensor(), dict(reference.named_parameters())[name], msg=name)


class BuffersOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.rand(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale).sum()


def test_a_model_without_parameters_is_refused_before_sharding(ctx):
    model = BuffersOnly()
    with pytest.raises(InvalidArgumentError, match=r"the model \(BuffersOnly\) has no parameters"):
        thd.prepare(model, lambda params: torch.optim.SGD(params, lr=0.1), ctx=ctx, strategy="fsdp")
    assert not isinstance(model, FSDPModule)
