"""Heterogeneous data parallelism: ranks on devices of different vendors or speeds train one model.

Ranks form single-vendor islands joined by a host (gloo) bridge (`Communicator.islands`); each
rank takes a share of the global batch proportional to its device's matmul throughput, and once
steps have run, `rebalance` re-splits it by each rank's measured step time, so step times
balance (a matmul rate predicts a whole step only roughly); gradients are averaged with each
rank weighted by its share of the batch, through the Communicator's hierarchical all-reduce.
The sync is explicit (after backward, before the optimizer) rather than a DDP comm hook: DDP
averages ranks equally, which is wrong for unequal batch shares, and needs one backend for
every rank's tensors.

`create` and `rebalance` are collectives that exchange each rank's figure together with whether
it could give one: a rank whose profile lookup (or figure) failed makes every rank raise a
CollectiveError naming it and its error, where its peers used to get gloo's bare "Connection
closed by peer" (or wait out the timeout).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from torchhal.hal_core import (
    CollectiveError,
    Device,
    DType,
    InvalidArgumentError,
    UnsupportedError,
    telemetry,
)
from torchhal.hal_core.collective_checks import as_integer

if TYPE_CHECKING:
    from torchhal.distributed.init import DistContext
    from torchhal.hal_core.hal import HardwareAbstractionLayer
    from torchhal.hal_core.islands import Islands

log = telemetry.get_logger("torchhal.distributed.hetero")

BUCKET_BYTES = 25 * 2**20
"""Gradients are reduced in flat buckets of about this size (DDP's default bucket size)."""


def split_batch(global_batch: int, throughputs: Sequence[float]) -> tuple[int, ...]:
    """Per-rank batch sizes proportional to `throughputs`, summing to `global_batch`, each >= 1.

    Largest-remainder rounding: every rank gets its quota rounded down (at least 1), then the
    samples left go to the largest remainders (ties to the lower rank). Where no rank is held
    at the minimum of 1, each size is within one sample of its exact quota.
    """
    n = len(throughputs)
    if n == 0:
        raise InvalidArgumentError("split_batch: needs at least one rank's throughput, got none")
    _check_positive("split_batch", "throughputs", throughputs)
    throughputs = [float(t) for t in throughputs]  # a NumPy or other real number from here on
    batch = as_integer(global_batch)
    if batch is None or batch < n:
        raise InvalidArgumentError(
            f"split_batch: global_batch must be an integer (not bool) >= the number of ranks ({n}), got "
            f"{global_batch!r} ({type(global_batch).__name__})"
        )
    global_batch = batch
    total = math.fsum(throughputs)
    quota = [global_batch * t / total for t in throughputs]
    sizes = [max(1, math.floor(q)) for q in quota]
    while sum(sizes) > global_batch:  # only when minimums of 1 pushed the sum over
        r = max((r for r in range(n) if sizes[r] > 1), key=lambda r: (sizes[r] - quota[r], -r))
        sizes[r] -= 1
    while sum(sizes) < global_batch:
        r = max(range(n), key=lambda r: (quota[r] - sizes[r], -r))
        sizes[r] += 1
    return tuple(sizes)


def _check_positive(what: str, field: str, values: Sequence[float]) -> None:
    """Rates and times divide batches and FLOPs: zero, negative or NaN ones give nonsense, not an
    error. Any real number is taken (a NumPy float32 too); a bool is not."""
    not_real = [
        f"rank {r}: {v!r} ({type(v).__name__})"
        for r, v in enumerate(values)
        if isinstance(v, bool) or not isinstance(v, numbers.Real)
    ]
    if not_real:
        raise InvalidArgumentError(
            f"{what}: {field} must be real numbers (int, float, a NumPy float; not bool), got "
            f"{'; '.join(not_real)}"
        )
    bad = [(r, v) for r, v in enumerate(values) if not (math.isfinite(v) and v > 0)]
    if bad:
        raise InvalidArgumentError(f"{what}: {field} must be finite and > 0, got {bad} (rank, value)")


def rebalanced_split(
    global_batch: int, batch_sizes: Sequence[int], step_times_s: Sequence[float]
) -> tuple[int, ...]:
    """Batch sizes proportional to each rank's measured samples per second (batch ÷ step time).

    A step's time is roughly a fixed part plus a part per sample, so one re-split lands near
    balance and a second one closer still.
    """
    if len(batch_sizes) != len(step_times_s):
        raise InvalidArgumentError(
            f"rebalanced_split: {len(batch_sizes)} batch sizes for {len(step_times_s)} step times"
        )
    bad = [(r, b) for r, b in enumerate(batch_sizes) if (size := as_integer(b)) is None or size < 1]
    if bad:
        raise InvalidArgumentError(
            f"rebalanced_split: batch_sizes must be integers (not bool) >= 1, got {bad} (rank, value)"
        )
    _check_positive("rebalanced_split", "step_times_s", step_times_s)
    return split_batch(global_batch, [b / t for b, t in zip(batch_sizes, step_times_s, strict=True)])


def modelled_step_times(
    batch_sizes: Sequence[int], throughputs: Sequence[float], flop_per_sample: float
) -> tuple[float, ...]:
    """Each rank's modelled compute time per step: batch × FLOP per sample ÷ throughput (TFLOP/s)."""
    if len(batch_sizes) != len(throughputs):
        raise InvalidArgumentError(
            f"modelled_step_times: {len(batch_sizes)} batch sizes for {len(throughputs)} throughputs"
        )
    _check_positive("modelled_step_times", "throughputs", throughputs)
    return tuple(b * flop_per_sample / (t * 1e12) for b, t in zip(batch_sizes, throughputs, strict=True))


def profiled_throughput(hal: HardwareAbstractionLayer, device: Device, dtype: torch.dtype) -> float:
    """Matmul TFLOP/s of `device` in `dtype`, from its MeasuredProfile (measured once, then cached)."""
    fmt = DType.from_torch(dtype)
    profile = hal.profile(device)
    if fmt is None or fmt not in profile.matmul_tflops:
        measured = sorted(d.value for d in profile.matmul_tflops)
        raise UnsupportedError(
            f"throughput of {device.id} in {dtype}: its profile measured matmul only in {measured} "
            f"(notes: {list(profile.notes)})"
        )
    return profile.matmul_tflops[fmt]


def measured_throughput(
    hal: HardwareAbstractionLayer,
    device: Device,
    dtype: torch.dtype,
    shape: tuple[int, int, int],
    *,
    reps: int = 3,
) -> float:
    """Matmul TFLOP/s of `device` at one (M, K, N) shape of the workload, timed by its own timer.

    A quick alternative to the full profile: `reps` products through the HAL's matmul op
    after one warm-up, on random operands (a simulated device reports its simulated time).
    """
    m, k, n = shape
    if min(m, k, n) < 1 or reps < 1:
        raise InvalidArgumentError(f"measured_throughput: shape {shape} and reps {reps} must be >= 1")
    a, b = device.empty((m, k), dtype).normal_(), device.empty((k, n), dtype).normal_()
    hal.kernels.call("matmul", device, a, b)
    timer = device.timer()
    start = timer.mark()
    for _ in range(reps):
        hal.kernels.call("matmul", device, a, b)
    seconds = timer.elapsed_ms(start, timer.mark()) / 1e3 / reps
    if seconds <= 0:
        raise UnsupportedError(f"measured_throughput: {device.id}'s timer measured {seconds} s for {shape}")
    return 2 * m * k * n / seconds / 1e12


class HeteroGroup:
    """This rank's share of the global batch and the weighted gradient sync across islands.

    Its island groups live until `close` (or the end of a `with` block) or until the job's
    context shuts down; each `create` makes new ones."""

    def __init__(
        self, ctx: DistContext, islands: Islands, throughputs: tuple[float, ...], batch_sizes: tuple[int, ...]
    ) -> None:
        """Use `HeteroGroup.create`."""
        self.ctx = ctx
        self.islands = islands
        self.throughputs = throughputs
        self.batch_sizes = batch_sizes
        self.global_batch = sum(batch_sizes)

    @classmethod
    def create(
        cls,
        ctx: DistContext,
        *,
        global_batch: int,
        throughput: float | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> HeteroGroup:
        """Collective: exchange throughputs, split the batch, form the islands.

        `throughput` (TFLOP/s) defaults to this device's profiled matmul rate in `dtype`.
        Islands are keyed by (vendor/adapter, backend), so two runtimes of one vendor stay apart.
        """

        def mine() -> Any:  # looked up inside the exchange, so a failed lookup reaches every rank
            return profiled_throughput(ctx.hal, ctx.device, dtype) if throughput is None else throughput

        throughputs = _exchange(ctx, "HeteroGroup.create", "throughput", mine)
        sizes = split_batch(global_batch, throughputs)
        caps = ctx.device.capabilities
        islands = ctx.communicator.islands(vendor=f"{caps.vendor}/{caps.adapter}")
        group = cls(ctx, islands, throughputs, sizes)
        log.info("heterogeneous group formed", rank=ctx.rank, **group.report())
        return group

    def close(self) -> None:
        """Destroy the island groups `create` made (each `create` makes new ones); every rank
        closes after its last `sync_gradients`. Also the end of a `with` block."""
        self.islands.destroy()

    def __enter__(self) -> HeteroGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def local_batch(self) -> int:
        return self.batch_sizes[self.ctx.rank]

    @property
    def offset(self) -> int:
        """Index of this rank's first sample in the global batch."""
        return sum(self.batch_sizes[: self.ctx.rank])

    def local_slice(self, global_batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows (dim 0) of a tensor holding the whole global batch."""
        if global_batch.dim() == 0 or global_batch.shape[0] != self.global_batch:
            raise InvalidArgumentError(
                f"local_slice: dim 0 must be the global batch {self.global_batch}, got shape "
                f"{tuple(global_batch.shape)}"
            )
        return global_batch.narrow(0, self.offset, self.local_batch)

    def sync_gradients(self, model: nn.Module) -> None:
        """Replace each gradient by the global-batch mean: sum over ranks of (share × local mean).

        Every rank must call it after backward, with the same parameters in the same order.
        A trainable parameter without a gradient on this rank contributes zeros.
        """
        weight = self.local_batch / self.global_batch
        params = [p for p in model.parameters() if p.requires_grad]
        missing = [p for p in params if p.grad is None]
        for p in missing:
            p.grad = torch.zeros_like(p)
        if missing:
            log.debug("zero gradients filled in for the sync", rank=self.ctx.rank, parameters=len(missing))
            telemetry.count("torchhal.distributed.zero_filled_grads", len(missing))
        with telemetry.span("torchhal.distributed.sync_gradients", rank=self.ctx.rank, weight=weight):
            for bucket in _buckets(params):
                flat = torch.cat([p.grad.reshape(-1) for p in bucket]).mul_(weight)  # type: ignore[union-attr]
                self.islands.hierarchical_all_reduce(flat, "sum")
                start = 0
                for p in bucket:
                    grad = p.grad
                    assert grad is not None
                    grad.copy_(flat[start : start + grad.numel()].view_as(grad))
                    start += grad.numel()

    def rebalance(self, compute_s: float) -> tuple[int, ...]:
        """Collective: re-split the global batch by every rank's measured compute time per step.

        Each rank passes its own compute time per step, e.g. the median `StepStats.compute_s` of
        its last steps (forward and backward on its device's timer). Not `step_time_s`: that
        includes the blocking gradient sync, which makes every rank wait for the slowest, so it
        is nearly the same on every rank and would leave the split as it is. Every rank gets the
        same new sizes, which `local_batch`, `offset` and `local_slice` then follow. Call it
        between steps, on every rank.
        """
        gathered = _exchange(self.ctx, "HeteroGroup.rebalance", "compute time", lambda: compute_s)
        before = self.batch_sizes
        self.batch_sizes = rebalanced_split(self.global_batch, before, gathered)
        telemetry.count("torchhal.distributed.rebalanced")
        log.info(
            "batch re-split by measured compute times",
            rank=self.ctx.rank,
            compute_s=list(gathered),
            before=list(before),
            after=list(self.batch_sizes),
        )
        return self.batch_sizes

    def report(self) -> dict[str, Any]:
        times = [b / t for b, t in zip(self.batch_sizes, self.throughputs, strict=True)]
        return {
            "throughputs_tflops": list(self.throughputs),
            "batch_sizes": list(self.batch_sizes),
            # slowest / fastest rank as the matmul rates model it (not measured; see rebalance)
            "modelled_step_time_imbalance": max(times) / min(times),
            "islands": [list(i.ranks) for i in self.islands.layout],
        }


def _exchange(ctx: DistContext, what: str, figure: str, mine: Callable[[], Any]) -> tuple[float, ...]:
    """Collective: every rank's `mine()` as a float, rank order. Each rank sends (True, value) or
    (False, its error), so where one rank's figure failed every rank raises the same
    CollectiveError naming the failed rank(s) and their errors (on a failed rank, from its own)."""
    local: Exception | None = None
    try:
        value = mine()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise InvalidArgumentError(
                f"{figure} must be a real number, got {value!r} ({type(value).__name__})"
            )
        payload: tuple[bool, Any] = (True, float(value))
    except Exception as exc:  # sent to every peer, then raised on every rank
        local = exc
        payload = (False, f"{type(exc).__name__}: {exc}")
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, payload, group=ctx.communicator.group)
    failed = {r: text for r, (ok, text) in enumerate(gathered) if not ok}
    if failed:
        telemetry.count("torchhal.distributed.hetero_exchange_failed")
        detail = "; ".join(f"rank {r}: {text}" for r, text in failed.items())
        error = CollectiveError(
            f"{what} (rank {ctx.rank} of {ctx.world_size}): rank(s) {sorted(failed)} could not give "
            f"their {figure}, so no rank goes on: {detail}"
        )
        log.error("heterogeneous exchange failed", rank=ctx.rank, what=what, failed=sorted(failed))
        if local is not None:
            raise error from local
        raise error
    return tuple(float(v) for _, v in gathered)


def _buckets(params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters in order, grouped by dtype into runs of at most about BUCKET_BYTES."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not buckets or buckets[-1][0].dtype != p.dtype or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets
