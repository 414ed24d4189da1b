"""All-reduce bus bandwidth through the HAL Communicator against raw torch.distributed, 1 MiB to 1 GiB.

Both paths all-reduce (avg, which keeps values finite over thousands of calls; NCCL runs it as a
sum with the division fused) the same fp32 tensor on the same process group: the HAL path is
`Communicator.all_reduce` (its checks, then the collective issued to the process group), the raw
path `dist.all_reduce`.
For each size they are timed in alternating batches (A B B A ...) with the device's own timer,
and the overhead is the median over rounds of (raw - HAL) / raw bus bandwidth.
Bus bandwidth follows nccl-tests: bytes × 2 (n - 1) / n / time.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/bench_allreduce.py --out allreduce.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable
from datetime import datetime, timezone

import torch
import torch.distributed as dist

from torchhal import distributed as thd

MIB = 2**20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-mib", type=int, default=1)
    p.add_argument("--max-mib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=10, help="alternating timed batches per path and size")
    p.add_argument("--batch-ms", type=float, default=20.0, help="target length of one timed batch")
    p.add_argument("--out", help="JSON results (rank 0 writes)")
    return p.parse_args()


def sizes_mib(low: int, high: int) -> list[int]:
    out, size = [], low
    while size <= high:
        out.append(size)
        size *= 2
    return out


def timed_ms(ctx: thd.DistContext, fn: Callable[[], object], calls: int) -> float:
    """Milliseconds per call over `calls` calls, on the device's timer (events on a GPU)."""
    timer = ctx.device.timer()
    start = timer.mark()
    for _ in range(calls):
        fn()
    return timer.elapsed_ms(start, timer.mark()) / calls


def bus_gbps(nbytes: int, world: int, ms: float) -> float:
    return nbytes * 2 * (world - 1) / world / (ms / 1e3) / 1e9


def measure(ctx: thd.DistContext, mib: int, rounds: int, batch_ms: float) -> dict[str, float]:
    comm = ctx.communicator
    tensor = ctx.device.empty((mib * MIB // 4,), torch.float32).uniform_(-1e-3, 1e-3)
    hal = lambda: comm.all_reduce(tensor, "avg")  # noqa: E731
    raw = lambda: dist.all_reduce(tensor, dist.ReduceOp.AVG, group=comm.group)  # noqa: E731
    for fn in (hal, raw, hal, raw):  # warm-up: NCCL channels and buffers for this size
        fn()
    probe = max(timed_ms(ctx, hal, 2), timed_ms(ctx, raw, 2))
    calls = torch.tensor([max(3, min(200, int(batch_ms / max(probe, 1e-3))))], device=tensor.device)
    dist.all_reduce(calls, op=dist.ReduceOp.MAX, group=comm.group)  # every rank issues as many calls
    n = int(calls.item())
    hal_bw, raw_bw, overhead = [], [], []
    for i in range(rounds):
        order = (hal, raw) if i % 2 == 0 else (raw, hal)
        ms = {fn: timed_ms(ctx, fn, n) for fn in order}
        nbytes = tensor.numel() * tensor.element_size()
        a, b = bus_gbps(nbytes, ctx.world_size, ms[hal]), bus_gbps(nbytes, ctx.world_size, ms[raw])
        hal_bw.append(a)
        raw_bw.append(b)
        overhead.append((b - a) / b * 100)
    return {
        "mib": mib,
        "calls_per_batch": n,
        "hal_busbw_gbps": statistics.median(hal_bw),
        "raw_busbw_gbps": statistics.median(raw_bw),
        "overhead_pct": statistics.median(overhead),
        "overhead_pct_spread": max(overhead) - min(overhead),
    }


def main() -> None:
    args = parse_args()
    ctx = thd.init()
    results = []
    for mib in sizes_mib(args.min_mib, args.max_mib):
        row = measure(ctx, mib, args.rounds, args.batch_ms)
        results.append(row)
        if ctx.is_main:
            print(
                f"{mib:>6} MiB  HAL {row['hal_busbw_gbps']:8.1f} GB/s  "
                f"raw {row['raw_busbw_gbps']:8.1f} GB/s  overhead {row['overhead_pct']:+6.2f}% "
                f"(spread {row['overhead_pct_spread']:.2f})",
                flush=True,
            )
    if ctx.is_main and args.out:
        report = {
            "benchmark": "allreduce",
            "command": f"torchrun --nproc-per-node {ctx.world_size} " + " ".join(sys.argv),
            "date": datetime.now(timezone.utc).isoformat(),
            "host": platform.node(),
            "torch_version": torch.__version__,
            "world_size": ctx.world_size,
            "backend": ctx.backend,
            "device": ctx.device.capabilities.name,
            "dtype": "float32",
            "op": "avg",
            "peer": "raw torch.distributed.all_reduce on the same process group",
            "results": results,
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    ctx.shutdown()


if __name__ == "__main__":
    main()
