"""Tile and warps of the swiglu/geglu kernels against Liger-Kernel, bf16, on a GPU.

The gated kernels tile each row in blocks of `RowLaunch.elementwise` (GATED_FORWARD_TILE and
ELEMENTWISE_TILE: bytes per tensor per program, bytes per thread), a 1-D grid over the tiles;
Liger runs one program per row. In the sixth session both sat at 97-100% of the copy bandwidth,
Liger up to 3% ahead at hidden 16384 (docs/benchmarks.md).
This times the forward and backward kernels with the block forced to 2048-16384 elements and the
warps to 4, 8 and 16, beside the launch rule and Liger's functional ops (forward under no_grad,
backward through autograd.grad with its output gradient cloned once), do_bench medians, one run.

    python3 benchmarks/sweep_gated_tiles.py [--out sweep.json]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from gpu_capabilities import device_capabilities
from sweep_common import ms, save

from torchhal.kernels import triton_gated
from torchhal.kernels.triton_rows import RowLaunch

SHAPES = [(32768, 4096), (8192, 16384)]
BLOCKS = (2048, 4096, 8192, 16384)
WARPS = (4, 8, 16)


@dataclass(frozen=True)
class ForcedTile(RowLaunch):
    """RowLaunch whose element-wise tile is fixed."""

    block: int = 0
    forced_warps: int = 0

    def elementwise(self, cols: int, element_bytes: int, tile: object = None) -> tuple[int, int]:
        return self.block, self.forced_warps


def shape_rows(base: RowLaunch, rows: int, hidden: int) -> list[dict[str, Any]]:
    """One row per op and direction at (rows, hidden): Liger's time, the rule's, each forced tile's."""
    import liger_kernel.transformers.functional as lf

    g = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    u, dy = torch.randn_like(g), torch.randn_like(g)
    out_rows: list[dict[str, Any]] = []
    for op, liger_fn in (("swiglu", lf.liger_swiglu), ("geglu", lf.liger_geglu)):
        gl, ul = g.clone().requires_grad_(), u.clone().requires_grad_()
        out, dyl = liger_fn(gl, ul), dy.clone()
        with torch.no_grad():
            liger_fwd = ms(lambda fn=liger_fn: fn(g, u))
        liger_bwd = ms(lambda o=out, a=gl, b=ul, d=dyl: torch.autograd.grad(o, (a, b), d, retain_graph=True))
        cases: dict[str, tuple[float, Callable[[RowLaunch], Any]]] = {
            "fwd": (liger_fwd, lambda launch, op=op: triton_gated.gated_forward(launch, op, g, u)),
            "bwd": (liger_bwd, lambda launch, op=op: triton_gated.gated_backward(launch, op, dy, g, u)),
        }
        for direction, (liger_ms, ours) in cases.items():
            row: dict[str, Any] = {
                "case": f"{op} {direction}",
                "shape": f"{rows}x{hidden}",
                "liger_ms": liger_ms,
                "default_ms": ms(lambda ours=ours: ours(base)),
            }
            for block in BLOCKS:
                for warps in WARPS:
                    launch = ForcedTile(**vars(base), block=block, forced_warps=warps)
                    row[f"b{block}w{warps}_ms"] = ms(lambda ours=ours, launch=launch: ours(launch))
            out_rows.append(row)
    return out_rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    caps, _ = device_capabilities("sweep_gated_tiles")
    base = RowLaunch.from_caps(caps)
    rows_out = [row for rows, hidden in SHAPES for row in shape_rows(base, rows, hidden)]
    save(args.out, rows_out)
    columns = [f"b{b}w{w}" for b in BLOCKS for w in WARPS]
    print("time / Liger's time: the launch rule (dflt) and forced tiles (b: block elements, w: warps)")
    print(f"{'case':11s} {'shape':11s}   dflt " + " ".join(f"{c:>9s}" for c in columns))
    for r in rows_out:
        times = " ".join(f"{r[f'{c}_ms'] / r['liger_ms']:9.3f}" for c in columns)
        print(f"{r['case']:11s} {r['shape']:11s} {r['default_ms'] / r['liger_ms']:6.3f} {times}")


if __name__ == "__main__":
    main()
