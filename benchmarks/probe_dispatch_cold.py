"""What the dispatch's pieces cost in front of a real kernel against in front of a no-op.

bench_dispatch.py finds `torchhal.ops` about 1 µs slower over the direct call when a real kernel
(CPU or CUDA) runs behind it than when a no-op candidate does, on an H100 host's CPU: the same
Python runs slower between kernels. This times, against the bare call, the same call behind 1,
3 and 9 pass-through Python frames and behind torch's C++ `TensorGuards.check` of three tensors
(the memo's guard), once with a no-op and once with a real kernel behind them, so each piece's
cost can be read both ways. Interleaved batches, median of the per-batch differences
(bench_dispatch's `overhead`).

    python3 benchmarks/probe_dispatch_cold.py [--pin CORE] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

import torch
from bench_dispatch import overhead

import torchhal


def behind_frames(fn: Callable[..., Any], depth: int) -> Callable[..., Any]:
    """fn called through `depth` Python functions that pass their arguments on."""
    for _ in range(depth):
        fn = (lambda inner: lambda *args: inner(*args))(fn)
    return fn


def kernels() -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    """(function, arguments): a no-op, and attention's selected kernel on CPU and, if any, CUDA."""
    hal = torchhal.HardwareAbstractionLayer()
    out: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {}
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        q, k, v = (torch.randn(1, 2, 8, 16, device=device) for _ in range(3))
        fn = hal.kernels.select("attention", hal.device(device), q, k, v, causal=True).fn
        if device == "cpu":
            out["noop"] = (lambda *args: args[0], (q, k, v, True, None, None))
        out[f"attention/{device}"] = (fn, (q, k, v, True, None, None))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pin", type=int, help="run on this CPU core only")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    torch.set_num_threads(1)
    guards = torch._C._dynamo.guards.TensorGuards
    results: dict[str, dict[str, float]] = {}
    for name, (fn, fn_args) in kernels().items():
        tensors = fn_args[:3]
        check = guards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
        direct = lambda fn=fn, a=fn_args: fn(*a)  # noqa: E731
        for depth in (1, 3, 9):
            wrapped = behind_frames(fn, depth)
            results[f"{name}/{depth} frames"] = overhead(lambda w=wrapped, a=fn_args: w(*a), direct)
        results[f"{name}/guard check"] = overhead(
            lambda fn=fn, a=fn_args, t=tensors, c=check: (c(*t), fn(*a)), direct
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    print(f"{'case':<32}{'direct µs':>11}{'over µs':>10}{'min':>8}{'IQR':>8}")
    for key, row in results.items():
        print(
            f"{key:<32}{row['direct_us']:>11.2f}{row['overhead_us']:>10.2f}"
            f"{row['overhead_min_us']:>8.2f}{row['overhead_spread_us']:>8.2f}"
        )


if __name__ == "__main__":
    main()
