"""Tiles, warps and stages of the Triton FlashAttention backward against SDPA flash (FA2), bf16, on a GPU.

Why: the backward's launch rules in triton_attention_config.py rest on this sweep. Its first run
(docs/benchmarks.md, fifth session) took the backward from 0.83-1.01x SDPA's flash backend to
1.00-1.45x; rerun it when the kernels or the device change.

Shapes are bench_attention's (FlashAttention's): bf16, batch x seqlen = 16k tokens, hidden 2048
(heads = 2048 / d), d 64 and 128, causal and full, seqlen 4096 and 16384. Per shape, torchhal's
forward runs once for (out, lse); then the whole backward (`kernels.backward`: the dq kernel,
which also writes delta, then the dk/dv kernel) is timed with launch_configs' default tiles, with
the dk/dv tile varied (dq at its default), then with the dq tile varied (dk/dv at the fastest
found), beside SDPA's flash and cuDNN backwards (autograd.grad of a retained graph, as in
bench_attention), all in one run; do_bench medians (sweep_common.ms).

Correctness: before a config is timed, its dq, dk and dv for a second output gradient are
compared with the default config's (assert_close, rtol 2e-2, atol 2e-2 of the mean magnitude);
a config that fails is marked wrong and not timed, so a fast wrong one cannot win. The timed
gradient differs from the checked one and checked outputs are overwritten with NaN, so a kernel
that skips writes cannot pass on what an earlier run left in recycled memory. (bench_attention
checks the default config itself against fp64.) Configs Triton refuses (OutOfResources,
PTXASError: the errors its own autotuner skips) are printed and recorded as skipped.

Grid: dk/dv (block_m, block_n) in {16, 32, 64} x {64, 128}, dq in {64, 128} x {16, 32, 64}, warps
4 and 8, stages 2 to 5. A config compiles once per (d, causal), as lengths are runtime arguments
and both seqlens share it, in 1-3 s (ptxas of triton 3.6 for sm_90a; badly spilling ones up to
7 s); its check and timing take about 0.3 s per shape. To keep the default run near 5 minutes:
- pruned by register budget: configs whose fp32 accumulators, two fp32 score tiles and resident
  16-bit operands need more than 240 of a lane's 255 registers (dk/dv keeps k, v, dk and dv:
  n(3d + 2m) / lanes; dq keeps q, dO and dq: 2m(d + n) / lanes). ptxas -v reports each config
  this prunes spilling (84 B to 5.5 KB per lane); kept ones may spill too (dk/dv at block_m 64,
  dk/dv with 4 warps at d 128) and are measured.
- stages: each kernel's tiles and warp counts are timed at 3 stages, its 2 fastest again at 2,
  4 and 5.
That is 21 configs per shape at d 64 and 16 at d 128, plus up to 12 stage variants: about 120
compiles and 240 checked and timed configs. --quick: 8 warps, 3 stages, seqlen 4096 (~2 min).

    python3 benchmarks/sweep_attention_backward.py [--seqlens 4096 16384] [--dims 64 128] [--quick]
        [--out sweep.json]
    TRITON_INTERPRET=1 python3 benchmarks/sweep_attention_backward.py --smoke   (CPU, tiny fp32 shape)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
from bench_attention import HIDDEN, TOKENS, flops, sdpa_with
from gpu_capabilities import device_capabilities
from sweep_common import ms, save
from triton.runtime.errors import OutOfResources, PTXASError

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import DeviceCapabilities
from torchhal.kernels import triton_attention_kernels as kernels
from torchhal.kernels.triton_attention_config import LaunchConfigs, TileConfig, launch_configs

Timer = Callable[[Callable[[], Any]], float]
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

SEQLENS = (4096, 16384)
DIMS = (64, 128)
REGISTER_BUDGET = 240  # of 255 per lane: the rest hold addresses, masks and loop state
TOLERANCE = 2e-2
KERNELS = ("dkdv", "dq")  # swept in this order
COMPILE_S, CHECK_AND_TIME_S = 2.0, 0.3  # per config, for the printed run-time estimate


@dataclass(frozen=True, slots=True)
class Grid:
    """(block_m, block_n) per kernel and warps, tried at `first` stages; the `top` fastest of
    those again at each of `more` stages."""

    dkdv: tuple[tuple[int, int], ...]
    dq: tuple[tuple[int, int], ...]
    warps: tuple[int, ...]
    first: int
    more: tuple[int, ...]
    top: int


DKDV_TILES = tuple(itertools.product((16, 32, 64), (64, 128)))
DQ_TILES = tuple(itertools.product((64, 128), (16, 32, 64)))
DEFAULT_GRID = Grid(DKDV_TILES, DQ_TILES, warps=(4, 8), first=3, more=(2, 4, 5), top=2)
QUICK_GRID = Grid(DKDV_TILES, DQ_TILES, warps=(8,), first=3, more=(), top=0)
SMOKE_GRID = Grid(((16, 32), (32, 64)), ((32, 16), (64, 32)), warps=(4,), first=1, more=(2,), top=1)


@dataclass(frozen=True, slots=True)
class Shape:
    batch: int
    heads: int
    seqlen: int
    dim: int
    causal: bool

    def backward_flops(self) -> float:
        return 2.5 * flops(self.batch, self.heads, self.seqlen, self.dim, self.causal)


@dataclass(frozen=True, slots=True)
class Case:
    """One shape's inputs and saved forward, and the default config's gradients for `check_grad`."""

    shape: Shape
    caps: DeviceCapabilities
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad: torch.Tensor  # timed
    check_grad: torch.Tensor  # checked
    out: torch.Tensor
    lse: torch.Tensor
    problem: kernels.Problem
    default: LaunchConfigs
    reference: Grads

    def backward(self, configs: LaunchConfigs, grad: torch.Tensor) -> Grads:
        return kernels.backward(grad, self.q, self.k, self.v, self.out, self.lse, self.problem, configs)


def tile_of(configs: LaunchConfigs, kernel: str) -> TileConfig:
    return configs.backward_dkdv if kernel == "dkdv" else configs.backward_dq


def with_tile(configs: LaunchConfigs, kernel: str, tile: TileConfig) -> LaunchConfigs:
    if kernel == "dkdv":
        return dataclasses.replace(configs, backward_dkdv=tile)
    return dataclasses.replace(configs, backward_dq=tile)


def tile_name(tile: TileConfig) -> str:
    return f"m{tile.block_m}n{tile.block_n}w{tile.num_warps}s{tile.num_stages}"


def lane_registers(kernel: str, tile: TileConfig, dim: int, element_bytes: int, simd_width: int) -> float:
    """32-bit registers per lane for a program's fp32 accumulators and two fp32 score tiles,
    plus its resident operands: k and v for dk/dv (block_n rows), q and dO for dq (block_m rows)."""
    m, n = tile.block_m, tile.block_n
    operands = 2 * dim * element_bytes / 4
    held = n * (2 * dim + operands) if kernel == "dkdv" else m * (dim + operands)
    return (held + 2 * m * n) / (tile.num_warps * simd_width)


def prune_reason(
    caps: DeviceCapabilities, kernel: str, tile: TileConfig, dim: int, element_bytes: int
) -> str | None:
    """Why the tile is not worth compiling (its accumulators alone overflow the registers), or None.
    Always None where, as on the CPU, the device declares no shared memory: no register budget either."""
    if caps.shared_memory_per_block_bytes is None:
        return None
    registers = lane_registers(kernel, tile, dim, element_bytes, caps.simd_width)
    return f"~{registers:.0f} registers per lane" if registers > REGISTER_BUDGET else None


def first_tiles(grid: Grid, kernel: str) -> list[TileConfig]:
    return [TileConfig(m, n, w, grid.first) for (m, n) in getattr(grid, kernel) for w in grid.warps]


def make_case(shape: Shape, caps: DeviceCapabilities, device: str, dtype: torch.dtype) -> Case:
    def randn() -> torch.Tensor:
        return torch.randn(shape.batch, shape.heads, shape.seqlen, shape.dim, device=device, dtype=dtype)

    q, k, v, grad, check_grad = (randn() for _ in range(5))
    problem = kernels.make_problem(
        q, k, seq_q=shape.seqlen, seq_k=shape.seqlen, batch=shape.batch, causal=shape.causal,
        scale=None, window=None,
    )  # fmt: skip
    default = launch_configs(caps, problem.head_dim_padded, q.element_size())
    out, lse = kernels.forward(q, k, v, problem, default)
    reference = kernels.backward(check_grad, q, k, v, out, lse, problem, default)
    return Case(shape, caps, q, k, v, grad, check_grad, out, lse, problem, default, reference)


def mismatch(got: Grads, reference: Grads) -> str | None:
    """Why the gradients differ from the reference beyond bf16 rounding, or None."""
    for name, g, r in zip(("dq", "dk", "dv"), got, reference, strict=True):
        atol = TOLERANCE * r.abs().float().mean().item()
        try:
            torch.testing.assert_close(g, r, rtol=TOLERANCE, atol=atol)
        except AssertionError as exc:
            return f"{name}: " + "; ".join(line for line in str(exc).splitlines()[1:] if line)
    return None


def attempt(case: Case, configs: LaunchConfigs, timer: Timer) -> dict[str, Any]:
    """Check a config against the default's gradients, then time it: status ok, wrong or skipped."""
    try:
        got = case.backward(configs, case.check_grad)
    except (OutOfResources, PTXASError) as exc:
        return {"status": "skipped", "reason": f"{type(exc).__name__}: {exc}"}
    reason = mismatch(got, case.reference)
    for g in got:  # recycled memory must not hold checked gradients
        g.fill_(float("nan"))
    del got
    if reason is not None:
        return {"status": "wrong", "reason": reason}
    elapsed = timer(lambda: case.backward(configs, case.grad))
    return {"status": "ok", "ms": elapsed, "tflops": case.shape.backward_flops() / elapsed / 1e9}


def config_row(case: Case, kernel: str, configs: LaunchConfigs, result: dict[str, Any]) -> dict[str, Any]:
    row = {
        **dataclasses.asdict(case.shape),
        "kernel": kernel,
        "dq": tile_name(configs.backward_dq),
        "dkdv": tile_name(configs.backward_dkdv),
        **result,
    }
    outcome = f"{result['ms']:.3f} ms" if "ms" in result else f"{result['status']} ({result['reason']})"
    print(f"  {kernel:7s} dq {row['dq']:12s} dkdv {row['dkdv']:12s} {outcome}", flush=True)
    return row


def try_tiles(
    case: Case,
    kernel: str,
    tiles: list[TileConfig],
    base: LaunchConfigs,
    timer: Timer,
    rows: list[dict[str, Any]],
) -> list[tuple[float, TileConfig]]:
    """(ms, tile) of each tile that ran correctly as `kernel`'s, the other kernel's from `base`;
    tiles over the register budget are recorded as pruned, not run."""
    timed: list[tuple[float, TileConfig]] = []
    for tile in tiles:
        configs = with_tile(base, kernel, tile)
        reason = prune_reason(case.caps, kernel, tile, case.shape.dim, case.q.element_size())
        result = {"status": "pruned", "reason": reason} if reason else attempt(case, configs, timer)
        rows.append(config_row(case, kernel, configs, result))
        if result["status"] == "ok":
            timed.append((float(result["ms"]), tile))
    return timed


def sweep_kernel(
    case: Case,
    kernel: str,
    grid: Grid,
    base: LaunchConfigs,
    base_ms: float,
    timer: Timer,
    rows: list[dict[str, Any]],
) -> tuple[float, LaunchConfigs]:
    """(ms, configs): `base` with `kernel`'s tile replaced by the fastest correct one of the grid,
    or `base` itself when none beats `base_ms`."""
    timed = try_tiles(case, kernel, first_tiles(grid, kernel), base, timer, rows)
    leaders = [tile for _, tile in sorted(timed, key=lambda found: found[0])[: grid.top]]
    deeper = [dataclasses.replace(tile, num_stages=s) for tile in leaders for s in grid.more]
    timed += try_tiles(case, kernel, deeper, base, timer, rows)
    best_ms, best_tile = min(timed, key=lambda found: found[0], default=(base_ms, tile_of(base, kernel)))
    if best_ms >= base_ms:
        return base_ms, base
    return best_ms, with_tile(base, kernel, best_tile)


def peer_backwards(case: Case) -> dict[str, Any]:
    """SDPA flash and cuDNN backward ms on the case's inputs (an error string where refused)."""
    from torch.nn.attention import SDPBackend

    times: dict[str, Any] = {}
    for name, backend in (
        ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
        ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
    ):
        leaves = [t.detach().requires_grad_(True) for t in (case.q, case.k, case.v)]
        try:
            out = sdpa_with(backend)(*leaves, case.shape.causal)
        except RuntimeError as exc:  # the backend refuses the shape or device
            times[f"{name}_error"] = str(exc).splitlines()[0][:200]
            print(f"  {name}: {times[f'{name}_error']}")
            continue

        def grads(out: torch.Tensor = out, leaves: list[torch.Tensor] = leaves) -> Any:
            return torch.autograd.grad(out, leaves, case.grad, retain_graph=True)

        times[f"{name}_ms"] = ms(grads)
        print(f"  {name:7s} {times[f'{name}_ms']:.3f} ms")
    return times


def sweep_shape(
    case: Case, grid: Grid, timer: Timer, peers: bool, rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """All of one shape's rows appended to `rows`; its summary returned."""
    shape = case.shape
    print(
        f"\nd {shape.dim}, causal {shape.causal}, seqlen {shape.seqlen}: {shape.batch} x {shape.heads} heads"
    )
    default = attempt(case, case.default, timer)
    rows.append(config_row(case, "default", case.default, default))
    default_ms = default["ms"]
    dkdv_ms, with_dkdv = sweep_kernel(case, "dkdv", grid, case.default, default_ms, timer, rows)
    best_ms, best = sweep_kernel(case, "dq", grid, with_dkdv, dkdv_ms, timer, rows)
    summary = {
        **dataclasses.asdict(shape),
        "default_ms": default_ms,
        "best_ms": best_ms,
        "best_dq": tile_name(best.backward_dq),
        "best_dkdv": tile_name(best.backward_dkdv),
        "best_tflops": shape.backward_flops() / best_ms / 1e9,
    }
    if peers:
        summary |= peer_backwards(case)
    else:
        print("  sdpa_flash, sdpa_cudnn skipped: GPU-only backends (smoke mode runs on the CPU)")
    if "sdpa_flash_ms" in summary:
        summary["flash_tflops"] = shape.backward_flops() / summary["sdpa_flash_ms"] / 1e9
        summary["best_vs_flash"] = summary["sdpa_flash_ms"] / best_ms
    return summary


def shapes(seqlens: tuple[int, ...], dims: tuple[int, ...]) -> Iterator[Shape]:
    """d, then causal, then seqlen outermost to innermost: a (d, causal)'s compiles serve its seqlens."""
    for dim, causal, seqlen in itertools.product(dims, (False, True), seqlens):
        yield Shape(TOKENS // seqlen, HIDDEN // dim, seqlen, dim, causal)


def planned_configs(caps: DeviceCapabilities, grid: Grid, dim: int, element_bytes: int) -> int:
    """Configs a shape of head dim `dim` checks and times (at most: a stage variant may be pruned)."""
    kept = sum(
        prune_reason(caps, kernel, tile, dim, element_bytes) is None
        for kernel in KERNELS
        for tile in first_tiles(grid, kernel)
    )
    return kept + len(KERNELS) * grid.top * len(grid.more)


def print_estimate(
    caps: DeviceCapabilities, grid: Grid, seqlens: tuple[int, ...], dims: tuple[int, ...]
) -> None:
    per_dim = [planned_configs(caps, grid, dim, 2) for dim in dims]
    compiles, timed = 2 * sum(per_dim), 2 * len(seqlens) * sum(per_dim)
    minutes = (compiles * COMPILE_S + timed * CHECK_AND_TIME_S) / 60
    print(f"plan: ~{compiles} kernel compiles, ~{timed} configs checked and timed: ~{minutes:.0f} min")


SUMMARY_COLUMNS = (  # (header, summary key, width, decimals)
    ("default", "default_ms", 9, 3),
    ("best", "best_ms", 9, 3),
    ("flash", "sdpa_flash_ms", 9, 3),
    ("cudnn", "sdpa_cudnn_ms", 9, 3),
    ("best TF/s", "best_tflops", 10, 1),
    ("flash TF/s", "flash_tflops", 11, 1),
    ("vs flash", "best_vs_flash", 9, 2),
)


def print_table(summaries: list[dict[str, Any]]) -> None:
    """Per shape: backward ms (default, best, SDPA flash, cuDNN), TFLOP/s, flash ms / best ms."""
    print("\nbackward ms; TFLOP/s = 2.5 x forward FLOPs / time; vs flash = flash ms / best ms (> 1: faster)")
    headers = "".join(f"{header:>{width}}" for header, _, width, _ in SUMMARY_COLUMNS)
    print(f"{'d':>4}{'causal':>7}{'seqlen':>7}{headers}  best dq / dkdv")
    for s in summaries:
        cells = "".join(
            f"{s[key]:>{width}.{decimals}f}" if key in s else f"{'-':>{width}}"
            for _, key, width, decimals in SUMMARY_COLUMNS
        )
        print(f"{s['dim']:>4}{s['causal']!s:>7}{s['seqlen']:>7}{cells}  {s['best_dq']} / {s['best_dkdv']}")


def wall_ms(fn: Callable[[], Any]) -> float:
    """One call's wall time in ms (the interpreter's timer: do_bench needs a GPU)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", help="default 4096 16384 (--quick: 4096)")
    parser.add_argument("--dims", type=int, nargs="+", default=list(DIMS))
    parser.add_argument("--quick", action="store_true", help="8 warps and 3 stages only")
    parser.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1: tiny fp32 shape")
    parser.add_argument("--out", help="JSON of every row and the summaries, rewritten after each shape")
    args = parser.parse_args()
    if args.smoke and not triton.knobs.runtime.interpret:
        parser.error("--smoke runs in Triton's interpreter: set TRITON_INTERPRET=1")
    if args.smoke and args.out:
        parser.error("--out records the GPU's name: not with --smoke")
    return args


def sweep(args: argparse.Namespace) -> None:
    """Every shape on cuda:0, the summary table last; the JSON saved after each shape, so a run
    stopped early keeps what it measured."""
    caps, caps_source = device_capabilities("sweep_attention_backward")
    grid = QUICK_GRID if args.quick else DEFAULT_GRID
    seqlens = tuple(args.seqlens or (SEQLENS[:1] if args.quick else SEQLENS))
    dims = tuple(args.dims)
    print(f"{torch.cuda.get_device_name(0)} ({caps_source})")
    print(f"torch {torch.__version__}, triton {triton.__version__}")
    print_estimate(caps, grid, seqlens, dims)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    summaries = []
    for shape in shapes(seqlens, dims):
        case = make_case(shape, caps, "cuda", torch.bfloat16)
        summaries.append(sweep_shape(case, grid, ms, True, rows))
        del case
        torch.cuda.empty_cache()
        save(
            args.out, rows, summaries=summaries, grid=dataclasses.asdict(grid),
            capabilities_source=caps_source, triton=triton.__version__,
        )  # fmt: skip
    print_table(summaries)
    print(f"{time.perf_counter() - started:.0f} s")


def smoke() -> None:
    """The sweep's code path on the CPU in Triton's interpreter, at one tiny fp32 shape."""
    caps = HardwareAbstractionLayer().device("cpu").capabilities
    case = make_case(Shape(batch=1, heads=2, seqlen=64, dim=32, causal=True), caps, "cpu", torch.float32)
    print_table([sweep_shape(case, SMOKE_GRID, wall_ms, False, [])])


def main() -> None:
    args = parse_args()
    if args.smoke:
        smoke()
    else:
        sweep(args)


if __name__ == "__main__":
    main()
