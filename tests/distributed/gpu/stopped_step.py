"""One rank of the 2-GPU stopped-step check (run by test_gpu_distributed.py under torchrun).

Under DDP and FSDP2 over NCCL, in fp32: rank 1's micro-batches run out after the last step's
first one, which both ranks ran forward and backward. Each rank's model (BatchNorm's running
statistics, which each rank keeps from its own micro-batches, and its parameters) must equal one
trained on the completed steps only. Then in fp16 with the gradient scaler and clipping: the
optimizer's second step raises on both ranks after clipping unscaled the gradients (a
BatchNorm2d model, which FSDP2 would cast to fp16 without prepare's rule); that step
run again, and the last after it, must give the model and scale of a run without the failure.
Writes OUT/rank<r>.json: "ok" or the failure.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from torchhal import distributed as thd
from torchhal.hal_core import InvalidArgumentError

DIM, ROWS, K, STEPS = 64, 8, 3, 3


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(DIM)
        self.body = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.body(self.norm(x)).squeeze(-1), y)


class Normed2d(Normed):
    """Normed with BatchNorm2d on a 4-D view of the input: the layout for which CUDA's batch_norm
    refuses bf16/fp16 weights with fp32 running statistics (FSDP2's cast, which prepare avoids)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(DIM)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.body(self.norm(x[:, :, None, None]).flatten(1)).squeeze(-1), y)


def batches(ctx: thd.DistContext, count: int) -> list[tuple[torch.Tensor, ...]]:
    """This rank's first `count` micro-batches (the same ones in every run), on its GPU."""
    gen = torch.Generator().manual_seed(1234 + ctx.rank)
    made = [(torch.randn(ROWS, DIM, generator=gen), torch.randn(ROWS, generator=gen)) for _ in range(count)]
    return [tuple(ctx.device.to_device(t) for t in batch) for batch in made]


def prepared(ctx: thd.DistContext, strategy: str) -> thd.Prepared:
    torch.manual_seed(7)
    policy = thd.choose_precision(ctx.device, prefer="fp32")
    optimizer = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    return thd.prepare(Normed(), optimizer, ctx=ctx, strategy=strategy, policy=policy)


def train(ctx: thd.DistContext, job: thd.Prepared, data: list, steps: int) -> None:
    thd.train(
        job.model, job.optimizer, data, steps=steps, ctx=ctx, policy=job.policy, gradient_accumulation_steps=K
    )


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers and parameters, whole (FSDP2's sharded parameters gathered)."""
    out = {name: b.clone() for name, b in model.named_buffers()}
    for name, p in model.named_parameters():
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def check(ctx: thd.DistContext) -> None:
    rank = dist.get_rank()
    for strategy in ("ddp", "fsdp"):
        completed = prepared(ctx, strategy)
        train(ctx, completed, batches(ctx, (STEPS - 1) * K), STEPS - 1)
        stopped = prepared(ctx, strategy)
        try:
            train(ctx, stopped, batches(ctx, (STEPS - 1) * K + (1 if rank == 1 else K)), STEPS)
        except InvalidArgumentError as exc:
            assert f"after {STEPS - 1} of {STEPS} steps" in str(exc), str(exc)
        else:
            raise AssertionError(f"{strategy}: train finished although rank 1 ran out")
        got, want = state(stopped.model), state(completed.model)
        assert any("running_mean" in name for name in got), sorted(got)
        torch.testing.assert_close(got, want, msg=lambda m, s=strategy: f"{s}, rank {rank}: {m}")
        dist.barrier()


class SGDFailingOnce(torch.optim.SGD):
    """SGD whose second step raises before it updates anything."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.1, momentum=0.9)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("the optimizer's second step fails")
        return super().step(closure)


def scaled(ctx: thd.DistContext, strategy: str, optimizer) -> thd.Prepared:
    torch.manual_seed(7)
    policy = thd.choose_precision(ctx.device, prefer="fp16")
    return thd.prepare(Normed2d(), optimizer, ctx=ctx, strategy=strategy, policy=policy)


def train_scaled(
    ctx: thd.DistContext, job: thd.Prepared, scaler: torch.amp.GradScaler, data: list, steps: int
) -> None:
    stats = thd.train(
        job.model,
        job.optimizer,
        data,
        steps=steps,
        ctx=ctx,
        policy=job.policy,
        scaler=scaler,
        clip_grad_norm=1.0,
        gradient_accumulation_steps=K,
    )
    # a skipped step calls no optimizer step, and the failing one would come a step later
    assert not any(s.scaler_skipped for s in stats), [s.scale for s in stats]


def scaler(ctx: thd.DistContext) -> torch.amp.GradScaler:
    """A scale small enough that no step overflows (the default's first steps may)."""
    return torch.amp.GradScaler(ctx.device.torch_device.type, init_scale=2.0**10)


def check_after_backward(ctx: thd.DistContext) -> None:
    rank = dist.get_rank()
    data = batches(ctx, STEPS * K)
    for strategy in ("ddp", "fsdp"):
        reference, its_scaler = (
            scaled(ctx, strategy, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
            scaler(ctx),
        )
        train_scaled(ctx, reference, its_scaler, data, STEPS)
        retried, shared = scaled(ctx, strategy, SGDFailingOnce), scaler(ctx)
        try:
            train_scaled(ctx, retried, shared, data, STEPS)
        except RuntimeError as exc:
            assert "second step fails" in str(exc), str(exc)
        else:
            raise AssertionError(f"{strategy}: train finished although the optimizer raised")
        train_scaled(ctx, retried, shared, data[K:], STEPS - 1)  # the failed step again, then the last
        got, want = state(retried.model), state(reference.model)
        torch.testing.assert_close(got, want, msg=lambda m, s=strategy: f"{s} fp16, rank {rank}: {m}")
        assert shared.state_dict() == its_scaler.state_dict(), (strategy, shared.state_dict())
        dist.barrier()


def main() -> None:
    out = Path(sys.argv[1])
    ctx = thd.init()
    rank = dist.get_rank()
    try:
        check(ctx)
        check_after_backward(ctx)
        result = {"ok": True, "device": str(ctx.device.torch_device)}
    except BaseException as exc:  # reported to the test, which fails with it
        result = {"ok": False, "error": f"{exc!r}\n{traceback.format_exc()}"}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
