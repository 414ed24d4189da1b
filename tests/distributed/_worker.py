"""One rank of a multi-process torchhal.distributed test: runs a scenario's checks, writes their outcomes.

Run as a script (never collected by pytest):
    python _worker.py SCENARIO RANK WORLD OUT_DIR SEED
"train" (world 2, CPU, gloo): process groups under store prefixes, DDP and FSDP2 against a
single-process reference trained on the whole batch, FSDP2's bf16 policy, the 1-D mesh, and
last a rank given fewer batches than the others.
"hetero" (world 4): ranks 0 and 2 on simulated ASICs of different specs, 1 and 3 on the CPU
(the device comes from WORKER_DEVICE): islands, hierarchical vs flat all-reduce, the
throughput split, weighted gradient sync against the whole-batch reference, the 2-D mesh.
Inputs are random, seeded by (seed, tag), so every rank can rebuild the whole batch.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchhal import distributed as thd
from torchhal.distributed.health import HealthMonitor
from torchhal.hal_core import InvalidArgumentError, telemetry

TIMEOUT = timedelta(seconds=20)
DIM, DEPTH, GLOBAL_BATCH, STEPS = 12, 3, 12, 3


class Net(nn.Module):
    """A small regression model whose blocks sit in `layers`, as a transformer's do."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(DEPTH))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(self.head(x).squeeze(-1).float(), y)


class State:
    def __init__(self, rank: int, world: int, out: Path, seed: int) -> None:
        self.rank, self.world, self.out, self.seed = rank, world, out, seed
        self._ctx: thd.DistContext | None = None
        self._group: thd.HeteroGroup | None = None

    @property
    def ctx(self) -> thd.DistContext:
        assert self._ctx is not None, "the init check failed, so there is no process group"
        return self._ctx

    @property
    def group(self) -> thd.HeteroGroup:
        assert self._group is not None, "the init check failed, so there is no heterogeneous group"
        return self._group

    def generator(self, tag: str) -> torch.Generator:
        return torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{tag}".encode()))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole global batch of `step`, identical on every rank."""
        gen = self.generator(f"batch{step}")
        return torch.randn(GLOBAL_BATCH, DIM, generator=gen), torch.randn(GLOBAL_BATCH, generator=gen)

    def model(self) -> Net:
        torch.manual_seed(zlib.crc32(f"{self.seed}:model".encode()))
        return Net()


def adamw(params) -> torch.optim.AdamW:
    """Every run's optimizer. eps 1e-4, not 1e-8: Adam's step g / (|g| + eps) multiplies the fp32
    rounding error of a gradient element (the data-parallel all-reduce sums in another order than
    the whole batch) by up to ~1 / eps where the element cancels to about eps. Emulated in one
    process (two half-batch gradients averaged against the whole batch's, this scenario's model,
    seeds 0-399): with eps 1e-8 three seeds moved a weight past the checks' tolerance (atol 1e-6)
    after three steps, as seed 833628371 did here (1.5e-5); with 1e-4 none did, the worst 4.6e-7."""
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4)


def reference_run(model: Net, state: State, *, clip: float) -> tuple[Net, list[float]]:
    """The same training in one process on the whole batch: what every data-parallel run must match."""
    opt = adamw(model.parameters())
    norms = []
    for step in range(STEPS):
        loss = model(*state.batch(step))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return model, norms


def even_rows(state: State) -> slice:
    share = GLOBAL_BATCH // state.world
    return slice(state.rank * share, (state.rank + 1) * share)


# -- scenario "train" -------------------------------------------------------------------------


def check_prefix_generations(state: State) -> None:
    """A group made under prefix gen0, destroyed, and rebuilt under gen1 on the same store works."""
    store = dist.FileStore(str(state.out / "store"), state.world)
    for generation in ("gen0", "gen1"):
        ctx = thd.init(
            device="cpu",
            rank=state.rank,
            world_size=state.world,
            store=store,
            prefix=generation,
            timeout=TIMEOUT,
        )
        assert (ctx.rank, ctx.world_size, ctx.prefix) == (state.rank, state.world, generation)
        assert (ctx.device.id, ctx.backend, ctx.local_rank) == ("cpu", "gloo", state.rank)
        t = torch.tensor([float(state.rank + 1)])
        ctx.communicator.all_reduce(t)
        assert t.item() == state.world * (state.world + 1) / 2
        if generation == "gen0":
            ctx.shutdown()
            assert not dist.is_initialized()
    state._ctx = ctx


def check_mesh_in_rank_order(state: State) -> None:
    mesh = thd.Mesh.create(state.ctx)
    assert mesh.order == (0, 1) and mesh.names == ("dp",)
    assert mesh.device_mesh.mesh.tolist() == [0, 1]


def check_ddp_matches_whole_batch_reference(state: State) -> None:
    model = state.model()
    reference, norms = reference_run(copy.deepcopy(model), state, clip=0.5)
    prepared = thd.prepare(model, adamw, ctx=state.ctx, strategy="ddp")
    assert prepared.policy.name == "fp32" and prepared.scaler is None
    rows = even_rows(state)
    batches = [tuple(t[rows] for t in state.batch(step)) for step in range(STEPS)]
    stats = thd.train(
        prepared.model,
        prepared.optimizer,
        batches,
        steps=STEPS,
        ctx=state.ctx,
        policy=prepared.policy,
        clip_grad_norm=0.5,
    )
    assert [s.step for s in stats] == list(range(STEPS))
    torch.testing.assert_close([s.grad_norm for s in stats], norms, rtol=1e-5, atol=1e-7)
    for (name, p), (_, q) in zip(
        prepared.model.module.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def check_a_slow_rank_is_flagged_by_its_forward_time(state: State) -> None:
    """Rank 1's forward sleeps 30 ms a step. Under DDP the gradient all-reduce makes every rank's
    step last as long as rank 1's, so whole-step times look alike; the forward times do not, and
    rank 0's monitor flags rank 1 from them."""
    store = dist.FileStore(str(state.out / "straggler_store"), state.world)
    monitor = HealthMonitor(store, rank=state.rank, world_size=state.world, interval=0.05, deadline=10.0)
    prepared = thd.prepare(
        state.model(), lambda p: torch.optim.SGD(p, lr=1e-3), ctx=state.ctx, strategy="ddp"
    )
    rows = even_rows(state)

    def slow_on_rank_1(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if state.rank == 1:
            time.sleep(0.03)
        return model(*batch)

    key = "torchhal.health.straggler,rank=1"
    before = telemetry.counts().get(key, 0)
    with monitor:
        stats = thd.train(
            prepared.model,
            prepared.optimizer,
            [tuple(t[rows] for t in state.batch(step % STEPS)) for step in range(20)],
            steps=20,
            ctx=state.ctx,
            policy=prepared.policy,
            loss_fn=slow_on_rank_1,
            on_step=monitor.observe,
        )
    forward = statistics.median(s.forward_s for s in stats)
    whole = statistics.median(s.step_time_s for s in stats)
    both: list[object] = [None] * state.world
    dist.all_gather_object(both, (forward, whole))
    (fast_forward, fast_whole), (slow_forward, slow_whole) = both
    assert slow_forward > 0.03 > 5 * fast_forward, both
    assert max(fast_whole, slow_whole) < 1.5 * min(fast_whole, slow_whole), both  # the sync evens them
    flagged = telemetry.counts().get(key, 0) - before  # rank 0 checks; a median that dips re-arms it
    assert flagged >= 1 if state.rank == 0 else flagged == 0, (state.rank, flagged, monitor.peers())


def check_fsdp_matches_whole_batch_reference(state: State) -> None:
    model = state.model()
    reference, norms = reference_run(copy.deepcopy(model), state, clip=0.5)
    optimizer = adamw(model.parameters())  # an instance: given the shards in place
    prepared = thd.prepare(model, optimizer, ctx=state.ctx, strategy="fsdp")
    assert prepared.sharded_blocks == DEPTH and prepared.optimizer is optimizer
    held = [p for g in prepared.optimizer.param_groups for p in g["params"]]
    assert [id(p) for p in held] == [id(p) for p in prepared.model.parameters()]
    for p in prepared.model.parameters():  # dim 0 split as torch.chunk splits it; missing chunks are empty
        chunks = [len(c) for c in torch.empty(p.shape[0]).chunk(state.world)]
        assert p.to_local().shape[0] == (chunks[state.rank] if state.rank < len(chunks) else 0)
    rows = even_rows(state)
    batches = [tuple(t[rows] for t in state.batch(step)) for step in range(STEPS)]
    stats = thd.train(
        prepared.model,
        prepared.optimizer,
        batches,
        steps=STEPS,
        ctx=state.ctx,
        policy=prepared.policy,
        clip_grad_norm=0.5,
    )
    torch.testing.assert_close([s.grad_norm for s in stats], norms, rtol=1e-5, atol=1e-7)
    for (name, p), (_, q) in zip(
        prepared.model.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(
            p.full_tensor(), q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


def check_fsdp_bf16_policy_computes_in_bf16_and_keeps_fp32_state(state: State) -> None:
    model = state.model()
    reference = copy.deepcopy(model)
    policy = thd.choose_precision(state.ctx.device, prefer="bf16")
    prepared = thd.prepare(model, adamw, ctx=state.ctx, strategy="fsdp", policy=policy)
    assert prepared.policy.report()["autocast"] is False  # FSDP casts the parameters itself
    seen: list[torch.dtype] = []
    first = prepared.model.layers[0][0]
    first.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
    rows = even_rows(state)
    batch = tuple(t[rows] for t in state.batch(0))
    (stats,) = thd.train(
        prepared.model, prepared.optimizer, [batch], steps=1, ctx=state.ctx, policy=prepared.policy
    )
    assert seen == [torch.bfloat16], seen
    assert all(p.dtype == torch.float32 for p in prepared.model.parameters())
    expected = float(reference(*batch))
    assert abs(stats.loss - expected) <= 0.03 * abs(expected) + 1e-3, (stats.loss, expected)
    assert stats.loss != expected  # bf16 arithmetic really ran


# -- scenario "hetero" ------------------------------------------------------------------------


def check_init_on_assigned_device(state: State) -> None:
    device = os.environ["WORKER_DEVICE"]
    state._ctx = ctx = thd.init(
        device=device,
        rank=state.rank,
        world_size=state.world,
        init_method=f"file://{state.out / 'store'}",
        timeout=TIMEOUT,
    )
    assert ctx.device.id == device and ctx.device.simulated == device.startswith("simasic")
    assert ctx.backend == "gloo"
    rate = thd.measured_throughput(ctx.hal, ctx.device, torch.float32, (128, 128, 128))
    state._group = thd.HeteroGroup.create(ctx, global_batch=GLOBAL_BATCH, throughput=rate)


def check_islands_by_vendor(state: State) -> None:
    islands = state.group.islands
    assert [i.ranks for i in islands.layout] == [(0, 2), (1, 3)]
    assert islands.is_leader == (state.rank in (0, 1))


def check_hierarchical_all_reduce_equals_flat(state: State) -> None:
    islands = state.group.islands
    assert islands.form == "sharded" and islands.lane is not None and islands.lane.world_size == 2
    for shape in ((1000,), (7, 13)):
        everyone = [
            torch.randn(shape, generator=state.generator(f"grad{shape}{r}")) for r in range(state.world)
        ]
        mine = everyone[state.rank]
        flat = state.ctx.communicator.all_reduce(mine.clone())
        hier = islands.hierarchical_all_reduce(mine.clone())
        expected = torch.stack([t.double() for t in everyone]).sum(0).float()
        torch.testing.assert_close(hier, flat, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(hier, expected, rtol=1e-5, atol=1e-6)
        avg = islands.hierarchical_all_reduce(mine.clone(), "avg")
        torch.testing.assert_close(avg, expected / state.world, rtol=1e-5, atol=1e-6)


def check_split_follows_throughput_and_balances_step_time(state: State) -> None:
    group = state.group
    rates = group.throughputs
    assert rates[0] < rates[2], (
        f"the edge spec (rank 0) must measure slower than datacenter (rank 2): {rates}"
    )
    everyone: list[object] = [None] * state.world
    dist.all_gather_object(everyone, group.batch_sizes)
    assert all(sizes == group.batch_sizes for sizes in everyone)
    assert group.batch_sizes == thd.split_batch(GLOBAL_BATCH, rates)
    assert sum(group.batch_sizes) == GLOBAL_BATCH and min(group.batch_sizes) >= 1
    big = 4096  # a batch where every quota is >= 1, so rounding alone limits the balance
    sizes = thd.split_batch(big, rates)
    quotas = [big * t / sum(rates) for t in rates]
    assert all(q >= 1 for q in quotas), quotas
    assert all(abs(b - q) < 1 for b, q in zip(sizes, quotas, strict=True)), (sizes, quotas)
    flop = 6 * DIM * DIM * DEPTH  # per sample; any positive constant gives the same ratios
    times = thd.modelled_step_times(sizes, rates, flop)
    ideal = big * flop / (sum(rates) * 1e12)
    for t, rate in zip(times, rates, strict=True):
        assert abs(t - ideal) <= flop / (rate * 1e12), (times, ideal)  # within one sample's time
    even = thd.modelled_step_times([big // state.world] * state.world, rates, flop)
    assert max(times) / min(times) < max(even) / min(even)


def _assert_synced_gradients_equal_whole_batch(state: State) -> None:
    """One backward on this rank's share, the weighted sync, against the whole batch in one model."""
    group = state.group
    model, reference = state.model(), state.model()
    x, y = state.batch(0)
    model(group.local_slice(x), group.local_slice(y)).backward()
    group.sync_gradients(model)
    reference(x, y).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


def check_weighted_sync_matches_whole_batch_reference(state: State) -> None:
    group = state.group
    _assert_synced_gradients_equal_whole_batch(state)
    model = state.model()
    reference, norms = reference_run(state.model(), state, clip=0.5)
    policy = thd.choose_precision(state.ctx.device, prefer="fp32")
    prepared = thd.prepare(model, adamw, ctx=state.ctx, strategy="local", policy=policy)
    batches = [tuple(group.local_slice(t) for t in state.batch(step)) for step in range(STEPS)]
    stats = thd.train(
        prepared.model,
        prepared.optimizer,
        batches,
        steps=STEPS,
        ctx=state.ctx,
        policy=prepared.policy,
        clip_grad_norm=0.5,
        grad_sync=group.sync_gradients,
    )
    torch.testing.assert_close([s.grad_norm for s in stats], norms, rtol=1e-5, atol=1e-7)
    for (name, p), (_, q) in zip(
        prepared.model.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def check_rebalance_agrees_on_every_rank_and_keeps_the_sync_exact(state: State) -> None:
    """Each rank times its share of a matmul workload through the HAL on its own device's timer
    (simulated time on the ASICs, which charge only the HAL's ops; wall time on the CPUs); every
    rank gets the same new split, and the weighted sync stays exact under it."""
    group, ctx = state.group, state.ctx
    x = ctx.device.empty((64 * group.local_batch, 128), torch.float32).normal_()
    w = ctx.device.empty((128, 128), torch.float32).normal_()
    ctx.hal.kernels.call("matmul", ctx.device, x, w)  # warm-up
    timer = ctx.device.timer()
    start = timer.mark()
    ctx.hal.kernels.call("matmul", ctx.device, x, w)
    sizes = group.rebalance(timer.elapsed_ms(start, timer.mark()) / 1e3)
    everyone: list[object] = [None] * state.world
    dist.all_gather_object(everyone, sizes)
    assert all(other == sizes for other in everyone), everyone
    assert sum(sizes) == GLOBAL_BATCH and min(sizes) >= 1 and group.local_batch == sizes[state.rank]
    _assert_synced_gradients_equal_whole_batch(state)


def check_mesh_keeps_islands_on_the_inner_dimension(state: State) -> None:
    key = "torchhal.distributed.mesh_inner_spans_islands"
    before = telemetry.counts().get(key, 0)
    mesh = thd.Mesh.create(state.ctx, (2, 2), ("outer", "inner"))
    assert telemetry.counts().get(key, 0) == before  # each inner group stays on one island
    assert mesh.order == (0, 2, 1, 3), mesh.order  # simasic:0 precedes cpu in every rank's topology
    assert mesh.device_mesh.mesh.tolist() == [[0, 2], [1, 3]]
    for name, groups in (("inner", ((0, 2), (1, 3))), ("outer", ((0, 1), (2, 3)))):
        t = torch.tensor([float(state.rank + 1)])
        dist.all_reduce(t, group=mesh.group(name))
        (members,) = [g for g in groups if state.rank in g]
        assert t.item() == sum(r + 1 for r in members), (name, t.item())
    thd.Mesh.create(state.ctx, (1, 4), ("outer", "inner"))  # an inner group of 4 spans both islands
    assert telemetry.counts()[key] == before + 1


def check_a_rank_with_fewer_batches_stops_every_rank_naming_it(state: State) -> None:
    """Rank 1 gets fewer batches than `steps` (last in its world: every rank then stops). Both
    ranks raise naming rank 1 within seconds; before, rank 0 waited in DDP's all-reduce until the
    collective timeout, or until rank 1 left, and failed with gloo's error naming no rank."""
    steps, short_by = 3, 1 + state.seed % 2
    prepared = thd.prepare(nn.Linear(DIM, 1), lambda p: torch.optim.SGD(p, lr=0.1), ctx=state.ctx)
    batches = [(torch.randn(3, DIM),) for _ in range(steps - short_by if state.rank == 1 else steps)]
    began = time.monotonic()
    try:
        thd.train(
            prepared.model,
            prepared.optimizer,
            batches,
            steps=steps,
            ctx=state.ctx,
            policy=prepared.policy,
            loss_fn=lambda model, batch: model(batch[0]).square().mean(),
        )
    except InvalidArgumentError as exc:
        want = f"batches ran out after {steps - short_by} of {steps} steps on rank(s) [1]"
        assert want in str(exc), str(exc)
        assert time.monotonic() - began < TIMEOUT.total_seconds() / 2, "the error waited on a timeout"
        return
    raise AssertionError("train finished although rank 1 had too few batches")


SCENARIOS: dict[str, list[Callable[[State], None]]] = {
    "train": [
        check_prefix_generations,
        check_mesh_in_rank_order,
        check_ddp_matches_whole_batch_reference,
        check_a_slow_rank_is_flagged_by_its_forward_time,
        check_fsdp_matches_whole_batch_reference,
        check_fsdp_bf16_policy_computes_in_bf16_and_keeps_fp32_state,
        check_a_rank_with_fewer_batches_stops_every_rank_naming_it,
    ],
    "hetero": [
        check_init_on_assigned_device,
        check_islands_by_vendor,
        check_hierarchical_all_reduce_equals_flat,
        check_split_follows_throughput_and_balances_step_time,
        check_weighted_sync_matches_whole_batch_reference,
        check_rebalance_agrees_on_every_rank_and_keeps_the_sync_exact,
        check_mesh_keeps_islands_on_the_inner_dimension,
    ],
}


def check_names(scenario: str) -> list[str]:
    return [fn.__name__.removeprefix("check_") for fn in SCENARIOS[scenario]]


def main() -> None:
    scenario, rank, world, out, seed = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        Path(sys.argv[4]),
        int(sys.argv[5]),
    )
    state = State(rank, world, out, seed)
    results: dict[str, str] = {}
    failed = None
    for check in SCENARIOS[scenario]:
        name = check.__name__.removeprefix("check_")
        if failed is not None:  # later checks would wait on collectives the failed one left behind
            results[name] = f"not run: check {failed!r} failed before it"
            continue
        try:
            check(state)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
            failed = name
    if state._ctx is not None:
        state._ctx.shutdown()
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
