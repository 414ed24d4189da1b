"""The simulated ASIC's matmul estimate beside a measured GPU matmul of the same shape.

Reads a measured profile (`torchhal profile DEVICE --json` output) and prints the simulated
`h100-like` spec's estimate for the same n×n×n product and dtype, with the gap.
Usage: python benchmarks/simasic_vs_measured.py PROFILE.json [--spec h100-like] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json

from torchhal_simasic.cost import matmul_cost
from torchhal_simasic.spec import bundled_spec

from torchhal.hal_core import DType


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("profile")
    parser.add_argument("--spec", default="h100-like")
    parser.add_argument("--dtype", default="bf16")
    args = parser.parse_args()
    measured = json.load(open(args.profile))
    n = measured["matmul_sizes"][args.dtype]
    spec = bundled_spec(args.spec)
    cost = matmul_cost(spec, n, n, n, DType(args.dtype))
    simulated = cost.achieved_flops_per_s / 1e12
    real = measured["matmul_tflops"][args.dtype]
    print(
        f"{args.dtype} {n}x{n}x{n}: simulated {args.spec} {simulated:.1f} TFLOP/s "
        f"({cost.time_s * 1e3:.3f} ms, "
        f"{cost.bound.value}-bound, utilisation {cost.utilisation:.1%}); measured {measured['device_name']} "
        f"{real:.1f} TFLOP/s; simulated/measured = {simulated / real:.3f}"
    )


if __name__ == "__main__":
    main()
