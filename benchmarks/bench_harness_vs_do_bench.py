"""Does `torchhal.evaluation.measure` agree with `triton.testing.do_bench` within 5 %? (GPU only)

For a few fixed kernels on the best real device (the HAL's selected candidate of matmul-sized,
norm and attention ops, each at least ~0.1 ms so launch overhead does not dominate either
tool), both tools time the same callable, alternating harness / do_bench `--trials` times:

* the harness: device timer (timing events), warm-up, `--repetitions` samples, inputs rotated
  over enough sets to overflow twice the declared L2 (so repeated calls run cold, as do_bench's
  L2 flush makes them); its median;
* the harness again with one fixed input set (warm L2), for the record;
* the harness with `clear_cache=True` (an untimed write over twice the L2 before each sample, as
  do_bench clears its cache before every call) on the fixed set: the like-for-like comparison;
* do_bench(fn, return_mode="median"), which flushes L2 before every call.

Per kernel it reports each tool's median over trials and the ratio of the cache-clearing harness
to do_bench (like for like); the check passes when every such ratio lies in [0.95, 1.05].
Writes JSON (device, versions, date, command).
Usage: python benchmarks/bench_harness_vs_do_bench.py [--out results.json] [--trials 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch

import torchhal
from torchhal.evaluation.harness import Variant, measure
from torchhal.evaluation.inputs import Inputs, sets_to_exceed_cache
from torchhal.hal_core import Device, DeviceRequirements, Feature

TOLERANCE = 0.05


def workloads(dev: Device) -> dict[str, tuple[str, Callable[[int], tuple[Any, ...]], dict[str, Any]]]:
    """name -> (op, make(i) -> args, kwargs). Sizes keep each call near or above 0.1 ms on an H100."""
    bf16 = torch.bfloat16

    def rand(*shape: int) -> torch.Tensor:
        return dev.to_device(torch.randn(*shape, dtype=bf16))

    return {
        "matmul 4096x4096x4096 bf16": ("matmul", lambda i: (rand(4096, 4096), rand(4096, 4096)), {}),
        "matmul 8192x8192x8192 bf16": ("matmul", lambda i: (rand(8192, 8192), rand(8192, 8192)), {}),
        "rms_norm 32768x8192 bf16": ("rms_norm", lambda i: (rand(32768, 8192), rand(8192)), {}),
        "attention b4 h32 s2048 d128 causal bf16": (
            "attention",
            lambda i: (rand(4, 32, 2048, 128), rand(4, 32, 2048, 128), rand(4, 32, 2048, 128)),
            {"causal": True},
        ),
    }


def _bind(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any]:
    return lambda: fn(*args, **kwargs)


def run(hal: torchhal.HardwareAbstractionLayer, dev: Device, trials: int, repetitions: int) -> dict[str, Any]:
    from triton.testing import do_bench

    results: dict[str, Any] = {}
    for name, (op, make, kwargs) in workloads(dev).items():
        first = make(0)
        fn = hal.kernels.select(op, dev, *first, **kwargs).fn
        bytes_per_set = sum(t.numel() * t.element_size() for t in first)
        rotated = Inputs(
            [first, *(make(i) for i in range(1, sets_to_exceed_cache(dev, bytes_per_set)))], kwargs
        )
        fixed = Inputs([first], kwargs)
        harness, harness_fixed, harness_cleared, triton_ms = [], [], [], []
        for _ in range(trials):
            for inputs, clear, sink in (
                (rotated, False, harness),
                (fixed, False, harness_fixed),
                (fixed, True, harness_cleared),
            ):
                m = measure(
                    Variant(name, fn, dev, inputs, hal=hal),
                    warmup=25,
                    repetitions=repetitions,
                    clear_cache=clear,
                )
                sink.append(statistics.median(m.variants[name].latency_ms.tolist()))
            call = _bind(fn, first, kwargs)
            triton_ms.append(do_bench(call, warmup=25, rep=100, return_mode="median"))
        ratio = statistics.median(harness_cleared) / statistics.median(triton_ms)
        results[name] = {
            "candidate": hal.kernels.select(op, dev, *first, **kwargs).candidate.qualified_name,
            "input_sets_rotated": len(rotated),
            "harness_median_ms": statistics.median(harness),
            "harness_fixed_input_median_ms": statistics.median(harness_fixed),
            "harness_cleared_cache_median_ms": statistics.median(harness_cleared),
            "ratio_rotated_over_do_bench": statistics.median(harness) / statistics.median(triton_ms),
            "do_bench_median_ms": statistics.median(triton_ms),
            "per_trial": {
                "harness": harness,
                "harness_fixed_input": harness_fixed,
                "harness_cleared_cache": harness_cleared,
                "do_bench": triton_ms,
            },
            "ratio_cleared_harness_over_do_bench": ratio,
            "within_tolerance": abs(ratio - 1.0) <= TOLERANCE,
        }
        print(
            f"{name}: harness rotated {statistics.median(harness):.4f} / fixed "
            f"{statistics.median(harness_fixed):.4f} / cleared {statistics.median(harness_cleared):.4f} ms, "
            f"do_bench {statistics.median(triton_ms):.4f} ms, ratio cleared/do_bench {ratio:.4f}"
        )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_harness_vs_do_bench.json")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--repetitions", type=int, default=200)
    args = parser.parse_args()
    hal = torchhal.HardwareAbstractionLayer()
    dev = hal.best_device(DeviceRequirements(allow_simulated=False))
    missing = [f.value for f in (Feature.DEVICE_EVENTS, Feature.TRITON) if not dev.capabilities.has(f)]
    if missing:
        print(
            f"{dev.id} ({dev.capabilities.name}) lacks {missing}: this check needs a GPU Triton compiles for"
        )
        return 2
    import triton

    results = run(hal, dev, args.trials, args.repetitions)
    report = {
        "benchmark": "harness vs triton.testing.do_bench",
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(),
        "device": {"id": dev.id, "name": dev.capabilities.name, "arch": dev.capabilities.arch},
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "torchhal": torchhal.__version__,
            "python": platform.python_version(),
        },
        "tolerance": TOLERANCE,
        "results": results,
        "passed": all(r["within_tolerance"] for r in results.values()),
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{'PASS' if report['passed'] else 'FAIL'}: every ratio within ±{TOLERANCE:.0%}; wrote {args.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
