"""Dispatch overhead of `torchhal.ops.<op>` over calling the selected implementation directly.

Both paths run the same candidate on the same tiny tensors, so the difference is the dispatch
(compile and autograd checks, argument memo, cached selection). Three kinds of case: the real
CPU kernels; a no-op candidate registered above every other (the kernel costs nothing, so the
figure is the dispatch alone, free of the kernel's own timing noise); and, where a GPU is
present, the selected GPU kernels on tiny GPU tensors; attention both on contiguous tensors and
(`attention_t`) on transposed views, the layout a model passes. Each case starts from an empty
argument memo, so it times one layout; `attention_pair` then calls both layouts in turn (one
call each: its figures are per pair), where the second layout checked pays for the first's
guard (a model alternating layouts does). Measured interleaved (A B A B ...) in batches;
reports the median per-call difference (and its minimum, the floor least disturbed by a shared
machine), with telemetry unconfigured and with an in-memory exporter configured. The memo's
guards are torchhal_speedups' C ones where installed; TORCHHAL_PURE_PYTHON_GUARDS=1 times the
Python ones (the JSON's "guards" says which ran).
Usage: python benchmarks/bench_dispatch.py [--out results.json] [--pin CORE] [--cases NAME ...]
       [--modes unconfigured memory-exporter] [--no-layers] [--rounds N] [--calls N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch

import torchhal
from torchhal.hal_core import KernelRegistry, hookimpl, telemetry

try:  # the key, timed alone; builds before the twenty-third session kept it in hal_core.kernels
    from torchhal.hal_core.dispatch_memo import _argument_key, guard_implementation
except ImportError:
    from torchhal.hal_core.kernels import _argument_key, guard_implementation  # type: ignore[attr-defined,no-redef]

CALLS = 20_000
ROUNDS = 15


def per_call_us(fn: Callable[[], object]) -> float:
    start = time.perf_counter_ns()
    for _ in range(CALLS):
        fn()
    return (time.perf_counter_ns() - start) / CALLS / 1e3


def overhead(op: Callable[[], object], direct: Callable[[], object]) -> dict[str, float]:
    for _ in range(3):
        op(), direct()
    ops, directs, diffs = [], [], []
    for _ in range(ROUNDS):
        a, b = per_call_us(op), per_call_us(direct)
        ops.append(a)
        directs.append(b)
        diffs.append(a - b)
    return {
        "ops_us": statistics.median(ops),
        "direct_us": statistics.median(directs),
        "overhead_us": statistics.median(diffs),
        "overhead_min_us": min(diffs),  # the floor, least disturbed by a shared machine's noise
        "overhead_spread_us": statistics.quantiles(diffs, n=4)[2] - statistics.quantiles(diffs, n=4)[0],
    }


Case = tuple[Callable[[], object], Callable[[], object]]
CASES = ("rms_norm", "attention", "attention_t", "attention_pair")  # the keys `cases` returns


class NoopKernels:
    """A candidate per op that returns its first input: dispatch is then all there is to time."""

    @staticmethod
    @hookimpl
    def torchhal_register_kernels(registry: KernelRegistry) -> None:
        registry.register("rms_norm", "noop", lambda x, w, eps: x, provider="bench", priority=1e9)
        registry.register(
            "attention", "noop", lambda q, k, v, causal, scale, window: q, provider="bench", priority=1e9
        )


def cases(hal: torchhal.HardwareAbstractionLayer, device: str) -> dict[str, Case]:
    dev = hal.device(device)
    x, w = torch.randn(4, 64, device=device), torch.randn(64, device=device)
    # three tensors, as a model passes them (torch's tensor guard refuses one object passed twice)
    q, k, v = (torch.randn(1, 2, 8, 16, device=device) for _ in range(3))
    # (batch, seq, heads, dim) projections viewed as (batch, heads, seq, dim)
    qt, kt, vt = (torch.randn(1, 8, 2, 16, device=device).transpose(1, 2) for _ in range(3))
    norm = hal.kernels.select("rms_norm", dev, x, w).fn
    attn = hal.kernels.select("attention", dev, q, k, v, causal=True).fn
    attn_t = hal.kernels.select("attention", dev, qt, kt, vt, causal=True).fn
    return {
        "rms_norm": (lambda: torchhal.ops.rms_norm(x, w), lambda: norm(x, w, 1e-6)),
        "attention": (
            lambda: torchhal.ops.attention(q, k, v, causal=True),
            lambda: attn(q, k, v, True, None, None),
        ),
        "attention_t": (
            lambda: torchhal.ops.attention(qt, kt, vt, causal=True),
            lambda: attn_t(qt, kt, vt, True, None, None),
        ),
        "attention_pair": (
            lambda: (
                torchhal.ops.attention(q, k, v, causal=True),
                torchhal.ops.attention(qt, kt, vt, causal=True),
            ),
            lambda: (attn(q, k, v, True, None, None), attn_t(qt, kt, vt, True, None, None)),
        ),
    }


def layers(hal: torchhal.HardwareAbstractionLayer) -> dict[str, Case]:
    """Where the no-op dispatch time goes, layer by layer (each against the direct no-op call):
    the tensor-metadata key alone (reading type, dtype, shape, strides and device of each tensor,
    each scalar's type, and one dict lookup: what every call paid before the memo's guards, and
    what a call that misses them pays after the failed checks), the
    registry's dispatch, the HAL's, and the public op."""
    x, w = torch.randn(4, 64), torch.randn(64)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    memo: dict[object, object] = {}
    locate = hal._locate  # the HAL's own device lookup, as HAL.dispatch passes it

    def key_alone(*args: object) -> object:
        return memo.get(_argument_key(None, args))

    noop = lambda *args: args[0]  # noqa: E731
    out: dict[str, Case] = {}
    for name, args, public in (
        ("rms_norm", (x, w, 1e-6), lambda: torchhal.ops.rms_norm(x, w)),
        ("attention", (q, k, v, True, None, None), lambda: torchhal.ops.attention(q, k, v, causal=True)),
    ):
        direct = lambda args=args: noop(*args)  # noqa: E731
        out[f"{name}/key alone"] = (lambda args=args: key_alone(*args), direct)
        out[f"{name}/registry.dispatch"] = (
            lambda name=name, args=args: hal.kernels.dispatch(name, None, locate, *args),
            direct,
        )
        out[f"{name}/hal.dispatch"] = (lambda name=name, args=args: hal.dispatch(name, *args), direct)
        out[f"{name}/torchhal.ops"] = (public, direct)
    return out


def main() -> None:
    global CALLS, ROUNDS
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument(
        "--pin", type=int, help="run on this CPU core only (unpinned, H100-host medians swung up to 60%%)"
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=(*CASES, "none"),
        help="only these cases (default: all); 'none' runs only the layers",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["unconfigured", "memory-exporter"],
        choices=["unconfigured", "memory-exporter"],
    )
    parser.add_argument("--no-layers", action="store_true", help="leave out the per-layer breakdown")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved batches per case")
    parser.add_argument("--calls", type=int, default=CALLS, help="calls per batch")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error(f"--rounds must be at least 2 (the spread needs two batches), got {args.rounds}")
    CALLS, ROUNDS = args.calls, args.rounds
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    torch.set_num_threads(1)
    hals = {
        "cpu": torchhal.HardwareAbstractionLayer(),
        "noop": torchhal.HardwareAbstractionLayer(plugins=[NoopKernels]),
    }
    targets = [("cpu", "cpu"), ("noop", "cpu")] + ([("cpu", "cuda")] if torch.cuda.is_available() else [])
    results: dict[str, object] = {
        "pinned_core": args.pin,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torchhal": torchhal.__file__,  # which build ran (an old one shadowed in on PYTHONPATH, say)
        "guards": guard_implementation(),  # torchhal_speedups (C) or python (TORCHHAL_PURE_PYTHON_GUARDS)
        "options": {"cases": args.cases, "modes": args.modes, "rounds": ROUNDS, "calls": CALLS},
    }
    for mode in args.modes:
        telemetry.configure(exporter="none" if mode == "unconfigured" else "memory")
        for kernels, device in targets:
            torchhal.ops.set_default_hal(hals[kernels])
            label = "noop" if kernels == "noop" else device
            for name, (op, direct) in cases(hals[kernels], device).items():
                if args.cases and name not in args.cases:
                    continue
                hals[kernels].kernels.clear_cache()  # this case's layouts alone in the memo
                results[f"{name}/{label}/{mode}"] = overhead(op, direct)
    telemetry.configure(exporter="none")
    torchhal.ops.set_default_hal(hals["noop"])
    for name, (op, direct) in ({} if args.no_layers else layers(hals["noop"])).items():
        hals["noop"].kernels.clear_cache()
        results[f"layers/{name}"] = overhead(op, direct)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    print(f"{'case':<36}{'ops µs':>10}{'direct µs':>11}{'overhead µs':>13}{'min':>8}{'IQR':>8}")
    for key, row in results.items():
        if isinstance(row, dict) and "ops_us" in row:
            print(
                f"{key:<36}{row['ops_us']:>10.2f}{row['direct_us']:>11.2f}{row['overhead_us']:>13.2f}"
                f"{row['overhead_min_us']:>8.2f}{row['overhead_spread_us']:>8.2f}"
            )


if __name__ == "__main__":
    main()
