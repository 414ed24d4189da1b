"""Host-side helpers shared by the row-wise ops (norms, gated activations, RoPE) and their Triton kernels.

The kernels treat a tensor of shape (..., cols) as a (rows, cols) matrix with one row stride and
unit column stride; `row_stride` says whether a tensor can be indexed that way. `RowLaunch` turns a
device's capabilities into launch configurations. Nothing here imports triton, so the op modules
can judge candidates on machines without it.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import NamedTuple

import torch

from torchhal.hal_core import DeviceCapabilities, Feature, RejectionReason, Unsupported, UnsupportedError

TRITON_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
MAX_THREADS_PER_PROGRAM = 1024  # the block-size limit of CUDA, HIP and SYCL alike
VECTOR_BYTES = 16  # widest global load of one thread
ROW_THREAD_BYTES = 2 * VECTOR_BYTES  # row bytes each thread holds per tensor: two 16-byte vectors
# Measured on an H100 (benchmarks/ab_row_backward.py and sweep_row_warps.py, docs/benchmarks.md):
# the norms, forward and backward, are fastest with two vectors per thread but no more than 512
# threads (at hidden 16384, 1024 threads ran the forwards 9-26% slower); RoPE, element-wise with
# no reduction, with 128 threads whatever its tile.
MAX_NORM_THREADS = 512
# The norm backwards hold x, dy, the weight and the partial weight gradient(s) across a row's sums
# while each thread holds fewer row elements than this. From this many on they no longer fit (ptxas,
# hidden 16384 on 16 warps: rms_norm 184 spilled bytes a thread, layer_norm 308), so x and dy are
# read once for the sums and again (from L1) for dx and the weight gradient, while the weight,
# read once per row, stays held: rms_norm then spills nothing, layer_norm 164 bytes, and on an
# H100 they ran 14.6% and 6.7-7.7% faster (benchmarks/ab_row_backward.py, docs/benchmarks.md).
# At 4096 and 8192 (16 elements a thread) everything fits, and reading the weight again there ran
# 13-16% slower; reading x and dy again there was not measured. Measured on an H100 only; other
# devices (a wave64 GPU with a smaller L1, say) get the same rule until a sweep there says otherwise.
RELOAD_ROW_ELEMENTS_PER_THREAD = 32
ROPE_THREADS = 128
# Backward programs per compute unit aim at this many threads. The norm backwards take 100-125
# registers a thread, so no more than 512 threads of them are resident on an H100 SM at once
# (as for the rule above, other devices get it unmeasured);
# aiming at 1024 ran a second wave and wrote twice the partial weight-gradient rows, and 512 ran
# 2-6% faster at every measured shape (benchmarks/ab_row_backward.py, docs/benchmarks.md).
RESIDENT_THREADS_PER_UNIT = 512
MIN_ROWS_PER_PROGRAM = 8  # below this, a backward program's partial weight gradient costs more than it saves
MAX_BLOCK = 32768  # one row per program: beyond this, registers spill
# an element-wise kernel's tile: (bytes of each tensor per program, bytes of it per thread)
ELEMENTWISE_TILE = (8192, ROW_THREAD_BYTES)
# The swiglu/geglu forward (two loads and one store an element) on 16 KB tiles with one 16-byte
# vector a thread (tile bytes, bytes a thread): ptxas issues a thread's loads one after another
# between the arithmetic, so more threads keep more loads in flight. Against the rule above
# (benchmarks/ab_row_backward.py, docs/benchmarks.md, eleventh session) it ran 0.5-1.1% faster on
# an H100 and -0.1 to +0.7% on an H200; half a vector a thread ran 5-7% slower on the H100. Their
# backward keeps the rule above: 8 bytes a thread ran it 0.4-1.1% faster on the H100 but 1.4-3.6%
# slower on the H200.
GATED_FORWARD_TILE = (16384, VECTOR_BYTES)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the references compute in: fp32, or fp64 for fp64 inputs (the tests' ground truth)."""
    return torch.promote_types(dtype, torch.float32)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t as a (rows, cols) matrix over its last dimension; unlike `reshape(-1, cols)`, also when
    cols is 0."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


ARITHMETIC_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
"""The floating dtypes the ops compute in: float8 is a storage format torch does no arithmetic or
type promotion in (on a device that declares fp8, every candidate raised)."""


def require_floating(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in ARITHMETIC_FLOATS:
        kind = (
            "a float8 storage format, not computed in" if t.dtype.is_floating_point else "not floating-point"
        )
        raise UnsupportedError(
            f"{op}: {name} must be a floating-point tensor of float64, float32, bfloat16 or float16, "
            f"got dtype {t.dtype} ({kind})"
        )


def unbound(*args: object, **kwargs: object) -> None:
    """The `fn` of a candidate that has `bind`: the registry runs bind(caps)'s callable instead."""
    raise TypeError("this candidate runs only as bound to a device's capabilities (Candidate.bind)")


def unit_stride(t: torch.Tensor) -> bool:
    """Whether t's last dim steps one element at a time, or is never stepped (it has one element,
    or t has none), whatever stride torch gave it."""
    return t.shape[-1] <= 1 or t.stride(-1) == 1 or t.numel() == 0


def row_stride(t: torch.Tensor) -> int | None:
    """Stride between rows when `t` (..., cols) can be indexed as (rows, cols) with unit column
    stride; None when it cannot (then the Triton candidates turn the call down). Every kernel call
    asks this of each tensor, so a contiguous one is answered without the walk over its dims (an
    empty tensor, which torch calls contiguous whatever its strides, gets its column count: the
    kernels launch nothing for it)."""
    if t.dim() and t.is_contiguous():
        return t.shape[-1]
    if t.dim() == 0 or not unit_stride(t):
        return None
    stride: int | None = None
    span = 0
    for size, step in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1]), strict=True):
        if size == 1:
            continue
        if stride is not None and step != span:
            return None
        stride = step if stride is None else stride
        span = step * size
    return t.shape[-1] if stride is None else stride


# Host-side integer helpers. triton.next_power_of_2 and triton.cdiv are ConstexprFunctions that
# unwrap their arguments and read Triton's knobs on every call: ~3 µs each on a 2-core VM, several
# per attention call (benchmarks.md, twenty-seventh session); these are plain integer math.
def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_unsupported(caps: DeviceCapabilities, dtype: torch.dtype) -> Unsupported | None:
    """The device and dtype conditions every Triton candidate of these ops shares."""
    if Feature.TRITON not in caps.features:
        return Unsupported(RejectionReason.FEATURE, f"device {caps.name!r} does not declare Triton")
    if not triton_installed():
        return Unsupported(RejectionReason.FEATURE, "the triton package is not installed")
    if dtype not in TRITON_DTYPES:
        return Unsupported(RejectionReason.DTYPE, f"{dtype} is not one of fp32, bf16, fp16")
    return None


def block_unsupported(cols: int) -> Unsupported | None:
    if next_power_of_2(cols) > MAX_BLOCK:
        return Unsupported(RejectionReason.SHAPE, f"row length {cols} > {MAX_BLOCK}: one row per program")
    return None


def layout_unsupported(rows: bool) -> Unsupported | None:
    if not rows:
        return Unsupported(RejectionReason.LAYOUT, "rows need one row stride and unit column stride")
    return None


class RowLaunch(NamedTuple):
    """Launch configuration of the row kernels, from SIMD width and compute units (never per vendor)."""

    simd_width: int
    compute_units: int

    @classmethod
    def from_caps(cls, caps: DeviceCapabilities) -> RowLaunch:
        return cls(caps.simd_width, caps.compute_units)

    def warps(
        self,
        block: int,
        element_bytes: int,
        thread_bytes: int = ROW_THREAD_BYTES,
        most_threads: int = MAX_THREADS_PER_PROGRAM,
    ) -> int:
        """Warps so each thread holds `thread_bytes` of a row of `block` elements, with at most
        `most_threads` threads per program."""
        threads = block * element_bytes // thread_bytes
        most = max(1, most_threads // self.simd_width)
        return min(most, next_power_of_2(max(1, threads // self.simd_width)))

    def norm_warps(self, block: int, element_bytes: int) -> int:
        """Warps of a norm kernel, forward or backward, over rows of `block` elements."""
        return self.warps(block, element_bytes, most_threads=MAX_NORM_THREADS)

    def reload_row(self, block: int, warps: int) -> bool:
        """Whether a norm backward reads each row's x and dy again after the row's sums instead of
        holding them across the reduction."""
        return block // (warps * self.simd_width) >= RELOAD_ROW_ELEMENTS_PER_THREAD

    def elementwise(
        self,
        cols: int,
        element_bytes: int,
        tile: tuple[int, int] = ELEMENTWISE_TILE,
    ) -> tuple[int, int]:
        """(block, warps) of an element-wise kernel tiling rows of `cols` elements; `tile` is
        (bytes of a tensor per program, bytes of it per thread)."""
        tile_bytes, thread_bytes = tile
        block = min(next_power_of_2(cols), tile_bytes // element_bytes)
        return block, self.warps(block, element_bytes, thread_bytes)

    def backward_programs(self, rows: int, warps: int) -> int:
        """Programs of a backward pass that accumulates a partial weight gradient per program: enough
        to keep RESIDENT_THREADS_PER_UNIT threads on every unit, unless that leaves a program fewer
        than MIN_ROWS_PER_PROGRAM rows (each program writes and the reduction reads one partial row)."""
        per_unit = max(1, RESIDENT_THREADS_PER_UNIT // (warps * self.simd_width))
        busy = self.compute_units * per_unit
        return max(1, min(rows, busy, max(self.compute_units, rows // MIN_ROWS_PER_PROGRAM)))
