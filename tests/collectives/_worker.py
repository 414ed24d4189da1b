"""One rank of a multi-process Communicator test: runs named checks, writes their outcomes as JSON.

Run as a script (never collected by pytest):
    python _worker.py SCENARIO RANK WORLD OUT_DIR SEED INIT
SCENARIO is "suite" (every check in CHECKS on host tensors over gloo), "gpu_suite" (the same
checks on one GPU per rank over nccl) or "timeout"; INIT is "env" (torchrun's variables, set by
the caller), "file" (a FileStore URL under OUT_DIR) or "store" (a FileStore object).
Inputs are random, seeded per (seed, tag, rank), so every rank can rebuild every other rank's
input and compute the expected result on its own.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import (
    ConfigurationError,
    DeviceCapabilities,
    DType,
    HealthReport,
    HealthStatus,
    InvalidArgumentError,
    MemoryInfo,
    ProbeResult,
    Topology,
    UnsupportedError,
    VendorAdapter,
    telemetry,
)
from torchhal.hal_core.collectives import Communicator, Islands

SUITE_TIMEOUT = timedelta(seconds=30)
SHORT_TIMEOUT = timedelta(seconds=2)


class Ctx:
    """What a check needs: the communicators, this rank's place, and the shared input recipe."""

    def __init__(self, hal: HardwareAbstractionLayer, comm: Communicator, seed: int, out: Path) -> None:
        self.hal, self.comm, self.seed, self.out = hal, comm, seed, out
        self.rank, self.world = comm.rank, comm.world_size
        self.device = comm.device.torch_device
        self.composed = Communicator.create(hal, fused=False)  # same group, composed paths

    def inputs(
        self, tag: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
    ) -> list[torch.Tensor]:
        """Every rank's input for `tag`: uniform in [0.5, 1.5) (integers in [1, 100)), never zero."""
        out = []
        for r in range(self.world):
            gen = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{tag}:{r}".encode()))
            if dtype.is_floating_point:
                out.append(
                    (torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5).to(self.device, dtype)
                )
            else:
                out.append(torch.randint(1, 100, shape, generator=gen).to(self.device, dtype))
        return out

    def rand(self, *shape: int) -> torch.Tensor:
        """An unseeded tensor in [0.5, 1.5) on this rank's device, for inputs that must be refused."""
        return torch.rand(shape, device=self.device) + 0.5


CHECKS: dict[str, Callable[[Ctx], None]] = {}


def check(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def _reduced(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction computed here in float64, independently of any backend."""
    stack = torch.stack([x.double() for x in xs])
    return {
        "sum": stack.sum(0),
        "avg": stack.mean(0),
        "max": stack.amax(0),
        "min": stack.amin(0),
        "product": stack.prod(0),
    }[op]


def _composed_count(ctx: Ctx, collective: str) -> int:
    key = f"torchhal.collective.composed,backend={ctx.comm.backend},collective={collective}"
    return telemetry.counts().get(key, 0)


def _all_reduce_check(op: str) -> Callable[[Ctx], None]:
    def run(ctx: Ctx) -> None:
        xs = ctx.inputs(f"all_reduce_{op}", (7, 5))
        t = xs[ctx.rank].clone()
        assert ctx.comm.all_reduce(t, op=op) is t, "all_reduce returns the tensor it reduced in place"
        torch.testing.assert_close(t, _reduced(xs, op).float())

    run.__name__ = f"check_all_reduce_{op}"
    return run


for _op in ("sum", "avg", "max", "min", "product"):
    check(_all_reduce_check(_op))


@check
def check_all_reduce_int64_and_bf16(ctx: Ctx) -> None:
    ints = ctx.inputs("ar_int", (9,), torch.int64)
    t = ints[ctx.rank].clone()
    ctx.comm.all_reduce(t)
    assert torch.equal(t, torch.stack(ints).sum(0)), (t, ints)
    halves = ctx.inputs("ar_bf16", (4, 4), torch.bfloat16)
    h = halves[ctx.rank].clone()
    ctx.comm.all_reduce(h, op="max")
    torch.testing.assert_close(h, torch.stack(halves).amax(0))


@check
def check_all_reduce_complex_and_coalesced(ctx: Ctx) -> None:
    """The cases the Communicator leaves to dist.all_reduce's wrapper: complex tensors (reduced as
    real pairs) and a coalescing block (recorded, then issued together when the block ends)."""
    re, im = ctx.inputs("ar_complex_re", (3, 4)), ctx.inputs("ar_complex_im", (3, 4))
    c = torch.complex(re[ctx.rank], im[ctx.rank])
    ctx.comm.all_reduce(c)
    torch.testing.assert_close(c, torch.complex(_reduced(re, "sum"), _reduced(im, "sum")).to(c.dtype))
    xs, ys = ctx.inputs("ar_coalesced_x", (5,)), ctx.inputs("ar_coalesced_y", (2, 3))
    x, y = xs[ctx.rank].clone(), ys[ctx.rank].clone()
    with dist.distributed_c10d._coalescing_manager(group=ctx.comm.group):
        ctx.comm.all_reduce(x)
        ctx.comm.all_reduce(y)
        assert torch.equal(x, xs[ctx.rank]), "inside the block the all-reduce is only recorded"
    torch.testing.assert_close(x, _reduced(xs, "sum").float())
    torch.testing.assert_close(y, _reduced(ys, "sum").float())


@check
def check_all_reduce_avg_composed(ctx: Ctx) -> None:
    before = _composed_count(ctx, "all_reduce:avg")
    xs = ctx.inputs("ar_avg_composed", (6, 2))
    t = xs[ctx.rank].clone()
    ctx.composed.all_reduce(t, op="avg")
    torch.testing.assert_close(t, _reduced(xs, "avg").float())
    assert _composed_count(ctx, "all_reduce:avg") == before + 1, "fused=False must take the composed path"


@check
def check_reduce_to_last_rank(ctx: Ctx) -> None:
    xs = ctx.inputs("reduce", (3, 4))
    t = xs[ctx.rank].clone()
    ctx.comm.reduce(t, dst=ctx.world - 1, op="sum")
    if ctx.rank == ctx.world - 1:
        torch.testing.assert_close(t, _reduced(xs, "sum").float())


def _all_gather(ctx: Ctx, comm: Communicator, tag: str) -> None:
    xs = ctx.inputs(tag, (3, 5))
    out = comm.all_gather(xs[ctx.rank])
    assert out.shape == (3 * ctx.world, 5), out.shape
    torch.testing.assert_close(out, torch.cat(xs), rtol=0, atol=0)


@check
def check_all_gather(ctx: Ctx) -> None:
    _all_gather(ctx, ctx.comm, "all_gather")


@check
def check_host_all_gather(ctx: Ctx) -> None:
    """Every rank's number in rank order, on the host side of the group (gloo under nccl too)."""
    values = [float(x) for x in ctx.inputs("host_all_gather", (1,))]
    gathered = ctx.comm.host_all_gather(values[ctx.rank])
    assert gathered == values, (gathered, values)
    assert all(type(v) is float for v in gathered)


@check
def check_all_gather_composed(ctx: Ctx) -> None:
    before = _composed_count(ctx, "all_gather")
    _all_gather(ctx, ctx.composed, "all_gather_composed")
    assert _composed_count(ctx, "all_gather") == before + 1


@check
def check_all_gather_refused_by_backend(ctx: Ctx) -> None:
    """A backend that refuses the fused form when it is issued (as gloo did in older torch releases)
    gets the composed one, and is not asked again."""
    refusals: list[str] = []

    def refuse(*args: object, **kwargs: object) -> None:
        refusals.append("refused")
        raise RuntimeError("Backend gloo does not support allgather_base")

    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    saved = {n: getattr(dist, n) for n in names}
    fresh = Communicator.create(ctx.hal)  # its own record of what the backend refused
    before = _composed_count(ctx, "all_gather")
    try:
        for n in names:
            setattr(dist, n, refuse)
        _all_gather(ctx, fresh, "refused_1")
        _all_gather(ctx, fresh, "refused_2")
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
    assert refusals == ["refused"], f"the refusal is remembered after the first call, saw {refusals}"
    assert _composed_count(ctx, "all_gather") == before + 2


@check
def check_a_group_this_rank_is_not_in_is_refused_by_name(ctx: Ctx) -> None:
    """Wrapping it raised torch's bare "Invalid process group specified"."""
    first_only = dist.new_group([0])
    if ctx.rank == 0:
        alone = Communicator.create(ctx.hal, group=first_only)
        assert alone.world_size == 1
        alone.destroy()
    else:
        with pytest.raises(
            ConfigurationError, match=rf"rank {ctx.rank} of the default group is not a member"
        ):
            Communicator.create(ctx.hal, group=first_only)
    dist.destroy_process_group(first_only)


def _reduce_scatter(ctx: Ctx, comm: Communicator, op: str, tag: str) -> None:
    xs = ctx.inputs(tag, (2 * ctx.world, 3))
    out = comm.reduce_scatter(xs[ctx.rank], op=op)
    expected = _reduced(xs, op).float().chunk(ctx.world)[ctx.rank]
    torch.testing.assert_close(out, expected)


@check
def check_reduce_scatter(ctx: Ctx) -> None:
    _reduce_scatter(ctx, ctx.comm, "sum", "rs_sum")
    _reduce_scatter(ctx, ctx.comm, "max", "rs_max")


@check
def check_reduce_scatter_composed(ctx: Ctx) -> None:
    before = _composed_count(ctx, "reduce_scatter")
    _reduce_scatter(ctx, ctx.composed, "sum", "rs_composed_sum")
    _reduce_scatter(ctx, ctx.composed, "avg", "rs_composed_avg")
    assert _composed_count(ctx, "reduce_scatter") == before + 2


@check
def check_broadcast_from_last_rank(ctx: Ctx) -> None:
    src = ctx.world - 1
    xs = ctx.inputs("broadcast", (4, 3))
    t = xs[ctx.rank].clone()
    assert ctx.comm.broadcast(t, src=src) is t
    torch.testing.assert_close(t, xs[src], rtol=0, atol=0)


def _all_to_all(ctx: Ctx, comm: Communicator, tag: str) -> None:
    xs = ctx.inputs(tag, (2 * ctx.world, 3))
    out = comm.all_to_all(xs[ctx.rank])
    expected = torch.cat([xs[src].chunk(ctx.world)[ctx.rank] for src in range(ctx.world)])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@check
def check_all_to_all(ctx: Ctx) -> None:
    _all_to_all(ctx, ctx.comm, "all_to_all")


@check
def check_all_to_all_composed(ctx: Ctx) -> None:
    before = _composed_count(ctx, "all_to_all")
    _all_to_all(ctx, ctx.composed, "all_to_all_composed")
    assert _composed_count(ctx, "all_to_all") == before + 1


@check
def check_send_recv_ring(ctx: Ctx) -> None:
    xs = ctx.inputs("ring", (5,))
    right, left = (ctx.rank + 1) % ctx.world, (ctx.rank - 1) % ctx.world
    got = torch.empty(5, device=ctx.device)
    if ctx.rank % 2 == 0:  # even ranks send first, odd ranks receive first: no rank waits on itself
        ctx.comm.send(xs[ctx.rank], right)
        ctx.comm.recv(got, left)
    else:
        ctx.comm.recv(got, left)
        ctx.comm.send(xs[ctx.rank], right)
    torch.testing.assert_close(got, xs[left], rtol=0, atol=0)


@check
def check_barrier_waits_for_the_slowest(ctx: Ctx) -> None:
    store = dist.FileStore(str(ctx.out / "barrier_store"), ctx.world)
    if ctx.rank == 0:
        time.sleep(0.5)  # without a barrier, every other rank would look before this key exists
    store.set(f"arrived/{ctx.rank}", "1")
    ctx.comm.barrier()
    keys = [f"arrived/{r}" for r in range(ctx.world)]
    assert store.check(keys), f"rank {ctx.rank} left the barrier before every rank arrived"


def _record_calls(islands: Islands) -> list[tuple[str, int]]:
    """Wrap the collectives of this rank's island and lane communicators so that the calls a
    hierarchical all-reduce makes through them are recorded with the elements each one carries
    (("island.reduce_scatter", 48), ...)."""
    calls: list[tuple[str, int]] = []
    for who, comm in (("island", islands.island), ("lane", islands.lane)):
        for name in ("reduce_scatter", "all_gather", "all_reduce", "reduce", "broadcast") if comm else ():
            inner = getattr(comm, name)

            def recorded(
                tensor: torch.Tensor,
                *args: object,
                _inner: Callable = inner,
                _tag: str = f"{who}.{name}",
                **kw: object,
            ):
                calls.append((_tag, tensor.numel()))
                return _inner(tensor, *args, **kw)

            setattr(comm, name, recorded)
    return calls


def _check_hierarchical(
    ctx: Ctx, islands: Islands, tag: str, expected_calls: Callable[[int], list[tuple[str, int]]]
) -> None:
    """Every op, on a shape that splits evenly over an island and one that needs padding, equals
    the flat all-reduce and the reference, and takes exactly the path `expected_calls(numel)`
    gives, moving the elements it says."""
    calls = _record_calls(islands)
    for op in ("sum", "avg", "max", "product"):
        for shape in ((6, 8), (5, 7)):
            xs = ctx.inputs(f"{tag}_{op}_{shape}", shape)
            hier, flat = xs[ctx.rank].clone(), xs[ctx.rank].clone()
            calls.clear()
            islands.hierarchical_all_reduce(hier, op=op)
            assert calls == expected_calls(hier.numel()), (op, shape, calls)
            ctx.comm.all_reduce(flat, op=op)
            torch.testing.assert_close(hier, flat)
            torch.testing.assert_close(hier, _reduced(xs, op).float())


@check
def check_hierarchical_equals_flat(ctx: Ctx) -> None:
    half = ctx.world // 2  # ranks from here on pose as another vendor: two islands
    islands = ctx.comm.islands(vendor="acme" if ctx.rank >= half else None)
    expected = [
        (ctx.comm.device.capabilities.vendor, list(range(half))),
        ("acme", list(range(half, ctx.world))),
    ]
    assert [(i.vendor, list(i.ranks)) for i in islands.layout] == expected
    assert islands.is_leader == (ctx.rank in (0, half))
    assert islands.island.world_size == half
    assert islands.form == "sharded"  # equal islands: every rank carries its shard across
    assert islands.lane is not None and islands.lane.world_size == 2

    def sharded(n: int) -> list[tuple[str, int]]:
        shard = -(-n // half)
        return [
            ("island.reduce_scatter", shard * half),
            ("lane.all_reduce", shard),
            ("island.all_gather", shard),
        ]

    _check_hierarchical(ctx, islands, "hier", sharded)


@check
def check_hierarchical_one_island_all_reduces_on_its_own_backend(ctx: Ctx) -> None:
    islands = ctx.comm.islands()
    assert islands.form == "single" and islands.lane is None and islands.island.world_size == ctx.world
    _check_hierarchical(ctx, islands, "single", lambda n: [("island.all_reduce", n)])


@check
def check_hierarchical_unequal_islands_bridge_their_leaders(ctx: Ctx) -> None:
    """Rank 0 alone against the rest: with 4 ranks the islands (1 and 3) have no common sharding,
    so the leaders carry the whole tensor across, and the fallback is counted."""
    islands = ctx.comm.islands(vendor="acme" if ctx.rank >= 1 else None)
    if ctx.world == 2:  # 1 and 1: equal, so sharded
        assert islands.form == "sharded"
        return
    assert islands.form == "leaders"
    assert (islands.lane is not None) == islands.is_leader == (ctx.rank in (0, 1))
    before = telemetry.counts().get("torchhal.collective.hierarchical_leaders,islands=2", 0)
    bridged = ["lane.all_reduce"] if islands.is_leader else []
    path = ["island.reduce", *bridged, "island.broadcast"]
    _check_hierarchical(ctx, islands, "unequal", lambda n: [(name, n) for name in path])
    assert telemetry.counts()["torchhal.collective.hierarchical_leaders,islands=2"] == before + 8


@check
def check_tensors_requiring_grad(ctx: Ctx) -> None:
    """Collectives are not differentiable: on tensors that require grad, every collective, fused
    and composed, gives the values it gives on plain ones, writes leaves in place (they stay
    leaves, with no grad), and returns tensors that do not require grad."""
    w, last = ctx.world, ctx.world - 1
    leaves: list[torch.Tensor] = []

    def leaf(tag: str, shape: tuple[int, ...]) -> tuple[list[torch.Tensor], torch.Tensor]:
        xs = ctx.inputs(f"grad_{tag}", shape)
        leaves.append(xs[ctx.rank].clone().requires_grad_())
        return xs, leaves[-1]

    for comm in (ctx.comm, ctx.composed):
        form = "fused" if comm.fused else "composed"
        for op in ("sum", "avg"):
            xs, t = leaf(f"all_reduce_{op}_{form}", (5, 3))
            assert comm.all_reduce(t, op=op) is t
            torch.testing.assert_close(t.detach(), _reduced(xs, op).float(), msg=f"{form} all_reduce {op}")
            xs, t = leaf(f"reduce_{op}_{form}", (4,))
            comm.reduce(t, dst=last, op=op)
            if ctx.rank == last:
                torch.testing.assert_close(t.detach(), _reduced(xs, op).float(), msg=f"{form} reduce {op}")
        xs, t = leaf(f"all_gather_{form}", (3, 2))
        out = comm.all_gather(t)
        assert not out.requires_grad, f"{form} all_gather output requires grad"
        torch.testing.assert_close(out, torch.cat(xs), rtol=0, atol=0)
        xs, t = leaf(f"reduce_scatter_{form}", (2 * w, 3))
        out = comm.reduce_scatter(t, op="avg")
        assert not out.requires_grad, f"{form} reduce_scatter output requires grad"
        torch.testing.assert_close(out, _reduced(xs, "avg").float().chunk(w)[ctx.rank])
        xs, t = leaf(f"all_to_all_{form}", (2 * w, 3))
        out = comm.all_to_all(t)
        assert not out.requires_grad, f"{form} all_to_all output requires grad"
        torch.testing.assert_close(out, torch.cat([x.chunk(w)[ctx.rank] for x in xs]), rtol=0, atol=0)
    xs, t = leaf("broadcast", (4, 3))
    ctx.comm.broadcast(t, src=last)
    torch.testing.assert_close(t.detach(), xs[last], rtol=0, atol=0)
    xs, got = leaf("recv", (5,))
    right, left = (ctx.rank + 1) % w, (ctx.rank - 1) % w
    _, sent = leaf("send", (5,))
    if ctx.rank % 2 == 0:
        ctx.comm.send(sent, right)
        ctx.comm.recv(got, left)
    else:
        ctx.comm.recv(got, left)
        ctx.comm.send(sent, right)
    torch.testing.assert_close(got.detach(), ctx.inputs("grad_send", (5,))[left], rtol=0, atol=0)
    islands = ctx.comm.islands(vendor="acme" if ctx.rank >= w // 2 else None)
    for op in ("sum", "avg"):
        xs, t = leaf(f"hierarchical_{op}", (5, 7))
        islands.hierarchical_all_reduce(t, op=op)
        torch.testing.assert_close(t.detach(), _reduced(xs, op).float(), msg=f"hierarchical {op}")
    for t in leaves:
        assert t.is_leaf and t.requires_grad and t.grad is None, t


@check
def check_sub_communicator(ctx: Ctx) -> None:
    odd = [r for r in range(ctx.world) if r % 2]
    sub = ctx.comm.new_group(odd)
    if ctx.rank not in odd:
        assert sub is None
        return
    assert sub is not None and sub.rank == odd.index(ctx.rank) and sub.world_size == len(odd)
    xs = ctx.inputs("sub", (4,))
    t = xs[ctx.rank].clone()
    sub.all_reduce(t)
    torch.testing.assert_close(t, _reduced([xs[r] for r in odd], "sum").float())


@check
def check_groups_are_made_from_every_rank(ctx: Ctx) -> None:
    """A communicator over some ranks refuses new_group and islands up front (torch's names for
    such groups differ between members with different histories: they hung until the timeout)
    and keeps working."""
    sub = ctx.comm.new_group([0])
    if sub is None:
        return
    for name, call in (("new_group", lambda: sub.new_group([0])), ("islands", sub.islands)):
        with pytest.raises(
            UnsupportedError, match=rf"{name}: this communicator spans ranks \[0\] of {ctx.world}"
        ):
            call()
    x = ctx.inputs("partial_group", (4,))[ctx.rank]
    torch.testing.assert_close(sub.all_reduce(x.clone()), x, rtol=0, atol=0)


@check
def check_bad_inputs(ctx: Ctx) -> None:
    comm, w = ctx.comm, ctx.world
    with pytest.raises(
        InvalidArgumentError, match=rf"reduce_scatter: dim 0 must be divisible .* {w}; .*\({w + 1}, 2\)"
    ):
        comm.reduce_scatter(ctx.rand(w + 1, 2))
    with pytest.raises(
        InvalidArgumentError, match=rf"all_to_all: dim 0 must be divisible .*\({2 * w + 1},\)"
    ):
        comm.all_to_all(ctx.rand(2 * w + 1))
    with pytest.raises(InvalidArgumentError, match=r"all_reduce: op must be one of .* got 'mean'"):
        comm.all_reduce(ctx.rand(3), op="mean")
    with pytest.raises(InvalidArgumentError, match=r"all_reduce: op must be one of .* got \[\]"):
        comm.all_reduce(ctx.rand(3), op=[])  # type: ignore[arg-type]  # was "unhashable type: 'list'"
    with pytest.raises(InvalidArgumentError, match=r"all_reduce: op 'avg' needs a floating-point .*int64"):
        comm.all_reduce(torch.arange(1, 4, device=ctx.device), op="avg")
    with pytest.raises(UnsupportedError, match=rf"all_reduce on {comm.device.id}: dtype torch.float8_e4m3fn"):
        comm.all_reduce(ctx.rand(3).to(torch.float8_e4m3fn))
    with pytest.raises(
        InvalidArgumentError, match=rf"all_gather: tensor is on meta, .* device is {comm.device.id}"
    ):
        comm.all_gather(torch.empty(3, device="meta"))
    with pytest.raises(InvalidArgumentError, match=rf"broadcast: src must be a rank in \[0, {w}\), got {w}"):
        comm.broadcast(ctx.rand(3), src=w)
    with pytest.raises(InvalidArgumentError, match=rf"send: dst must be another rank, .*\({ctx.rank}\)"):
        comm.send(ctx.rand(3), dst=ctx.rank)
    with pytest.raises(
        InvalidArgumentError, match=r"all_reduce: writes the tensor in place, so it must be contiguous"
    ):
        comm.all_reduce(ctx.rand(4, 4).t())
    with pytest.raises(InvalidArgumentError, match=r"all_gather: needs a tensor with at least one dimension"):
        comm.all_gather(torch.tensor(1.5, device=ctx.device))
    with pytest.raises(InvalidArgumentError, match=r"new_group: ranks must be distinct"):
        comm.new_group([0, 0])
    # Every rank refused the same calls before communicating, so the group is still in step.
    xs = ctx.inputs("after_bad", (3,))
    t = xs[ctx.rank].clone()
    comm.all_reduce(t)
    torch.testing.assert_close(t, _reduced(xs, "sum").float())


@check
def check_spans(ctx: Ctx) -> None:
    telemetry.configure(exporter="memory")
    try:
        exporter = telemetry.memory_exporter()
        x = ctx.inputs("span", (8, 4))[ctx.rank]
        ctx.comm.all_reduce(x.clone())
        ctx.comm.all_gather(x)
        spans = {s.name: s for s in exporter.get_finished_spans()}
    finally:
        telemetry.configure(exporter="none")
    for name in ("torchhal.collective.all_reduce", "torchhal.collective.all_gather"):
        attrs = dict(spans[name].attributes or {})
        assert attrs["backend"] == ctx.comm.backend and attrs["world_size"] == ctx.world, attrs
        assert attrs["bytes"] == 8 * 4 * 4, attrs


@check
def check_wrap_existing_group(ctx: Ctx) -> None:
    again = Communicator.create(ctx.hal)
    assert (again.rank, again.world_size, again.backend) == (ctx.rank, ctx.world, ctx.comm.backend)
    assert again.timeout == SUITE_TIMEOUT, f"the wrapped group's own timeout, got {again.timeout}"
    with pytest.raises(
        ConfigurationError, match=rf"rank: given {(ctx.rank + 1) % ctx.world}, .* has {ctx.rank}"
    ):
        Communicator.create(ctx.hal, rank=(ctx.rank + 1) % ctx.world)
    with pytest.raises(
        ConfigurationError, match=r"init_method/store: the default process group already exists"
    ):
        Communicator.create(ctx.hal, init_method="file:///nowhere")
    again.destroy()
    assert dist.is_initialized(), "destroying a wrapper must leave the group it wrapped"
    xs = ctx.inputs("after_wrapper", (3,))
    t = xs[ctx.rank].clone()
    ctx.comm.all_reduce(t)
    torch.testing.assert_close(t, _reduced(xs, "sum").float())


def _run(fn: Callable[[], object]) -> str | None:
    """None when `fn` passed, else its traceback (the test asserts on it)."""
    try:
        fn()
    except Exception:
        return traceback.format_exc()
    return None


class RecordedGPUAdapter(VendorAdapter):
    """The machine's GPUs as recorded H100 facts: the suite needs a device type and a backend only."""

    name = "recorded-gpu"
    vendor = "nvidia"
    priority = 100

    def probe(self) -> ProbeResult:
        return ProbeResult(available=True, reason="recorded facts over present GPUs")

    def discover(self) -> list[DeviceCapabilities]:
        return [
            DeviceCapabilities(
                vendor=self.vendor,
                adapter=self.name,
                device_type="cuda",
                index=i,
                name="NVIDIA H100 80GB HBM3 (recorded)",
                arch="sm_90",
                compute_units=132,
                simd_width=32,
                memory_bytes=80 * 2**30,
                dtypes=frozenset({DType.FP32, DType.BF16, DType.FP16}),
                collective_backends=("nccl",),
            )
            for i in range(torch.cuda.device_count())
        ]

    def synchronize(self, index: int) -> None:
        torch.cuda.synchronize(index)

    def memory_info(self, index: int) -> MemoryInfo:
        raise AssertionError("not used by the suite")

    def health(self, index: int) -> HealthReport:
        return HealthReport(status=HealthStatus.UNKNOWN)

    def topology(self) -> Topology:
        return Topology(devices=tuple(f"cuda:{i}" for i in range(torch.cuda.device_count())))

    def collective_backend(self) -> str:
        return "nccl"


def gpu_suite(rank: int, world: int, out: Path, seed: int, init: str) -> dict[str, object]:
    """The suite on GPUs: LOCAL_RANK picks each rank's GPU, the backend is cuda:nccl,cpu:gloo."""
    return suite(rank, world, out, seed, init, HardwareAbstractionLayer(adapters=[RecordedGPUAdapter()]))


def suite(
    rank: int, world: int, out: Path, seed: int, init: str, hal: HardwareAbstractionLayer | None = None
) -> dict[str, object]:
    hal = hal or HardwareAbstractionLayer()
    if init == "env":  # torchrun's variables, through the HAL's own entry point
        comm = hal.communicator(timeout=SUITE_TIMEOUT)
    else:
        url = (out / "rendezvous").as_uri()
        comm = Communicator.create(hal, rank=rank, world_size=world, init_method=url, timeout=SUITE_TIMEOUT)
    results: dict[str, object] = {}
    with comm:
        ctx = Ctx(hal, comm, seed, out)
        for name, fn in CHECKS.items():
            results[name] = _run(lambda fn=fn: fn(ctx))
    results["destroy"] = _run(
        lambda: _assert(not dist.is_initialized(), "the owner's exit destroys the group")
    )
    return results


def timeout(rank: int, world: int, out: Path, seed: int, init: str) -> dict[str, object]:
    """Rank 0 all-reduces, forms islands and makes a group; rank 1 never joins: each must end in
    a CollectiveError within seconds."""
    store = dist.FileStore(str(out / "rendezvous_store"), world)
    side = dist.FileStore(str(out / "side_store"), world)  # tells rank 1 when rank 0 is done
    comm = Communicator.create(
        HardwareAbstractionLayer(), rank=rank, world_size=world, store=store, timeout=SHORT_TIMEOUT
    )
    # A failed collective leaves its group failing at once, so the all-reduce gets a group of its own.
    spare = comm.new_group([0, 1])
    if rank != 0:
        side.wait(["rank0_done"], timedelta(seconds=60))
        return {}
    assert spare is not None
    outcomes: dict[str, object] = {}
    for name, call in (
        ("new_group", lambda: comm.new_group([0, 1])),
        ("islands", comm.islands),
        ("all_reduce", lambda: spare.all_reduce(torch.rand(16) + 0.5)),
    ):
        start = time.monotonic()
        try:
            call()
        except Exception as exc:  # the test asserts on its type and message
            outcome: dict[str, object] = {"error": type(exc).__name__, "message": str(exc)}
        else:
            outcome = {"error": None, "message": f"{name} returned without its peer"}
        outcome["elapsed_s"] = time.monotonic() - start
        outcomes[name] = outcome
    side.set("rank0_done", "1")
    return outcomes


def _assert(condition: bool, message: str) -> None:
    assert condition, message


if __name__ == "__main__":
    scenario, rank_s, world_s, out_s, seed_s, init_s = sys.argv[1:]
    out_dir = Path(out_s)
    result = {"suite": suite, "gpu_suite": gpu_suite, "timeout": timeout}[scenario](
        int(rank_s), int(world_s), out_dir, int(seed_s), init_s
    )
    (out_dir / f"rank{rank_s}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    if scenario == "timeout":
        # The timed-out all_reduce leaves gloo work pending; its destructor may abort the process
        # at interpreter exit ("terminate called without an active exception"). The outcome is
        # already on disk, so leave without running destructors.
        os._exit(0)
