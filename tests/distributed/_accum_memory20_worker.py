"""One rank of the micro-batch lifetime and run-out checks (world 2, CPU, gloo; twentieth session).

Run as a script by test_accumulation_memory20.py, through `_worker.main` (same arguments, same
result files); this module adds the scenario "memory20" to `_worker.SCENARIOS`. Under DDP, FSDP2
and an explicit grad_sync: a step holds one micro-batch at a time; a rank whose batches run out
at any micro-batch of a step stops both ranks within seconds, naming it, with that step's
gradients dropped (FSDP2's unsharded ones too), so a later `train` call matches a run that never
saw the dropped micro-batches.
"""

from __future__ import annotations

import importlib.util
import time
import weakref
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchhal import distributed as thd
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
K, ROWS = 3, 4
KINDS = ("ddp", "fsdp", "sync")  # "sync": a local model with an explicit grad_sync (hetero's way)


class Buffered(nn.Module):
    """w.Net after a BatchNorm: buffers, which DDP broadcasts in a step's first forward, no_sync
    or not (a collective the ranks must agree before)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(w.DIM)
        self.net = w.Net()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(self.norm(x), y)  # type: ignore[no-any-return]


class Tracked:
    """Makes `count` micro-batches of `rows` x `dim` as they are asked for, keeping none, and
    records how many earlier ones were still alive (weak references to their tensors) at each
    fetch and, through `loss` as the loss_fn, in each forward."""

    def __init__(self, count: int, rows: int, dim: int, seed: int) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        self._left, self._shape = count, (rows, dim)
        self._refs: list[weakref.ref[torch.Tensor]] = []
        self.at_fetch: list[int] = []
        self.in_forward: list[int] = []

    def __iter__(self) -> Tracked:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._left:
            raise StopIteration
        self.at_fetch.append(self.alive())
        self._left -= 1
        x = torch.randn(self._shape, generator=self._gen)
        self._refs.append(weakref.ref(x))
        return x, torch.randn(self._shape[0], generator=self._gen)

    def alive(self) -> int:
        return sum(ref() is not None for ref in self._refs)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.in_forward.append(self.alive())
        return model(*batch)  # type: ignore[no-any-return]


def tracked(state: Any, tag: str, count: int) -> Tracked:
    """This rank's `count` micro-batches of stream `tag`."""
    return Tracked(count, ROWS, w.DIM, zlib.crc32(f"{state.seed}:{state.rank}:{tag}".encode()))


def _prepare(state: Any, kind: str) -> thd.Prepared:
    torch.manual_seed(zlib.crc32(f"{state.seed}:model".encode()))
    model = Buffered()
    strategy = "local" if kind == "sync" else kind
    return thd.prepare(
        model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), ctx=state.ctx, strategy=strategy
    )


def _average_gradients(state: Any) -> Any:
    def sync(model: nn.Module) -> None:
        for p in model.parameters():
            if p.grad is not None:
                state.ctx.communicator.all_reduce(p.grad).div_(state.world)

    return sync


def _train(state: Any, kind: str, prepared: thd.Prepared, batches: Any, steps: int, **options: Any) -> list:
    return thd.train(
        prepared.model,
        prepared.optimizer,
        batches,
        steps=steps,
        ctx=state.ctx,
        policy=prepared.policy,
        grad_sync=_average_gradients(state) if kind == "sync" else None,
        gradient_accumulation_steps=K,
        **options,
    )


def _parameters(prepared: thd.Prepared) -> list[torch.Tensor]:
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for p in prepared.model.parameters()
    ]


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for index, (p, q) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(
            p, q, rtol=1e-5, atol=1e-6, msg=lambda m, i=index: f"{what}, parameter {i}: {m}"
        )


def check_init(state: Any) -> None:
    store = dist.FileStore(str(state.out / "store"), state.world)
    state._ctx = thd.init(
        device="cpu", rank=state.rank, world_size=state.world, store=store, timeout=w.TIMEOUT
    )


def check_one_micro_batch_is_held_at_a_time(state: Any) -> None:
    """Each fetch finds no earlier micro-batch alive, and each forward sees only its own; the
    parameters match a run over the same batches from a list. All k were held before."""
    steps = 2
    for kind in KINDS:
        loader = tracked(state, kind, steps * K)
        prepared = _prepare(state, kind)
        _train(state, kind, prepared, loader, steps, loss_fn=loader.loss)
        assert loader.at_fetch == [0] * (steps * K), f"{kind}: alive at each fetch {loader.at_fetch}"
        assert loader.in_forward == [1] * (steps * K), f"{kind}: alive in each forward {loader.in_forward}"
        reference = _prepare(state, kind)
        _train(state, kind, reference, list(tracked(state, kind, steps * K)), steps)
        _assert_same(_parameters(prepared), _parameters(reference), kind)


def check_a_rank_out_of_batches_at_any_micro_batch_stops_both_and_drops_the_step(state: Any) -> None:
    """Rank 1 has 0, 1, ... k-1 of step 2's micro-batches (each in turn): both ranks raise
    naming it within seconds, no gradient is left, and the parameters are step 1's. A step trained
    after that matches one trained right after step 1 (FSDP2's unsharded gradients included)."""
    for kind in KINDS:
        after_one = _prepare(state, kind)
        _train(state, kind, after_one, tracked(state, kind, K), 1)
        want_one = _parameters(after_one)
        _train(state, kind, after_one, tracked(state, kind + "next", K), 1, first_step=1)
        want_next = _parameters(after_one)
        for have in range(K):  # rank 1's micro-batches of step 2
            prepared = _prepare(state, kind)
            count = K + have if state.rank == 1 else 2 * K
            began = time.monotonic()
            try:
                _train(state, kind, prepared, tracked(state, kind, count), 2)
            except InvalidArgumentError as exc:
                text = str(exc)
                assert f"batches ran out after 1 of 2 steps (gradient_accumulation_steps {K}:" in text, text
                assert "on rank(s) [1]" in text, text
                if state.rank == 1:
                    assert f"this rank had {have} of them for the next" in text, text
            else:
                raise AssertionError(
                    f"{kind}: train finished although rank 1 had {have} of {K} micro-batches"
                )
            assert time.monotonic() - began < w.TIMEOUT.total_seconds() / 2, f"{kind}: waited on a timeout"
            assert all(p.grad is None for p in prepared.model.parameters()), f"{kind}: gradients left"
            _assert_same(_parameters(prepared), want_one, f"{kind}, rank 1 with {have}: after the error")
            _train(state, kind, prepared, tracked(state, kind + "next", K), 1, first_step=1)
            _assert_same(_parameters(prepared), want_next, f"{kind}, rank 1 with {have}: the step after")
        dist.barrier()


def check_a_loss_fn_with_its_own_collective_stops_cleanly_when_a_rank_runs_out(state: Any) -> None:
    """A loss_fn that all-reduces (a token count, a contrastive loss's gather) is a collective in
    every micro-batch: agreeing before the first and last only (DDP), or the last (grad_sync),
    left rank 0 in it while rank 1, out of batches, agreed; gloo aborted the process."""

    def counting(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        rows = torch.tensor([float(batch[0].shape[0])])
        dist.all_reduce(rows)  # every rank's rows this micro-batch
        return model(*batch) * (batch[0].shape[0] * state.world / rows.item())

    for kind in KINDS:
        prepared = _prepare(state, kind)
        count = K + 1 if state.rank == 1 else 2 * K  # rank 1 runs out at step 2's second micro-batch
        try:
            _train(state, kind, prepared, tracked(state, kind, count), 2, loss_fn=counting)
        except InvalidArgumentError as exc:
            assert "on rank(s) [1]" in str(exc), str(exc)
        else:
            raise AssertionError(f"{kind}: train finished although rank 1 ran out")
        dist.barrier()


def check_a_micro_batch_that_raises_under_fsdp_leaves_no_unsharded_gradient(state: Any) -> None:
    """The third micro-batch's loss is not a scalar on both ranks, after two ran with sync off: a
    step trained after that matches one trained on a fresh model. FSDP2 kept the two's gradients
    in its unsharded parameters, where zero_grad does not reach, and added them to that step."""
    fresh = _prepare(state, "fsdp")
    _train(state, "fsdp", fresh, tracked(state, "after", K), 1)
    calls: list[int] = []

    def third_fails(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        calls.append(1)
        loss = model(*batch)
        return loss.expand(2) if len(calls) == K else loss

    prepared = _prepare(state, "fsdp")
    before = _parameters(prepared)
    try:
        _train(state, "fsdp", prepared, tracked(state, "fails", K), 1, loss_fn=third_fails)
    except InvalidArgumentError as exc:
        assert "the loss must be a scalar tensor" in str(exc), str(exc)
    else:
        raise AssertionError("train accepted a loss of shape (2,)")
    _assert_same(_parameters(prepared), before, "after the error")
    _train(state, "fsdp", prepared, tracked(state, "after", K), 1)
    _assert_same(_parameters(prepared), _parameters(fresh), "the step after the error")


w.SCENARIOS["memory20"] = [
    check_init,
    check_one_micro_batch_is_held_at_a_time,
    check_a_rank_out_of_batches_at_any_micro_batch_stops_both_and_drops_the_step,
    check_a_loss_fn_with_its_own_collective_stops_cleanly_when_a_rank_runs_out,
    check_a_micro_batch_that_raises_under_fsdp_leaves_no_unsharded_gradient,
]
check_names = w.check_names

if __name__ == "__main__":
    w.main()
