"""FSDP2 in bf16 with gradient accumulation (a world of one over gloo) and a block that some
micro-batches skip: an optional tower, absent from the first micro-batch or from a whole step."""

from __future__ import annotations

import copy
import random

import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed.test_grad_accumulation import DIM, sgd
from torchhal import distributed as thd
from torchhal.distributed.fsdp_state import fsdp_groups


class WithTower(nn.Module):
    """Two blocks; the second (the tower) runs only in micro-batches whose flag is set."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, tower: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        if bool(tower):
            x = self.layers[1](x)
        return F.mse_loss(self.head(x).squeeze(-1).float(), y.float())


def batches(flags: list[bool]) -> list[tuple[torch.Tensor, ...]]:
    return [(torch.randn(6, DIM), torch.randn(6), torch.tensor(flag)) for flag in flags]


def reference_run(model: nn.Module, data, k: int) -> nn.Module:
    """One process, fp32, no wrapper: each step's micro-batch losses averaged."""
    optimizer = sgd(model.parameters())
    for start in range(0, len(data), k):
        (sum(model(*batch) for batch in data[start : start + k]) / k).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def tower_bytes(model: nn.Module) -> int:
    """The tower's FSDP2 gradients accumulated with sync off, in bytes."""
    tower = model.layers[1]
    return sum(
        p.unsharded_accumulated_grad.numel() * p.unsharded_accumulated_grad.element_size()
        for module, params in fsdp_groups(model)
        if module is tower
        for p in params
        if p.unsharded_accumulated_grad is not None
    )


def test_a_tower_absent_from_the_first_micro_batch_trains_under_bf16_accumulation(ctx):
    """The tower is first gathered in step 0's second micro-batch, and absent from step 1. Fails
    before: torch's sync-off backward read the never-gathered tower's unsharded parameters
    ("'FSDPParam' object has no attribute '_unsharded_param'"). Matches one process in fp32, to
    bf16's precision."""
    torch.manual_seed(random.randrange(2**31))
    model = WithTower()
    reference = reference_run(copy.deepcopy(model), data := batches([False, True, False, False]), 2)
    policy = thd.choose_precision(ctx.device, prefer="bf16")
    prepared = thd.prepare(model, sgd, ctx=ctx, strategy="fsdp", policy=policy)
    thd.train(
        prepared.model, prepared.optimizer, data, steps=2, ctx=ctx, policy=prepared.policy,
        gradient_accumulation_steps=2,
    )  # fmt: skip
    got = {name: p.full_tensor() for name, p in prepared.model.named_parameters()}
    torch.testing.assert_close(got, dict(reference.named_parameters()), rtol=0.02, atol=0.01)


def test_a_tower_absent_from_a_step_holds_no_filled_gradient(ctx):
    """Steps 0 and 1 run the tower (gathered in step 0, so step 1 accumulates it with sync off);
    steps 2 and 3 do not, while the first block's gradients are upcast with sync off. Fails
    before: the tower got full fp32 zeros after each such micro-batch."""
    torch.manual_seed(random.randrange(2**31))
    policy = thd.choose_precision(ctx.device, prefer="bf16")
    prepared = thd.prepare(WithTower(), sgd, ctx=ctx, strategy="fsdp", policy=policy)
    held = []

    def recording(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        held.append(tower_bytes(model))
        return model(*batch)

    thd.train(
        prepared.model, prepared.optimizer, batches([True] * 4 + [False] * 4), steps=4,
        ctx=ctx, policy=prepared.policy, loss_fn=recording, gradient_accumulation_steps=2,
    )  # fmt: skip
    assert held[3] > 0  # step 1's second micro-batch: the first's upcast tower gradients, held
    assert held[4:] == [0, 0, 0, 0]
