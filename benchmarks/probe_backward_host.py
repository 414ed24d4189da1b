"""Is the norm backwards' slow mode the host's time, not the kernels'?

bench_norms times each backward as `torch.autograd.grad` of a retained graph with do_bench, which
records CUDA events around every call. When the host takes longer to enqueue a call (the autograd
engine, the Python autograd Function, allocations, the launches) than the GPU takes to run it, the
events time the host. The Python-side backwards (torchhal's and Liger's) cost 100-300 µs of host
time a call on these hosts, against 370-600 µs of GPU time at the large shapes, so a host slower by
half would be enough; eager PyTorch's backward (C++) and the copy would not be touched, as seen.

For each op, shape and implementation this records, in one process and side by side:
  bench_ms   do_bench's median, as bench_norms reads it;
  host_ms    the host's time to enqueue one call (calls back to back, no synchronisation between);
  kernel_ms  the GPU's kernel time of one call (torch.profiler, kernels only, no gaps).
A call is host-bound where host_ms approaches bench_ms. `--cpu N` pins the process (and so its
autograd thread) to CPU N; `--contend` also runs a busy loop pinned there, halving the host's
share of that CPU: if the slow mode is the host, the Python-side backwards slow and eager's not.

    python3 benchmarks/probe_backward_host.py [--cpu 2 [--contend]] [--rounds 2] [--out probe.json]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch
from bench_norms import EAGER, _leaves, _outputs, liger_ops, make_case, row_ops_registry, torchhal_ops
from gpu_capabilities import device_capabilities
from sweep_common import host_ms, kernel_ms, ms, save

OPS = ("layer_norm", "rms_norm", "swiglu")
SHAPES = ((32768, 4096), (16384, 8192), (8192, 16384))


def spin(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


def backward_of(case: Any, fn: Callable[..., Any]) -> Callable[[], Any]:
    leaves = _leaves(case)
    outs = _outputs(fn(*leaves))
    wrt = [leaves[i] for i in case.wrt]
    grads = tuple(g.clone() for g in case.grads)
    return lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", type=int, help="pin the process to this CPU")
    parser.add_argument("--contend", action="store_true", help="and run a busy loop on that CPU")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    spinner = None
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})  # before torch starts its threads, so they inherit it
        if args.contend:
            spinner = multiprocessing.get_context("spawn").Process(target=spin, args=(args.cpu,), daemon=True)
            spinner.start()
    caps, _ = device_capabilities("probe_backward_host")
    impls = {"torchhal": torchhal_ops(row_ops_registry(), caps), "liger": liger_ops(), "eager": EAGER}
    rows: list[dict[str, Any]] = []
    for op in OPS:
        for n_rows, hidden in SHAPES:
            case = make_case(op, n_rows, hidden)
            backwards = {name: backward_of(case, table[op]) for name, table in impls.items()}
            for round_ in range(args.rounds):
                for name, backward in backwards.items():
                    row = {
                        "op": op, "shape": f"{n_rows}x{hidden}", "impl": name, "round": round_,
                        "bench_ms": ms(backward), "host_ms": host_ms(backward),
                        "kernel_ms": kernel_ms(backward),
                    }  # fmt: skip
                    rows.append(row)
            del backwards, case
    if spinner is not None:
        spinner.kill()
    save(args.out, rows, cpu=args.cpu, contend=args.contend)
    print(f"cpu={args.cpu} contend={args.contend}; µs a call, one figure per round: bench / host / gpu")
    grouped: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault((row["op"], row["shape"], row["impl"]), []).append(row)
    for (op, shape, impl), runs in grouped.items():
        cells = "  ".join(
            f"{1000 * r['bench_ms']:.0f}/{1000 * r['host_ms']:.0f}/{1000 * r['kernel_ms']:.0f}" for r in runs
        )
        print(f"{op:<11}{shape:>12} {impl:<9}{cells}")


if __name__ == "__main__":
    main()
