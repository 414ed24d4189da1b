"""One rank of prepare's two-rank mixture-of-experts checks (world 2, CPU, gloo), scenario "moe".

Run as a script by test_prepare_architectures.py, through `_worker.main` (same arguments, same result
files). A mixture of experts whose ranks route their rows to different experts in a step (rank
0's to expert 0, rank 1's to expert 1, none to expert 2), under DDP with find_unused_parameters
and under FSDP2, against one process training on the whole batch.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchhal import distributed as thd
from torchhal.hal_core import telemetry

try:  # imported by a test: the checkout's root is on the path
    from tests.distributed import _worker as w
except ImportError:  # run as a script: its own directory is the path's first entry
    import _worker as w  # type: ignore[no-redef]
EXPERTS = 3


class MoE(nn.Module):
    """Blocks, then each row through the expert its route names (an expert given no rows is
    unused in that step), then a head."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(2))
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(EXPERTS))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = route == index
            if rows.any():
                out = out.index_put((rows,), expert(x[rows]))
        return F.mse_loss(self.head(out).squeeze(-1).float(), y.float())


def sgd(params: Any) -> torch.optim.Optimizer:
    """Plain SGD: a parameter no rank used gets a zero gradient under FSDP2 (None under DDP and in
    one process), which SGD without momentum or decay leaves where it was, as None does."""
    return torch.optim.SGD(params, lr=0.2)


def check_init(state: Any) -> None:
    store = dist.FileStore(str(state.out / "store"), state.world)
    state._ctx = thd.init(
        device="cpu", rank=state.rank, world_size=state.world, store=store, timeout=w.TIMEOUT
    )


def _whole_batch(state: Any, step: int) -> tuple[torch.Tensor, ...]:
    """Every rank's rows of `step`; the rows of rank r go to expert r."""
    x, y = state.batch(step)
    share = w.GLOBAL_BATCH // state.world
    return x, y, torch.arange(w.GLOBAL_BATCH) // share


def _assert_experts_match_whole_batch(state: Any, strategy: str, **options: Any) -> None:
    torch.manual_seed(state.seed)
    model = MoE(w.DIM)
    reference = copy.deepcopy(model)
    start = model.experts[0].weight.detach().clone()
    ref_opt = sgd(reference.parameters())
    prepared = thd.prepare(model, sgd, ctx=state.ctx, strategy=strategy, **options)
    rows = w.even_rows(state)
    batches = []
    for step in range(w.STEPS):
        whole = _whole_batch(state, step)
        batches.append(tuple(t[rows] for t in whole))
        reference(*whole).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    thd.train(
        prepared.model, prepared.optimizer, batches, steps=w.STEPS, ctx=state.ctx, policy=prepared.policy
    )
    inner = prepared.model.module if strategy == "ddp" else prepared.model
    for (name, p), (_, q) in zip(inner.named_parameters(), reference.named_parameters(), strict=True):
        got = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(got, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert not torch.equal(reference.experts[0].weight, start), "expert 0 must train"


def check_ddp_with_find_unused_parameters_trains_experts_the_ranks_left_idle(state: Any) -> None:
    """Without ddp_options DDP raised in the second step ("Expected to have finished reduction")."""
    _assert_experts_match_whole_batch(state, "ddp", ddp_options={"find_unused_parameters": True})


def check_fsdp_keeps_each_experts_gradient_its_own_when_ranks_route_apart(state: Any) -> None:
    """FSDP2 reduce-scattered the gradients each rank had, position by position: expert 0's
    gradient on rank 0 was summed with expert 1's on rank 1, silently. A torch whose FSDP2
    cannot reduce unused parameters (before 2.13) says so at prepare instead."""
    if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        key = "torchhal.distributed.fsdp_unused_params_unsupported"
        before = telemetry.counts().get(key, 0)
        thd.prepare(MoE(w.DIM), sgd, ctx=state.ctx, strategy="fsdp")
        assert telemetry.counts().get(key, 0) == before + 1
        return
    _assert_experts_match_whole_batch(state, "fsdp")


def check_fsdp_bf16_accumulation_trains_experts_used_apart_or_late(state: Any) -> None:
    """bf16 FSDP2, 2 micro-batches a step: in the first each rank routes to its own expert, in the
    second every row goes to expert 2 (first used in the synced micro-batch), so each rank holds
    fp32 upcast gradients beside bf16 ones and zeros. Fails before: FSDP2 raised "FSDP
    reduce-scatter expects uniform gradient dtype" on both ranks. Matches one process training
    on each step's whole batch, to bf16's precision."""
    torch.manual_seed(state.seed)
    model = MoE(w.DIM)
    reference = copy.deepcopy(model)
    ref_opt = sgd(reference.parameters())
    policy = thd.choose_precision(state.ctx.device, prefer="bf16")
    prepared = thd.prepare(model, sgd, ctx=state.ctx, strategy="fsdp", policy=policy)
    rows = w.even_rows(state)
    share = w.GLOBAL_BATCH // state.world
    micro = []
    for step in range(w.STEPS):
        x, y = state.batch(step)
        routes = [torch.arange(w.GLOBAL_BATCH) // share, torch.full((w.GLOBAL_BATCH,), 2)]
        for route in routes:  # the micro-batches: each rank takes its rows of each
            micro.append((x[rows], y[rows], route[rows]))
        parts = [reference(x, y, route) for route in routes]  # the whole batch, micro-batch by micro-batch
        (sum(parts) / len(parts)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    thd.train(
        prepared.model,
        prepared.optimizer,
        micro,
        steps=w.STEPS,
        ctx=state.ctx,
        policy=prepared.policy,
        gradient_accumulation_steps=2,
    )
    for (name, p), (_, q) in zip(
        prepared.model.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(
            p.full_tensor(), q, rtol=0.02, atol=0.01, msg=lambda m, n=name: f"{n}: {m}"
        )


w.SCENARIOS["moe"] = [
    check_init,
    check_fsdp_keeps_each_experts_gradient_its_own_when_ranks_route_apart,
    check_ddp_with_find_unused_parameters_trains_experts_the_ranks_left_idle,
    check_fsdp_bf16_accumulation_trains_experts_used_apart_or_late,
]
check_names = w.check_names

if __name__ == "__main__":
    w.main()
