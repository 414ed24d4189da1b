"""Where an eager attention call at a decoding shape spends its host time, layer by layer.

At a decoding shape the GPU finishes a call in a few µs, so back-to-back calls run at the speed
of the host: each layer below is timed as wall time per call over many calls (the GPU never
holds the host back), interleaved in rounds, median of the rounds. Layers, outermost first:

- `sdpa`: `F.scaled_dot_product_attention` (the peer, one ATen launch);
- `ops`: `torchhal.ops.attention`, selection by priority (autotune off), so the split-KV kernel
  (`triton_decode`) or, past its row limit, the FlashAttention kernel (`triton`);
- `bound`: the selected candidate's bound callable (no registry);
- `kernel_forward`: the kernel module's `forward` with the problem, tile and slices made;
- `launches`: the Triton launches alone (`kernel[grid](...)`), buffers and arguments made;
- `compiled_run`: the same launches through the compiled kernels' own launcher
  (`CompiledKernel.run`), what is left once Triton's argument binding and specialisation are
  skipped: the floor of a Triton launch on this host;
- `empties`: the split-KV forward's `torch.empty` calls (output, lse, the slices' partials).

Then a cProfile of the decoding case's `ops` layer (own time and cumulative time per call).

    python benchmarks/profile_attention_host.py --out host.json [--outer]
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import json
import math
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import torchhal
from torchhal.hal_core.settings import Settings

HEADS_Q, HEADS_KV, DIM = 32, 8, 128


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def compiled_launcher(
    jit_fn, compiled, grid: tuple[int, ...], args: tuple, constexprs: dict
) -> Callable[[], None]:
    """A call of `compiled`'s launcher with the arguments bound as Triton binds them."""
    bound = inspect.signature(jit_fn.fn).bind(*args, **constexprs)
    bound.apply_defaults()
    values = tuple(bound.arguments.values())
    compiled._init_handles()
    grid3 = (*grid, 1, 1)[:3]

    def launch() -> None:
        stream = torch.cuda.current_stream().cuda_stream
        compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)

    return launch


def outer_layers(hal, q, k, v) -> tuple[str, dict[str, Callable[[], object]]]:
    """The selected candidate's name and the layers every build has: SDPA, the op, the bound callable."""
    device = hal.device_for_tensor(q)
    args = (q, k, v, False, None, None)
    selection = hal.kernels.select("attention", device, *args)
    bound = hal.kernels.bound(selection.candidate, device)
    return selection.candidate.qualified_name, {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "ops": lambda: torchhal.ops.attention(q, k, v),
        "bound": lambda: bound(*args),
    }


def decode_layers(hal, q, k, v) -> dict[str, Callable[[], object]]:
    """The split-KV kernel's inner layers: its forward, its two launches, their compiled launchers."""
    from torchhal.kernels import triton_attention_decode as decode
    from torchhal.kernels.triton_attention_config import decode_splits, decode_tile
    from torchhal.kernels.triton_attention_kernels import (
        LOG2E,
        _common,
        _row_strides,
        _strides,
        dense_problem,
    )

    device = hal.device_for_tensor(q)
    problem = dense_problem(q, k)
    rows = decode.query_tile_rows(problem.heads_q, problem.heads_kv, problem.seq_q)
    tile = decode_tile(device.capabilities, problem.head_dim_padded, q.element_size(), rows)
    keys = decode.visible_keys(problem, tile.block_n)
    splits, per_split = decode_splits(
        device.capabilities, problem.heads_kv * decode.keys_read(problem, k, keys), keys, tile.block_n
    )
    d_pad, batch, group = problem.head_dim_padded, problem.batch, problem.heads_q // problem.heads_kv
    n_rows = group * problem.seq_q
    part_size = batch * problem.heads_kv * splits * n_rows * (d_pad + 1)
    part = torch.empty(part_size, dtype=torch.float32, device="cuda")
    out, lse = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32, device="cuda")
    cu_q, cu_k, flags = _common(problem, q)
    split_grid = (splits * problem.heads_kv * batch,)
    split_args = (
        q, k, v, part, cu_q, cu_k, _strides(q, False), _strides(k, False), _strides(v, False),
        group, problem.seq_q, problem.seq_k, problem.heads_kv, splits, math.copysign(1.0, problem.scale),
        abs(problem.scale) * LOG2E, problem.window_left, problem.window_right, per_split,
    )  # fmt: skip
    split_consts = {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, **flags}
    split_opts = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    combine_grid = (n_rows * problem.heads_kv * batch,)
    combine_args = (
        part, out, lse, cu_q, _strides(out, False), _row_strides(lse, False), group,
        problem.seq_q, problem.heads_kv, splits, batch, q.shape[0],
    )  # fmt: skip
    combine_consts = {
        "HEAD_DIM": problem.head_dim,
        "D_PAD": d_pad,
        "SPLITS": decode.COMBINE_SPLITS,
        "VARLEN": False,
    }

    def launches() -> tuple:
        a = decode._split_kernel[split_grid](*split_args, **split_consts, **split_opts)
        b = decode._combine_kernel[combine_grid](*combine_args, **combine_consts, num_warps=1)
        return a, b

    split_compiled, combine_compiled = launches()
    run_split = compiled_launcher(decode._split_kernel, split_compiled, split_grid, split_args, split_consts)
    run_combine = compiled_launcher(
        decode._combine_kernel, combine_compiled, combine_grid, combine_args, combine_consts
    )

    def empties() -> None:
        torch.empty(q.shape, dtype=q.dtype, device=q.device)
        torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        torch.empty(part_size, dtype=torch.float32, device=q.device)

    return {
        "kernel_forward": lambda: decode.forward(q, k, v, problem, tile, splits, per_split),
        "launches": launches,
        "compiled_run": lambda: (run_split(), run_combine()),
        "empties": empties,
    }


def flash_layers(hal, q, k, v) -> dict[str, Callable[[], object]]:
    """The FlashAttention kernel's forward (selected past the split-KV kernel's row limit)."""
    from torchhal.kernels import triton_attention_kernels as kernels
    from torchhal.kernels.triton_attention import _Configs

    problem = kernels.dense_problem(q, k)
    configs = _Configs(hal.device_for_tensor(q).capabilities).of(q, problem.head_dim_padded)
    return {"kernel_forward": lambda: kernels.forward(q, k, v, problem, configs)}


def measure(layers: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, float]:
    for fn in layers.values():  # compile, select, warm every path
        for _ in range(20):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in layers}
    with torch.no_grad():
        for _ in range(rounds):
            for name, fn in layers.items():
                samples[name].append(per_call_us(fn, calls))
    return {name: statistics.median(s) for name, s in samples.items()}


def profile_text(fn: Callable[[], object], calls: int) -> str:
    profile = cProfile.Profile()
    with torch.no_grad():
        profile.enable()
        for _ in range(calls):
            fn()
        profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    for key in ("tottime", "cumulative"):
        text.write(f"--- by {key} (seconds over {calls} calls)\n")
        stats.sort_stats(key).print_stats(30)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--cache", type=int, default=1024, help="keys per sequence")
    parser.add_argument("--out", help="JSON of the layer times")
    parser.add_argument("--profile-out", help="text of the cProfile of the ops layer")
    parser.add_argument(
        "--outer",
        action="store_true",
        help="only the layers every build has (sdpa, ops, bound): to compare builds",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as cache:
        hal = torchhal.HardwareAbstractionLayer(settings=Settings(autotune="off", cache_dir=Path(cache)))
        torchhal.ops.set_default_hal(hal)
        k, v = (
            torch.randn(1, HEADS_KV, args.cache, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2)
        )

        def query(rows: int) -> torch.Tensor:
            return torch.randn(1, HEADS_Q, rows, DIM, device="cuda", dtype=torch.bfloat16)

        cases = {}
        for name, q, inner in (
            ("decode 1x32x1", query(1), decode_layers),
            ("flash 1x32x64", query(64), flash_layers),
        ):
            selected, layers = outer_layers(hal, q, k, v)
            if not args.outer:
                layers.update(inner(hal, q, k, v))
            cases[name] = {"selected": selected, "us": measure(layers, args.rounds, args.calls)}
            if name.startswith("decode"):
                profile = profile_text(layers["ops"], args.calls)
    record = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cache": args.cache,
        "rounds": args.rounds,
        "calls": args.calls,
        "cases": cases,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))
    if args.profile_out:
        Path(args.profile_out).write_text(profile)
    print(profile[:6000])
    for name, r in cases.items():
        print(
            f"{name} (selected {r['selected']}): " + "  ".join(f"{k2} {us:.1f}" for k2, us in r["us"].items())
        )


if __name__ == "__main__":
    main()
