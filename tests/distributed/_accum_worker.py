"""One rank of the gradient-accumulation and data-position checks (world 2, CPU, gloo).

Run as a script by test_accumulation_multiprocess.py, through `_worker.main` (same arguments,
same result files); this module adds the scenario "accumulate" to `_worker.SCENARIOS`:
DDP and FSDP2 with gradient_accumulation_steps=k against k=1 on the concatenated micro-batches,
each counting its gradient reductions; a rank short mid-accumulation; and a checkpoint of each
rank's (different) data position, resumed to the exact remaining batches.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from torchhal import distributed as thd
from torchhal.distributed.checkpoint import Checkpointer
from torchhal.hal_core import InvalidArgumentError


def _load_worker() -> Any:
    spec = importlib.util.spec_from_file_location(
        "torchhal_distributed_worker", Path(__file__).with_name("_worker.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


w = _load_worker()
K = 3  # micro-batches per step; GLOBAL_BATCH / world rows per rank split in K equal parts
REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")  # FSDP2 calls one (torch 2.13, 2.11)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def step_batches(state: Any, k: int) -> list[tuple[torch.Tensor, ...]]:
    """This rank's rows of each step's global batch, as k micro-batches or (k=1) one batch."""
    rows = w.even_rows(state)
    out = []
    for step in range(w.STEPS):
        mine = [t[rows] for t in state.batch(step)]
        out += list(zip(*(t.chunk(k) for t in mine), strict=True)) if k > 1 else [tuple(mine)]
    return out


class Counted:
    """Replaces torch.distributed's reduce-scatter functions with counting wrappers while active."""

    def __init__(self) -> None:
        self.calls = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> Counted:
        for name in REDUCE_SCATTERS:
            real = getattr(dist, name, None)
            if real is not None:
                self._saved[name] = real
                setattr(dist, name, self._counting(real))
        return self

    def _counting(self, real: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        return wrapper

    def __exit__(self, *exc: object) -> None:
        for name, real in self._saved.items():
            setattr(dist, name, real)


def _train(state: Any, strategy: str, k: int) -> tuple[nn.Module, list[thd.StepStats], int]:
    """Train STEPS steps; returns the model, its stats and the number of gradient reductions."""
    prepared = thd.prepare(state.model(), sgd, ctx=state.ctx, strategy=strategy)
    buckets = 0
    if strategy == "ddp":

        def count_buckets(group, bucket):  # unannotated: DDP checks annotations, and these would be strings
            nonlocal buckets
            buckets += 1
            return default_hooks.allreduce_hook(group, bucket)

        prepared.model.register_comm_hook(state.ctx.communicator.group, count_buckets)
    with Counted() as scatters:
        stats = thd.train(
            prepared.model,
            prepared.optimizer,
            step_batches(state, k),
            steps=w.STEPS,
            ctx=state.ctx,
            policy=prepared.policy,
            clip_grad_norm=50.0,  # the norm is recorded before clipping: a loss not divided by k shows
            gradient_accumulation_steps=k,
        )
    return prepared.model, stats, buckets if strategy == "ddp" else scatters.calls


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _assert_accumulation_matches(state: Any, strategy: str) -> None:
    accumulated, stats, reductions = _train(state, strategy, K)
    whole, reference, reference_reductions = _train(state, strategy, 1)
    assert reference_reductions >= w.STEPS, reference_reductions  # the counter sees the reductions
    assert reductions == reference_reductions, (
        f"{strategy}: {reductions} gradient reductions with {K} micro-batches per step, "
        f"{reference_reductions} with one batch per step: not once per optimizer step"
    )
    torch.testing.assert_close(
        [s.grad_norm for s in stats], [s.grad_norm for s in reference], rtol=1e-5, atol=1e-7
    )
    torch.testing.assert_close([s.loss for s in stats], [s.loss for s in reference], rtol=1e-6, atol=1e-7)
    assert [s.tokens for s in stats] == [s.tokens for s in reference]
    for (name, p), (_, q) in zip(accumulated.named_parameters(), whole.named_parameters(), strict=True):
        torch.testing.assert_close(
            _full(p), _full(q), rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


def check_init(state: Any) -> None:
    store = dist.FileStore(str(state.out / "store"), state.world)
    state._ctx = thd.init(
        device="cpu", rank=state.rank, world_size=state.world, store=store, timeout=w.TIMEOUT
    )


def check_ddp_accumulation_matches_concatenated_batches_and_reduces_once_per_step(state: Any) -> None:
    _assert_accumulation_matches(state, "ddp")


def check_fsdp_accumulation_matches_concatenated_batches_and_reduces_once_per_step(state: Any) -> None:
    _assert_accumulation_matches(state, "fsdp")


def check_a_rank_short_mid_accumulation_stops_every_rank_naming_it(state: Any) -> None:
    """Rank 1 lacks the last micro-batch of step 2: every rank stops there naming it, before the
    step's forward (DDP would otherwise wait in the last micro-batch's all-reduce)."""
    prepared = thd.prepare(state.model(), sgd, ctx=state.ctx, strategy="ddp")
    batches = step_batches(state, K)
    if state.rank == 1:
        batches = batches[:-1]
    try:
        thd.train(
            prepared.model,
            prepared.optimizer,
            batches,
            steps=w.STEPS,
            ctx=state.ctx,
            policy=prepared.policy,
            gradient_accumulation_steps=K,
        )
    except InvalidArgumentError as exc:
        want = f"batches ran out after {w.STEPS - 1} of {w.STEPS} steps (gradient_accumulation_steps {K}:"
        assert want in str(exc) and "on rank(s) [1]" in str(exc), str(exc)
        return
    raise AssertionError("train finished although rank 1 was a micro-batch short")


class Stream:
    """This rank's samples, reshuffled each epoch, as batches of ROWS; its position (epoch, batch)
    is its state, as a torchdata StatefulDataLoader's is. Each rank holds different samples."""

    SAMPLES, ROWS = 14, 2

    def __init__(self, state: Any) -> None:
        gen = state.generator(f"stream{state.rank}")
        self.x, self.y = (
            torch.randn(self.SAMPLES, w.DIM, generator=gen),
            torch.randn(self.SAMPLES, generator=gen),
        )
        self.seed, self.epoch, self.position = state.seed + 1000 * state.rank, 0, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            order = torch.randperm(
                self.SAMPLES, generator=torch.Generator().manual_seed(self.seed + self.epoch)
            )
            while self.position < self.SAMPLES // self.ROWS:
                rows = order[self.position * self.ROWS : (self.position + 1) * self.ROWS]
                self.position += 1
                yield self.x[rows], self.y[rows]
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, saved: dict[str, int]) -> None:
        self.epoch, self.position = saved["epoch"], saved["position"]


def check_a_checkpoint_resumes_each_ranks_data_where_it_stopped(state: Any) -> None:
    """Save mid-epoch with data=, train on (crossing into the next epoch), then load into a fresh
    model and loader: the resumed run sees exactly the batches the first one saw after the save,
    on each rank its own, and ends with the same parameters."""
    directory, k, steps = state.out / "data_ckpt", 2, 3  # 3 steps of 2 batches: 6 of the epoch's 7
    seen: list[torch.Tensor] = []

    def recording(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        seen.append(batch[0].clone())
        return model(*batch)

    def train(prepared: thd.Prepared, stream: Stream, first_step: int) -> None:
        thd.train(
            prepared.model,
            prepared.optimizer,
            stream,
            steps=steps,
            ctx=state.ctx,
            policy=prepared.policy,
            loss_fn=recording,
            gradient_accumulation_steps=k,
            first_step=first_step,
        )

    stream, prepared = Stream(state), thd.prepare(state.model(), sgd, ctx=state.ctx, strategy="ddp")
    checkpointer = Checkpointer(directory, state.ctx)
    train(prepared, stream, 0)
    checkpointer.save(steps, prepared.model, prepared.optimizer, data=stream)
    seen.clear()
    train(prepared, stream, steps)
    expected, final = list(seen), copy.deepcopy(prepared.model.module)

    fresh_stream = Stream(state)
    next(iter(fresh_stream))  # somewhere else, so the load must move it
    torch.manual_seed(state.seed + 7)
    fresh = thd.prepare(w.Net(), sgd, ctx=state.ctx, strategy="ddp")
    info = checkpointer.load(fresh.model, fresh.optimizer, data=fresh_stream)
    assert info is not None and info.step == steps
    assert fresh_stream.state_dict() == {"epoch": 0, "position": 2 * steps}
    seen.clear()
    train(fresh, fresh_stream, steps)
    assert len(seen) == len(expected) == steps * k
    for index, (got, want) in enumerate(zip(seen, expected, strict=True)):
        assert torch.equal(got, want), f"batch {index} after the resume differs"
    for (name, p), (_, q) in zip(
        fresh.model.module.named_parameters(), final.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name
    firsts: list[object] = [None] * state.world
    dist.all_gather_object(firsts, expected[0])
    assert not torch.equal(firsts[0], firsts[1]), "the ranks' data must differ"  # type: ignore[arg-type]
    checkpointer.close()


w.SCENARIOS["accumulate"] = [
    check_init,
    check_ddp_accumulation_matches_concatenated_batches_and_reduces_once_per_step,
    check_fsdp_accumulation_matches_concatenated_batches_and_reduces_once_per_step,
    check_a_rank_short_mid_accumulation_stops_every_rank_naming_it,
    check_a_checkpoint_resumes_each_ranks_data_where_it_stopped,
]
check_names = w.check_names

if __name__ == "__main__":
    w.main()
