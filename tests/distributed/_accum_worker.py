"""One rank of the gradient-accumulation and data-position checks (world 2, CPU, gloo).

Run as a script by test_accumulation_multiprocess.py, through `_worker.main` (same arguments,
same result files); this module adds the scenario "accumulate" to `_worker.SCENARIOS`:
DDP and FSDP2 with gradient_accumulation_steps=k against k=1 on the concatenated micro-batches,
each counting its gradient reductions; a rank short mid-accumulation; a checkpoint of each
rank's (different) data position, resumed to the exact remaining batches; and a step stopped
after a micro-batch ran forward, which leaves each rank's BatchNorm statistics as the completed
steps left them. The scenario "micro_batch_memory" (run by test_accumulation_memory.py): under DDP,
FSDP2 and an explicit grad_sync, a step holds one micro-batch at a time; a rank whose batches
run out at any micro-batch of a step stops both ranks within seconds, naming it, with that
step's gradients dropped (FSDP2's unsharded ones too), so a later `train` call matches a run
that never saw them.
"""

from __future__ import annotations

import contextlib
import copy
import time
import weakref
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from torchhal import distributed as thd
from torchhal.distributed.checkpoint import Checkpointer, latest_valid
from torchhal.distributed.rollback import Buffers
from torchhal.hal_core import CollectiveError, InvalidArgumentError

try:  # imported by a test: the checkout's root is on the path
    from tests.distributed import _worker as w
except ImportError:  # run as a script: its own directory is the path's first entry
    import _worker as w  # type: ignore[no-redef]
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
    # data= on one rank only would commit a checkpoint no load(data=...) resumes: refused on both
    try:
        checkpointer.save(
            steps + 1, fresh.model, fresh.optimizer, data=fresh_stream if state.rank == 0 else None
        )
    except InvalidArgumentError as exc:
        assert "data= was given on rank(s) [0] of 2" in str(exc), str(exc)
    else:
        raise AssertionError("a save with data= on rank 0 only was committed")
    info = latest_valid(directory)
    assert info is not None and info.step == steps
    checkpointer.close()


w.SCENARIOS["accumulate"] = [
    check_init,
    check_ddp_accumulation_matches_concatenated_batches_and_reduces_once_per_step,
    check_fsdp_accumulation_matches_concatenated_batches_and_reduces_once_per_step,
    check_a_rank_short_mid_accumulation_stops_every_rank_naming_it,
    check_a_checkpoint_resumes_each_ranks_data_where_it_stopped,
]  # and (below, after the helpers it shares with "micro_batch_memory") a stopped step's buffers

# -- scenario "micro_batch_memory": a step holds one micro-batch; ranks that run out --

ROWS = 4  # rows of a micro-batch in the "micro_batch_memory" scenario
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
    return thd.prepare(model, sgd, ctx=state.ctx, strategy=strategy)


def _average_gradients(state: Any) -> Any:
    def sync(model: nn.Module) -> None:
        for p in model.parameters():
            if p.grad is not None:
                state.ctx.communicator.all_reduce(p.grad).div_(state.world)

    return sync


def _train_kind(
    state: Any, kind: str, prepared: thd.Prepared, batches: Any, steps: int, **options: Any
) -> list:
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
    return [_full(p).detach().clone() for p in prepared.model.parameters()]


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for index, (p, q) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(
            p, q, rtol=1e-5, atol=1e-6, msg=lambda m, i=index: f"{what}, parameter {i}: {m}"
        )


def check_one_micro_batch_is_held_at_a_time(state: Any) -> None:
    """Each fetch finds no earlier micro-batch alive, and each forward sees only its own; the
    parameters match a run over the same batches from a list. All k were held before."""
    steps = 2
    for kind in KINDS:
        loader = tracked(state, kind, steps * K)
        prepared = _prepare(state, kind)
        _train_kind(state, kind, prepared, loader, steps, loss_fn=loader.loss)
        assert loader.at_fetch == [0] * (steps * K), f"{kind}: alive at each fetch {loader.at_fetch}"
        assert loader.in_forward == [1] * (steps * K), f"{kind}: alive in each forward {loader.in_forward}"
        reference = _prepare(state, kind)
        _train_kind(state, kind, reference, list(tracked(state, kind, steps * K)), steps)
        _assert_same(_parameters(prepared), _parameters(reference), kind)


def check_a_rank_out_of_batches_at_any_micro_batch_stops_both_and_drops_the_step(state: Any) -> None:
    """Rank 1 has 0, 1, ... k-1 of step 2's micro-batches (each in turn): both ranks raise
    naming it within seconds, no gradient is left, and the parameters are step 1's. A step trained
    after that matches one trained right after step 1 (FSDP2's unsharded gradients included)."""
    for kind in KINDS:
        after_one = _prepare(state, kind)
        _train_kind(state, kind, after_one, tracked(state, kind, K), 1)
        want_one = _parameters(after_one)
        _train_kind(state, kind, after_one, tracked(state, kind + "next", K), 1, first_step=1)
        want_next = _parameters(after_one)
        for have in range(K):  # rank 1's micro-batches of step 2
            prepared = _prepare(state, kind)
            count = K + have if state.rank == 1 else 2 * K
            began = time.monotonic()
            try:
                _train_kind(state, kind, prepared, tracked(state, kind, count), 2)
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
            _train_kind(state, kind, prepared, tracked(state, kind + "next", K), 1, first_step=1)
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
            _train_kind(state, kind, prepared, tracked(state, kind, count), 2, loss_fn=counting)
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
    _train_kind(state, "fsdp", fresh, tracked(state, "after", K), 1)
    calls: list[int] = []

    def third_fails(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        calls.append(1)
        loss = model(*batch)
        return loss.expand(2) if len(calls) == K else loss

    prepared = _prepare(state, "fsdp")
    before = _parameters(prepared)
    try:
        _train_kind(state, "fsdp", prepared, tracked(state, "fails", K), 1, loss_fn=third_fails)
    except InvalidArgumentError as exc:
        assert "the loss must be a scalar tensor" in str(exc), str(exc)
    else:
        raise AssertionError("train accepted a loss of shape (2,)")
    _assert_same(_parameters(prepared), before, "after the error")
    _train_kind(state, "fsdp", prepared, tracked(state, "after", K), 1)
    _assert_same(_parameters(prepared), _parameters(fresh), "the step after the error")


def check_a_step_stopped_after_a_forward_leaves_the_buffers_of_the_completed_steps(state: Any) -> None:
    """Rank 1's batches run out after the last step's first micro-batch, which both ranks ran
    forward and backward: each rank's model (BatchNorm's running statistics, which each rank
    keeps from its own micro-batches, and the parameters) equals one trained on the completed
    steps only, under DDP and FSDP2. Fails before: the statistics kept that micro-batch."""
    steps = 3
    for kind in ("ddp", "fsdp"):
        completed = _prepare(state, kind)
        _train_kind(state, kind, completed, tracked(state, kind, (steps - 1) * K), steps - 1)
        prepared = _prepare(state, kind)
        count = (steps - 1) * K + (1 if state.rank == 1 else K)
        try:
            _train_kind(state, kind, prepared, tracked(state, kind, count), steps)
        except InvalidArgumentError as exc:
            text = str(exc)
            assert f"after {steps - 1} of {steps} steps" in text and "on rank(s) [1]" in text, text
        else:
            raise AssertionError(f"{kind}: train finished although rank 1 ran out")
        torch.testing.assert_close(
            dict(prepared.model.named_buffers()),
            dict(completed.model.named_buffers()),
            rtol=0,
            atol=0,
            msg=lambda m, kind=kind: f"{kind}, rank {state.rank}: {m}",
        )
        _assert_same(_parameters(prepared), _parameters(completed), f"{kind}: after the stopped step")
        dist.barrier()


class CorruptSample(RuntimeError):
    """What a loader raises in `check_a_rank_whose_loader_raises_stops_every_rank_at_once`."""


class RaisingAt(Tracked):
    """Tracked, raising CorruptSample at its micro-batch `at` (counted from 0) instead."""

    def __init__(self, base: Tracked, at: int) -> None:
        self.__dict__.update(base.__dict__)
        self._fetched, self._at = 0, at

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._fetched += 1
        if self._fetched - 1 == self._at:
            raise CorruptSample(f"micro-batch {self._at} cannot be decoded")
        return super().__next__()


def _stops_at_once(state: Any, kind: str, what: str, began: float, error: BaseException) -> None:
    """Rank 1 raised its own error, rank 0 a CollectiveError naming rank 1, neither after a
    wait on the process-group timeout."""
    text = f"{type(error).__name__}: {error}"
    if state.rank == 1:
        assert isinstance(error, (CorruptSample, MemoryError)), f"{kind}, {what}: {text}"
    else:
        assert isinstance(error, CollectiveError) and "rank(s) [1] raised before" in text, (
            f"{kind}, {what}: {text}"
        )
    assert time.monotonic() - began < w.TIMEOUT.total_seconds() / 2, f"{kind}, {what}: waited on a timeout"


@contextlib.contextmanager
def buffer_copy_failing_on_rank_1(state: Any, nth: int) -> Iterator[None]:
    """Rank 1's `nth` buffer copy (the one before step `nth`) raises MemoryError."""
    real = Buffers.save
    calls = 0

    def save(buffers: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == nth and state.rank == 1:
            raise MemoryError("no room for the buffers' copies")
        real(buffers)

    Buffers.save = save  # type: ignore[method-assign]
    try:
        yield
    finally:
        Buffers.save = real  # type: ignore[method-assign]


def check_a_rank_whose_loader_raises_stops_every_rank_at_once(state: Any) -> None:
    """Rank 1's loader raises at each micro-batch of step 2 in turn, then rank 1's buffer copy
    before step 2: rank 1 raises that error, rank 0 a CollectiveError naming rank 1, both within
    seconds; no gradient is left and the parameters are step 1's. Fails before: rank 0 waited in
    the next agreement until the process-group timeout."""
    for kind in KINDS:
        after_one = _prepare(state, kind)
        _train_kind(state, kind, after_one, tracked(state, kind, K), 1)
        want_one = _parameters(after_one)
        for at in [*range(K), None]:  # None: the buffer copy before step 2 fails instead
            prepared = _prepare(state, kind)
            loader: Tracked = tracked(state, kind, 2 * K)
            if at is not None and state.rank == 1:
                loader = RaisingAt(loader, K + at)
            began = time.monotonic()
            try:
                with buffer_copy_failing_on_rank_1(state, 2) if at is None else contextlib.nullcontext():
                    _train_kind(state, kind, prepared, loader, 2)
            except (CorruptSample, MemoryError, CollectiveError) as exc:
                _stops_at_once(state, kind, f"at {at}", began, exc)
            else:
                raise AssertionError(f"{kind}: train finished although rank 1 raised at {at}")
            assert all(p.grad is None for p in prepared.model.parameters()), f"{kind}: gradients left"
            _assert_same(_parameters(prepared), want_one, f"{kind}, rank 1 raising at {at}: after the error")
        dist.barrier()


def loss_raising_on_rank_1(state: Any, at: int) -> Any:
    """A loss_fn whose `at`th call raises CorruptSample on rank 1, after the model's forward (so
    both ranks ran the forward's own collectives: DDP's buffer broadcast)."""
    calls: list[int] = []

    def loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        calls.append(1)
        value = model(*batch)
        if state.rank == 1 and len(calls) == at:
            raise CorruptSample("rank 1's loss_fn fails")
        return value  # type: ignore[no-any-return]

    return loss


def check_ranks_an_error_left_apart_are_told_so_when_they_train_again(state: Any) -> None:
    """Rank 1's loss_fn raises in step 1's first micro-batch; rank 0 goes on to the agreement
    before the second, where rank 1's next train call meets it with its own first agreement.
    Both raise "ranks out of step", naming the other's place, instead of pairing the two (rank 1
    would have taken rank 0's micro-batch 1 for its step 0). Not under FSDP2, whose backward
    all-gathers: rank 0 waits there, in a device collective, not in an agreement."""
    for kind in ("ddp", "sync"):
        prepared = _prepare(state, kind)

        raising_on_rank_1 = loss_raising_on_rank_1(state, K + 1)
        errors = []
        for attempt in range(2 if state.rank == 1 else 1):
            try:
                _train_kind(state, kind, prepared, tracked(state, kind, 2 * K), 2, loss_fn=raising_on_rank_1)
            except (CorruptSample, CollectiveError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            else:
                raise AssertionError(f"{kind}: attempt {attempt} finished")
        last = errors[-1]
        assert "ranks out of step" in last, (kind, errors)
        other = (
            "rank(s) [0] at step 1 micro-batch 1"
            if state.rank == 1
            else "rank(s) [1] at step 0 micro-batch 0"
        )
        assert other in last, (kind, errors)
        dist.barrier()


w.SCENARIOS["micro_batch_memory"] = [
    check_init,
    check_one_micro_batch_is_held_at_a_time,
    check_a_rank_out_of_batches_at_any_micro_batch_stops_both_and_drops_the_step,
    check_a_loss_fn_with_its_own_collective_stops_cleanly_when_a_rank_runs_out,
    check_a_micro_batch_that_raises_under_fsdp_leaves_no_unsharded_gradient,
    check_a_rank_whose_loader_raises_stops_every_rank_at_once,
    check_ranks_an_error_left_apart_are_told_so_when_they_train_again,
]
w.SCENARIOS["accumulate"].append(
    check_a_step_stopped_after_a_forward_leaves_the_buffers_of_the_completed_steps
)
check_names = w.check_names

if __name__ == "__main__":
    w.main()
