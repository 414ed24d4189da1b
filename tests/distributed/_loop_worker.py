"""One rank of the training-loop agreement checks (world 2, CPU, gloo).

Run as a script by test_loop_multiprocess.py, through `_worker.main` (same arguments, same result
files); this module adds the scenario "loop" to `_worker.SCENARIOS`: ranks whose gradient scaling
differs (fp32 on rank 0, fp16 with a GradScaler on rank 1, synchronised by a grad_sync) are refused
on both ranks before any step, where they averaged scaled with unscaled gradients; both ranks in
fp16 with scalers train to identical replicas; `train(policy=<the policy given to prepare>)` under
DDP agrees on batches as `prepared.policy` does, so a rank short of batches stops both within
seconds; and FSDP2 ranks with different parameter dtypes are refused.
"""

from __future__ import annotations

import copy
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchhal import distributed as thd
from torchhal.hal_core import InvalidArgumentError

try:  # imported by a test: the checkout's root is on the path
    from tests.distributed import _worker as w
except ImportError:  # run as a script: its own directory is the path's first entry
    import _worker as w  # type: ignore[no-redef]
DIM = 6


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def check_init(state: Any) -> None:
    store = dist.FileStore(str(state.out / "store"), state.world)
    state._ctx = thd.init(
        device="cpu", rank=state.rank, world_size=state.world, store=store, timeout=w.TIMEOUT
    )


def _model(state: Any) -> nn.Module:
    torch.manual_seed(zlib.crc32(f"{state.seed}:loop_model".encode()))
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1))


def _batches(state: Any, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's own random batches (each rank's differ)."""
    gen = state.generator(f"loop_batches{state.rank}")
    return [(torch.randn(4, DIM, generator=gen), torch.randn(4, generator=gen)) for _ in range(steps)]


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return ((model(batch[0]).squeeze(-1).float() - batch[1]) ** 2).mean()


def _mean_gradients(state: Any):
    def sync(model: nn.Module) -> None:
        for p in model.parameters():
            assert p.grad is not None
            state.ctx.communicator.all_reduce(p.grad)
            p.grad.div_(state.world)

    return sync


def _prepare_hetero(state: Any, prefer_by_rank: tuple[str, str]) -> thd.Prepared:
    """Each rank its own precision (as the example and the demo choose it from each device)."""
    policy = thd.choose_precision(state.ctx.device, prefer=prefer_by_rank[state.rank])
    return thd.prepare(_model(state), sgd, ctx=state.ctx, strategy="local", policy=policy)


def _train_hetero(
    state: Any, prepared: thd.Prepared, steps: int, scaler: torch.amp.GradScaler | None = None
) -> list[thd.StepStats]:
    return thd.train(
        prepared.model,
        prepared.optimizer,
        _batches(state, steps),
        steps=steps,
        ctx=state.ctx,
        policy=prepared.policy,
        scaler=scaler or prepared.scaler,
        grad_sync=_mean_gradients(state),
        loss_fn=_mse,
    )


def _same_on_every_rank(state: Any, model: nn.Module) -> None:
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(mine) for _ in range(state.world)]
    dist.all_gather(every, mine)
    for rank, theirs in enumerate(every):
        assert torch.equal(theirs, mine), (rank, (theirs - mine).abs().max().item())


def check_ranks_scaling_gradients_differently_are_refused_on_both(state: Any) -> None:
    """Rank 0 fp32 without a scaler, rank 1 fp16 with a GradScaler, averaged by a grad_sync: the
    averaged gradient mixed x65536-scaled with unscaled ones and the replicas diverged (rank 0's
    weights in the tens after two steps). Both ranks now raise before any step, naming each
    rank's policy and scaler, the model untouched."""
    prepared = _prepare_hetero(state, ("fp32", "fp16"))
    before = [p.detach().clone() for p in prepared.model.parameters()]
    try:
        _train_hetero(state, prepared, 2)
    except InvalidArgumentError as exc:
        text = str(exc)
        assert "a gradient scaler on every rank or on none" in text, text
        assert "rank 0: policy 'fp32', no gradient scaler" in text, text
        assert "rank 1: policy 'fp16', a gradient scaler" in text, text
    else:
        raise AssertionError("train ran with scaled gradients on rank 1 and unscaled ones on rank 0")
    assert all(torch.equal(b, p) for b, p in zip(before, prepared.model.parameters(), strict=True))
    dist.barrier()


def check_ranks_scaling_alike_train_to_identical_replicas(state: Any) -> None:
    """fp16 with a GradScaler on both ranks passes the agreement: the replicas, trained on different
    batches, move from their start and stay identical."""
    steps = 2
    prepared = _prepare_hetero(state, ("fp16", "fp16"))
    before = [p.detach().clone() for p in prepared.model.parameters()]
    # a scale of 2**8, not GradScaler's 2**16: fp16 gradients of this loss overflow at 2**16 for
    # some seeds, the steps are skipped, and the parameters do not move
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    stats = _train_hetero(state, prepared, steps, scaler)
    assert [s.scaler_skipped for s in stats] == [False] * steps, [s.scale for s in stats]
    assert not any(torch.equal(b, p) for b, p in zip(before, prepared.model.parameters(), strict=True))
    _same_on_every_rank(state, prepared.model)
    dist.barrier()


def check_the_policy_given_to_prepare_agrees_on_batches_under_ddp(state: Any) -> None:
    """train(policy=<choose_precision's policy>) of a DDP model: the policy has no strategy, and the
    batch agreement was skipped, so rank 0 waited in DDP's all-reduce for rank 1, whose batches ran
    out, until the group's timeout. It takes the model's strategy now: both ranks stop at once,
    naming rank 1, and the completed steps match prepared.policy's run exactly."""
    steps = 3
    policy = thd.choose_precision(state.ctx.device)
    model = _model(state)
    runs = []
    for which in ("given", "prepared"):
        prepared = thd.prepare(copy.deepcopy(model), sgd, ctx=state.ctx, strategy="ddp", policy=policy)
        batches = _batches(state, steps)
        if state.rank == 1:
            batches = batches[:-1]
        began = time.monotonic()
        try:
            thd.train(
                prepared.model,
                prepared.optimizer,
                batches,
                steps=steps,
                ctx=state.ctx,
                policy=policy if which == "given" else prepared.policy,
                loss_fn=_mse,
            )
        except InvalidArgumentError as exc:
            assert f"batches ran out after {steps - 1} of {steps} steps on rank(s) [1]" in str(exc), str(exc)
            assert time.monotonic() - began < w.TIMEOUT.total_seconds() / 2, "the error waited on a timeout"
        else:
            raise AssertionError(f"{which}: train finished although rank 1 had too few batches")
        runs.append([p.detach().clone() for p in prepared.model.parameters()])
    given, reference = runs
    assert all(torch.equal(a, b) for a, b in zip(given, reference, strict=True))
    assert not all(torch.equal(a, b.detach()) for a, b in zip(given, model.parameters(), strict=True))
    dist.barrier()


def check_fsdp_ranks_with_different_parameter_dtypes_are_refused_on_both(state: Any) -> None:
    """FSDP2 all-gathers parameters and reduces gradients in its parameter dtype: bf16 on rank 0
    beside fp32 on rank 1 is refused on both ranks before any step."""
    policy = thd.choose_precision(state.ctx.device, prefer=("bf16", "fp32")[state.rank])
    prepared = thd.prepare(_model(state), sgd, ctx=state.ctx, strategy="fsdp", policy=policy)
    try:
        thd.train(
            prepared.model, prepared.optimizer, _batches(state, 1), steps=1, ctx=state.ctx,
            policy=prepared.policy, loss_fn=_mse,
        )  # fmt: skip
    except InvalidArgumentError as exc:
        text = str(exc)
        assert "the same parameter dtype under FSDP2" in text, text
        assert "rank 0: policy 'bf16'" in text and "rank 1: policy 'fp32'" in text, text
    else:
        raise AssertionError("FSDP2 trained with bf16 parameters on rank 0 and fp32 on rank 1")


w.SCENARIOS["loop"] = [
    check_init,
    check_ranks_scaling_gradients_differently_are_refused_on_both,
    check_ranks_scaling_alike_train_to_identical_replicas,
    check_the_policy_given_to_prepare_agrees_on_batches_under_ddp,
    check_fsdp_ranks_with_different_parameter_dtypes_are_refused_on_both,
]
check_names = w.check_names

if __name__ == "__main__":
    w.main()
