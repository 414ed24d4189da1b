"""The cost model: simulated time of an op on the spec's systolic array, from shapes alone.

Pure functions of (spec, shapes, dtype); nothing here touches torch or a clock.

Matmul, C[M×N] = A[M×K] · B[K×N], on an R × C output-stationary array (SCALE-Sim's OS
dataflow): each R × C block of the output stays in the array while a panel of A (R rows × K)
and a panel of B (K × C columns) stream through it.

* Tiles: ceil(M/R) · ceil(N/C); edge tiles cost as much as full ones (padding is not free).
* Cycles per tile: ceil(K / m) + R + C − 2, where m is the spec's MACs per cell per cycle for
  the dtype. A cell that does m MACs a cycle consumes m elements of the K reduction a cycle,
  so only the streaming term is divided by m; the R + C − 2 cycles of fill and drain are the
  skew through the array's pipeline, which a wider cell does not shorten.
* Compute time: tiles · cycles per tile / clock.
* Bytes moved (s = element size, S = SRAM bytes, a = min(R, M)·K·s one A panel,
  b = K·min(C, N)·s one B panel, Tm = ceil(M/R), Tn = ceil(N/C)); C is written once (M·N·s):
  - if a + b > S, no panel can be kept for reuse: every tile streams its own panels, so each
    A panel is read once per tile column and each B panel once per tile row:
    reads = Tn·M·K·s + Tm·K·N·s  (reuse NONE);
  - otherwise the scheduler keeps a block of panels of one operand resident and streams the
    other operand past it once per block, taking the cheaper of
      A-stationary: pA = min(Tm, floor((S − b) / a)) A panels held, B read ceil(Tm/pA) times:
                    reads = M·K·s + ceil(Tm/pA)·K·N·s
      B-stationary: pB = min(Tn, floor((S − a) / b)) B panels held, A read ceil(Tn/pB) times:
                    reads = K·N·s + ceil(Tn/pB)·M·K·s
    (A-stationary on a tie). When that comes to M·K·s + K·N·s, each operand is read once
    (reuse ONCE). Double buffering and K-splitting are not modelled.
* Time: max(compute, bytes / bandwidth) (a roofline per matmul).

An op is the matmuls it runs on the array plus the bytes it streams through the vector path
(element-wise and reduction work: activations, norms, softmax, statistics). Each matmul is
its own roofline, max(compute, its bytes / bandwidth); streamed bytes take bytes / bandwidth
and no array time (the spec gives the vector path no rate of its own, so its FLOPs are not
counted); all of it runs back to back after one launch overhead (`op_cost`). A batched
matmul is `batch` independent matmuls in one launch. What each registry op runs is in
`torchhal_simasic.workloads`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from torchhal.hal_core import DType, InvalidArgumentError, UnsupportedError

from torchhal_simasic.spec import SimASICSpec

ELEMENT_BYTES = {
    DType.FP64: 8,
    DType.FP32: 4,
    DType.TF32: 4,
    DType.BF16: 2,
    DType.FP16: 2,
    DType.FP8_E4M3: 1,
    DType.FP8_E5M2: 1,
    DType.FP8_E4M3_FNUZ: 1,
    DType.FP8_E5M2_FNUZ: 1,
    DType.INT8: 1,
}


class _ValueEnum(str, enum.Enum):
    """A str enum that prints as its value, as enum.StrEnum (Python 3.11+) does, on 3.10 too."""

    def __str__(self) -> str:
        return str(self.value)


class Bound(_ValueEnum):
    COMPUTE = "compute"
    MEMORY = "memory"


class Reuse(_ValueEnum):
    """How a matmul's operand panels were reused through SRAM (see the module docstring)."""

    ONCE = "once"  # each operand read from memory once
    A_STATIONARY = "a_stationary"  # blocks of A panels held, B re-streamed once per block
    B_STATIONARY = "b_stationary"  # blocks of B panels held, A re-streamed once per block
    NONE = "none"  # not even one A and one B panel fit: each tile streams its own panels


class Matmul(NamedTuple):
    """`count` independent M×K×N matmuls of one op, run on the array back to back."""

    m: int
    k: int
    n: int
    count: int = 1


class OpCost(NamedTuple):
    """Simulated cost of one op. `utilisation` is achieved ÷ peak of the resource that bounds it:
    FLOP/s against the array's peak for the dtype when compute-bound, bytes/s against the
    memory bandwidth when memory-bound; both over the whole op time, overhead included."""

    op: str
    dtype: DType
    compute_s: float
    memory_s: float
    overhead_s: float
    time_s: float
    bytes: int
    flops: int  # the array's: 2 per MAC of the op's matmuls
    bound: Bound
    utilisation: float
    reuse: Reuse | None = None  # of the op's matmul, when it runs one (a batch counts as one)

    @property
    def achieved_flops_per_s(self) -> float:
        return self.flops / self.time_s if self.time_s > 0 else 0.0

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.bytes / self.time_s if self.time_s > 0 else 0.0


def element_bytes(dtype: DType) -> int:
    return ELEMENT_BYTES[dtype]


def matmul_tiles(spec: SimASICSpec, m: int, n: int) -> int:
    return math.ceil(m / spec.rows) * math.ceil(n / spec.cols)


def matmul_cycles_per_tile(spec: SimASICSpec, k: int, dtype: DType) -> int:
    """ceil(K / MACs per cell per cycle) streaming cycles plus R + C − 2 of fill and drain."""
    return math.ceil(k / _macs(spec, "matmul", dtype)) + spec.rows + spec.cols - 2


def matmul_traffic(spec: SimASICSpec, m: int, k: int, n: int, dtype: DType) -> tuple[int, Reuse]:
    """Bytes one M×K×N matmul moves to and from memory, and the reuse that gave them."""
    s = element_bytes(dtype)
    write = m * n * s
    if 0 in (m, k, n):
        return write, Reuse.ONCE
    tm, tn = math.ceil(m / spec.rows), math.ceil(n / spec.cols)
    size_a, size_b = m * k * s, k * n * s
    panel_a, panel_b = min(spec.rows, m) * k * s, k * min(spec.cols, n) * s
    if panel_a + panel_b > spec.sram_bytes:
        return tn * size_a + tm * size_b + write, Reuse.NONE
    held_a = min(tm, (spec.sram_bytes - panel_b) // panel_a)
    held_b = min(tn, (spec.sram_bytes - panel_a) // panel_b)
    a_stationary = size_a + math.ceil(tm / held_a) * size_b
    b_stationary = size_b + math.ceil(tn / held_b) * size_a
    reads = min(a_stationary, b_stationary)
    if reads == size_a + size_b:
        return reads + write, Reuse.ONCE
    return reads + write, Reuse.A_STATIONARY if a_stationary <= b_stationary else Reuse.B_STATIONARY


def matmul_cost(spec: SimASICSpec, m: int, k: int, n: int, dtype: DType, *, batch: int = 1) -> OpCost:
    """`batch` independent M×K×N matmuls in one launch."""
    require_sizes("matmul", m=m, k=k, n=n, batch=batch)
    return op_cost(spec, "matmul", dtype, [Matmul(m, k, n, batch)])


def elementwise_cost(spec: SimASICSpec, op: str, dtype: DType, nbytes: int) -> OpCost:
    """An element-wise or reduction op: it only streams `nbytes`."""
    return op_cost(spec, op, dtype, streamed_bytes=nbytes)


def copy_time_s(spec: SimASICSpec, nbytes: int) -> float:
    """A copy within device memory reads and writes every byte, after one launch:
    2 × bytes / bandwidth + overhead."""
    require_sizes("copy", nbytes=nbytes)
    return 2 * nbytes / spec.memory_bandwidth_bytes_per_s + spec.launch_overhead_s


def transfer_time_s(spec: SimASICSpec, nbytes: int) -> float:
    """A copy between host and device memory (an upload, as `Device.to_device` makes, or a
    download) streams every byte over the host link and through device memory once, after one
    launch: bytes / min(host_link_bytes_per_s, memory bandwidth) + overhead. A spec without a
    host link gives only the device-memory side, bytes / memory bandwidth + overhead (the
    adapter says so: the link's time is missing)."""
    require_sizes("transfer", nbytes=nbytes)
    rate = spec.memory_bandwidth_bytes_per_s
    if spec.host_link_bytes_per_s is not None:
        rate = min(rate, spec.host_link_bytes_per_s)
    return nbytes / rate + spec.launch_overhead_s


# Bytes each rank sends over its host link, per byte of its own buffer, with n ranks: ring
# all-reduce is a reduce-scatter then an all-gather (2(n-1)/n), all-gather sends its buffer to
# n-1 peers through the ring, reduce-scatter and all-to-all pass (n-1)/n of it, and a pipelined
# broadcast or reduce forwards it once. A barrier moves nothing.
_RING_TRAFFIC: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: n - 1,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0 if n > 1 else 0.0,
    "reduce": lambda n: 1.0 if n > 1 else 0.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
    "barrier": lambda n: 0.0,
}


def collective_time_s(spec: SimASICSpec, collective: str, nbytes: int, world_size: int) -> float | None:
    """A collective over the host links (ring algorithms), after one launch: the bytes this rank
    sends (`_RING_TRAFFIC`) / `host_link_bytes_per_s` + overhead. None when the spec declares no
    host link: the transfer then has no cost to charge."""
    require_sizes(collective, nbytes=nbytes, world_size=world_size)
    if world_size < 1:  # a ring of no ranks: its traffic divides by zero, or comes out negative
        raise InvalidArgumentError(
            f"{collective} cost: world_size must be an integer >= 1 (the ranks taking part), "
            f"got {world_size!r}"
        )
    if collective not in _RING_TRAFFIC:
        raise InvalidArgumentError(
            f"simulated collective: no cost model for {collective!r}; known: {', '.join(_RING_TRAFFIC)}"
        )
    if spec.host_link_bytes_per_s is None:
        return None
    sent = _RING_TRAFFIC[collective](world_size) * nbytes
    return sent / spec.host_link_bytes_per_s + spec.launch_overhead_s


def op_cost(
    spec: SimASICSpec, op: str, dtype: DType, matmuls: Sequence[Matmul] = (), streamed_bytes: int = 0
) -> OpCost:
    """One launch of `op`: its matmuls, each its own roofline, and `streamed_bytes` through the
    vector path at the memory bandwidth, back to back after the launch overhead."""
    _require_dtype(spec, op, dtype)
    require_sizes(op, streamed_bytes=streamed_bytes)
    bandwidth = spec.memory_bandwidth_bytes_per_s
    compute_s, nbytes, flops = 0.0, streamed_bytes, 0
    busy_s = streamed_bytes / bandwidth
    reuse = None
    for mm in matmuls:
        require_sizes(op, m=mm.m, k=mm.k, n=mm.n, count=mm.count)
        tile_s = matmul_tiles(spec, mm.m, mm.n) * matmul_cycles_per_tile(spec, mm.k, dtype) / spec.clock_hz
        moved, reuse = matmul_traffic(spec, mm.m, mm.k, mm.n, dtype)
        compute_s += mm.count * tile_s
        nbytes += mm.count * moved
        busy_s += mm.count * max(tile_s, moved / bandwidth)
        flops += 2 * mm.count * mm.m * mm.k * mm.n
    time_s = busy_s + spec.launch_overhead_s
    memory_s = nbytes / bandwidth
    bound = Bound.COMPUTE if compute_s > 0 and compute_s >= memory_s else Bound.MEMORY
    if time_s <= 0:
        utilisation = 0.0
    elif bound is Bound.COMPUTE:
        utilisation = flops / time_s / spec.peak_flops_per_s(dtype)
    else:
        utilisation = nbytes / time_s / bandwidth
    return OpCost(
        op,
        dtype,
        compute_s,
        memory_s,
        spec.launch_overhead_s,
        time_s,
        nbytes,
        flops,
        bound,
        utilisation,
        reuse if len(matmuls) == 1 else None,
    )


def _macs(spec: SimASICSpec, op: str, dtype: DType) -> int:
    try:
        return spec.macs_per_cell_per_cycle[dtype]
    except KeyError:
        covered = sorted(d.value for d in spec.macs_per_cell_per_cycle)
        raise UnsupportedError(
            f"{op} on simulated ASIC {spec.name!r}: dtype {dtype.value} has no MAC rate "
            f"(macs_per_cell_per_cycle covers {covered})"
        ) from None


def _require_dtype(spec: SimASICSpec, op: str, dtype: DType) -> None:
    if dtype not in spec.dtypes:
        declared = sorted(d.value for d in spec.dtypes)
        raise UnsupportedError(
            f"{op} on simulated ASIC {spec.name!r}: dtype {dtype.value} not in dtypes {declared}"
        )


def require_sizes(op: str, **sizes: int) -> None:
    """Every size an integer >= 0, or InvalidArgumentError naming the op, the size and its value."""
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 0:
            raise InvalidArgumentError(f"{op} cost: {name} must be an integer >= 0, got {value!r}")
