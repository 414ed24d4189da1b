"""FSDP2 in low precision with BatchNorm layers (a world of one over gloo): FSDP2 casts
parameters to the compute dtype but not buffers, and torch's batch_norm refuses low-precision
parameters with fp32 running statistics, so prepare keeps BatchNorm's parameters in fp32."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from tests.distributed.test_grad_accumulation import DIM, micro_batches, sgd
from torchhal import distributed as thd


class Blocks(nn.Module):
    """BatchNorm first, and inside each of the blocks FSDP shards one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(DIM)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, DIM), nn.BatchNorm1d(DIM), nn.Tanh()) for _ in range(2)
        )
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        for layer in self.layers:
            x = layer(x)
        return nn.functional.mse_loss(self.head(x).squeeze(-1).float(), y.float())


def dtypes_seen(model: nn.Module) -> dict[str, tuple[torch.dtype, torch.dtype]]:
    """Each BatchNorm's and Linear's (input, weight) dtypes in the forwards that run after this."""
    seen: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.BatchNorm1d, nn.Linear)):
            module.register_forward_pre_hook(
                lambda m, args, name=name: seen.__setitem__(name, (args[0].dtype, m.weight.dtype))
            )
    return seen


@pytest.mark.parametrize("prefer", ["bf16", "fp16"])
def test_fsdp_in_low_precision_trains_batch_norm_layers_with_fp32_parameters(ctx, prefer):
    """The Linear layers compute in the compute dtype, BatchNorm with fp32 parameters on the
    low-precision input, and the running statistics come out as an fp32 run's, to that dtype's
    precision. Fails before: the first BatchNorm raised "expected scalar type ... but found Float"."""
    torch.manual_seed(random.randrange(2**31))
    model = Blocks()
    fp32 = copy.deepcopy(model)
    policy = thd.choose_precision(ctx.device, prefer=prefer)
    prepared = thd.prepare(model, sgd, ctx=ctx, strategy="fsdp", policy=policy)
    assert prepared.sharded_blocks == 2
    seen = dtypes_seen(prepared.model)
    data = micro_batches(2, 1, 16)
    thd.train(
        prepared.model,
        prepared.optimizer,
        data,
        steps=2,
        ctx=ctx,
        policy=prepared.policy,
        scaler=prepared.scaler,
    )
    low = policy.compute_dtype
    assert seen == {
        "norm": (low, torch.float32),
        "layers.0.0": (low, low),
        "layers.0.1": (low, torch.float32),
        "layers.1.0": (low, low),
        "layers.1.1": (low, torch.float32),
        "head": (low, low),
    }
    reference = thd.prepare(
        fp32, sgd, ctx=ctx, strategy="local", policy=thd.choose_precision(ctx.device, prefer="fp32")
    )
    thd.train(reference.model, reference.optimizer, data, steps=2, ctx=ctx, policy=reference.policy)
    got, want = dict(prepared.model.named_buffers()), dict(reference.model.named_buffers())
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    assert all(b.dtype == want[name].dtype for name, b in got.items())
    assert not torch.equal(got["norm.running_mean"], torch.zeros(DIM))


class BatchNormBlocks(nn.Module):
    """An MLP whose `layers` hold the BatchNorm itself: a block FSDP shards one by one that is
    also a BatchNorm kept in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM), nn.BatchNorm1d(DIM), nn.Tanh(), nn.Linear(DIM, 1)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return nn.functional.mse_loss(x.squeeze(-1).float(), y.float())


def test_a_batch_norm_that_is_a_block_is_sharded_once_in_fp32(ctx):
    """Fails before: prepare sharded the BatchNorm apart, then again as a block, and torch raised
    "fully_shard has already been applied", leaving the model half-wrapped."""
    policy = thd.choose_precision(ctx.device, prefer="bf16")
    prepared = thd.prepare(BatchNormBlocks(), sgd, ctx=ctx, strategy="fsdp", policy=policy)
    assert prepared.sharded_blocks == 4
    seen = dtypes_seen(prepared.model)
    thd.train(
        prepared.model, prepared.optimizer, micro_batches(2, 1, 16), steps=2, ctx=ctx, policy=prepared.policy
    )
    assert seen == {
        "layers.0": (torch.bfloat16, torch.bfloat16),
        "layers.1": (torch.bfloat16, torch.float32),
        "layers.3": (torch.bfloat16, torch.bfloat16),
    }
