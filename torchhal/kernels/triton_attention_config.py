"""Launch configurations for the Triton attention kernels, derived from a device's capabilities.

No vendor names. Tile shapes follow from the head dim and element size; warps from the SIMD
width (each lane holds about 64 fp32 accumulator elements, except in the 16-bit dk/dv kernel,
see DKDV_LANES); pipeline stages from the shared memory per block; the forward's query tile
halves when the grid would leave compute units idle. This module does not import triton, so it
can be read and tested where triton is absent.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchhal.hal_core import DeviceCapabilities

SHARED_MEMORY_HEADROOM = 0.8  # Triton also spends shared memory on layout conversions
ACCUMULATOR_ELEMENTS_PER_LANE = 64
# The 16-bit dk/dv kernel at head dims 64 and 128: 128 lanes (four 32-wide warps), each holding
# 128 fp32 of dk and dv and 32 of the two transposed score tiles, beat twice the lanes by
# 1.3-2x at every tile of a sweep on an H100 (benchmarks/sweep_attention_backward.py,
# docs/benchmarks.md, fifth session).
DKDV_LANES = 128


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One launch: `block_m` query rows and `block_n` key rows per tile, warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True, slots=True)
class LaunchConfigs:
    """Tiles for each kernel of one (device, head dim, dtype)."""

    forward: TileConfig
    forward_narrow: TileConfig  # half the query rows: for grids smaller than the device
    backward_dq: TileConfig  # block_m query rows stay, block_n key rows stream
    backward_dkdv: TileConfig  # block_n key rows stay, block_m query rows stream
    compute_units: int

    def forward_for(self, programs_at_full_width: int) -> TileConfig:
        """The narrow tile when the full one leaves compute units without a program."""
        return self.forward_narrow if programs_at_full_width < self.compute_units else self.forward


@dataclass(frozen=True, slots=True)
class _Budget:
    shared_memory: int
    simd_width: int

    def warps(self, accumulator_elements: int) -> int:
        """Enough warps that each lane holds about 64 fp32 accumulator elements; a power of 2
        (as Triton requires), 4 to 8."""
        lanes = accumulator_elements // ACCUMULATOR_ELEMENTS_PER_LANE
        return max(4, min(8, _floor_power_of_2(lanes // self.simd_width)))

    def fits(self, resident_bytes: int, per_stage_bytes: int) -> bool:
        """Whether the resident tiles and one pipeline stage fit in shared memory."""
        return resident_bytes + per_stage_bytes <= self.shared_memory

    def stages(self, resident_bytes: int, per_stage_bytes: int, most: int) -> int:
        """Pipeline depth that fits beside the tiles a program keeps resident; at least 1."""
        return max(1, min(most, (self.shared_memory - resident_bytes) // per_stage_bytes))


def launch_configs(caps: DeviceCapabilities, head_dim_padded: int, element_bytes: int) -> LaunchConfigs:
    """Tiles for the forward, dq and dk/dv kernels on this device.

    Tile shapes keep every kernel within 255 registers per lane (ptxas reports for sm_90 at
    padded head dims 32 to 256; the 16-bit dk/dv kernel's measured best spills a little at head
    dim 128 and still wins): fp16/bf16 take tensor-core sized tiles; fp32,
    computed as IEEE fp32 without TF32, runs its dot products on the FMA units and gets small
    tiles. A device that declares no shared memory (the CPU, through Triton's interpreter) has
    no register or shared-memory budget to respect: it gets 64-row tiles, few enough to keep
    the interpreter's per-tile overhead low, with unequal query and key tiles.
    """
    d, e = head_dim_padded, element_bytes
    if caps.shared_memory_per_block_bytes is None:
        tile = TileConfig(64, 32, 4, 1)
        return LaunchConfigs(tile, tile, tile, TileConfig(32, 64, 4, 1), caps.compute_units)
    budget = _Budget(int(caps.shared_memory_per_block_bytes * SHARED_MEMORY_HEADROOM), caps.simd_width)
    # dk/dv keeps k, v and two accumulators resident: from head dim 64 to 128 its key tile
    # halves as the head dim doubles, so dk and dv stay at 128 fp32 per lane (see DKDV_LANES)
    if e <= 2:
        fwd_m, fwd_n = (128, 64) if d <= 128 else (64, 32)
        dq_m, dq_n = (128, 64) if d <= 128 else (64, 32)
        kv_m, kv_n = (16, 128) if d <= 64 else (32, 64) if d <= 128 else (32, 32)
        most = 3
    else:
        fwd_m, fwd_n = (32, 32) if d <= 64 else (16, 16)
        dq_m, dq_n = (32, 16) if d <= 128 else (16, 16)
        kv_m, kv_n = (32, 16) if d <= 128 else (16, 16)
        most = 2

    def forward(block_m: int) -> TileConfig:
        stages = budget.stages(block_m * d * e, 2 * fwd_n * d * e, most)
        return TileConfig(block_m, fwd_n, budget.warps(block_m * d), stages)

    dq_resident = 2 * dq_m * d * e  # q and dO stay
    while dq_n > 16 and not budget.fits(dq_resident, 2 * dq_n * d * e):
        dq_n //= 2  # devices with less shared memory per block than the tiles above assume
    dq_stages = budget.stages(dq_resident, 2 * dq_n * d * e, most + 1)
    kv_stages = budget.stages(2 * kv_n * d * e, 2 * kv_m * d * e, most)  # k and v stay
    if e <= 2 and d <= 128:
        kv_warps = max(1, DKDV_LANES // caps.simd_width)
    else:
        kv_warps = budget.warps(2 * kv_n * d)  # dk and dv decide
    return LaunchConfigs(
        forward=forward(fwd_m),
        forward_narrow=forward(max(16, fwd_m // 2)),
        backward_dq=TileConfig(dq_m, dq_n, budget.warps(dq_m * (d + 2 * dq_n)), dq_stages),  # dq, 2 scores
        backward_dkdv=TileConfig(kv_m, kv_n, kv_warps, kv_stages),
        compute_units=caps.compute_units,
    )


def _floor_power_of_2(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


# Split-KV decoding (`triton_attention_decode`): a few query rows per kv head against a long cache.
DECODE_MAX_ROWS = 64  # query rows of one kv head's group (query heads x query length) in one tile
DECODE_MAX_SPLITS = 256  # the combine pass reads every split's partial row
# one program's worth of keys per compute unit keeps memory busy: each streams its slice through
# its stages of key tiles; more programs cut the cache into shorter slices (a pipeline fill each)
# and hand the combine pass more partials (an H100 swept 1, 2, 4 and 8: benchmarks.md, twenty-sixth
# session)
DECODE_PROGRAMS_PER_UNIT = 1
# The split pass's fp32 partial rows (`triton_attention_decode.split_scratch_bytes` a split) are
# held to this many times the keys and values they summarise. A dense cache never reaches it (a
# slice holds at least one key tile, whose keys and values outweigh a quarter of its partial rows);
# packed short sequences under a large max_seqlen_k did: 256 sequences of 16 keys at
# max_seqlen_k 131072 took 256 splits, 1 GiB of partials for 16 MiB of keys and values.
DECODE_SCRATCH_PER_KV = 8


def decode_tile(caps: DeviceCapabilities, head_dim_padded: int, element_bytes: int, rows: int) -> TileConfig:
    """The split-KV pass's tile: all `rows` (a power of two, at least 16) of a kv head's group in
    one query tile, `block_n` keys streamed through as many stages as shared memory holds. The
    pass reads the cache once and computes little, so the key tile is what matters: 64 rows of
    16-bit keys at head dims up to 128 (32 past it), 32 and 16 in fp32 (no tensor cores there),
    halved where the query tile and one stage would not fit in shared memory; warps as the
    forward's, about 64 fp32 accumulator elements per lane."""
    d, e = head_dim_padded, element_bytes
    if caps.shared_memory_per_block_bytes is None:  # the CPU through Triton's interpreter
        return TileConfig(rows, 32, 4, 1)
    budget = _Budget(int(caps.shared_memory_per_block_bytes * SHARED_MEMORY_HEADROOM), caps.simd_width)
    block_n = (64 if d <= 128 else 32) if e <= 2 else (32 if d <= 64 else 16)
    while block_n > 16 and not budget.fits(rows * d * e, 2 * block_n * d * e):
        block_n //= 2
    stages = budget.stages(rows * d * e, 2 * block_n * d * e, 3 if e <= 2 else 2)
    return TileConfig(rows, block_n, budget.warps(rows * d), stages)


def decode_splits(
    caps: DeviceCapabilities, work_keys: int, seq_k: int, block_n: int, most_splits: int = DECODE_MAX_SPLITS
) -> tuple[int, int]:
    """(splits, keys per split) of a cache of `seq_k` keys when all groups (batch x kv heads)
    together read `work_keys` keys: slices of about work_keys / (DECODE_PROGRAMS_PER_UNIT x compute
    units) keys, so the work is shared evenly over the device however it divides into groups (a
    packed sequence shorter than seq_k ends its slices early), each a whole number of key tiles (a
    tile never straddles two slices), at most `most_splits` and at most seq_k's tiles. (A
    count of slices per group instead left 64 groups' 3 equal slices, 192 programs, on 132 compute
    units, and sized packed sequences by the longest alone.)"""
    tiles = max(1, -(-seq_k // block_n))
    programs = DECODE_PROGRAMS_PER_UNIT * caps.compute_units
    tiles_per_split = -(-work_keys // (programs * block_n))
    tiles_per_split = min(tiles, max(1, tiles_per_split, -(-tiles // max(1, most_splits))))
    return -(-tiles // tiles_per_split), tiles_per_split * block_n
