"""Is the norm backwards' slow mode tied to where their tensors lie in memory?

Separate processes of bench_norms sometimes run one backward at half its usual bandwidth (e.g.
layer_norm at 16384x8192: 1430 GB/s in one process, 2390 in the two beside it), and which kernel
it hits changes from process to process. This allocates fresh inputs several times in one
process, each time after a pad of random size so that they land at other addresses, and times the
rms_norm and layer_norm backwards and a plain copy of the same bytes on each set. A slow mode that
comes and goes between the sets of one process follows the memory; one that holds for a whole
process does not. `--hold-gib` first fills that much device memory and keeps it (bench_norms
keeps several GB of peers' inputs and graphs alive): a slow mode that comes only then points at
the footprint (address translation) rather than the kernels.

    python3 benchmarks/probe_backward_modes.py [--sets 8] [--shape 16384x8192] [--seed N]
        [--hold-gib 0] [--out probe.json]
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import torch
from gpu_capabilities import device_capabilities
from sweep_common import ms, save

from torchhal.kernels import triton_norms
from torchhal.kernels.triton_rows import RowLaunch


def time_one_set(launch: RowLaunch, rows: int, hidden: int) -> dict[str, Any]:
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = (1 + 0.2 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    b = (0.2 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    _, mean, rstd = triton_norms.layer_norm_forward_with_stats(launch, x, w, b, 1e-5)
    copy_dst = torch.empty_like(x)
    moved = 3 * x.numel() * x.element_size()  # each backward reads x and dy and writes dx
    timings = {
        "rms_norm bwd": ms(lambda: triton_norms.rms_norm_backward(launch, dy, x, w, 1e-6)),
        "layer_norm bwd": ms(lambda: triton_norms.layer_norm_backward(launch, dy, x, w, mean, rstd)),
        "copy": ms(lambda: copy_dst.copy_(x)),
    }
    gbps = {name: moved / (t * 1e-3) / 1e9 for name, t in timings.items() if name != "copy"}
    gbps["copy"] = 2 * x.numel() * x.element_size() / (timings["copy"] * 1e-3) / 1e9
    return {"x_ptr": x.data_ptr(), "dy_ptr": dy.data_ptr(), "ms": timings, "gbps": gbps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sets", type=int, default=8)
    parser.add_argument("--shape", default="16384x8192")
    parser.add_argument("--seed", type=int, help="of the pad sizes (default: a fresh one, recorded)")
    parser.add_argument("--hold-gib", type=float, default=0.0, help="device memory to fill and keep first")
    parser.add_argument("--out")
    args = parser.parse_args()
    rows, hidden = (int(v) for v in args.shape.split("x"))
    caps, _ = device_capabilities("probe_backward_modes")
    launch = RowLaunch.from_caps(caps)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    held = [  # written once, so the pages are really mapped
        torch.zeros(1 << 28, dtype=torch.uint8, device="cuda") for _ in range(int(args.hold_gib * 4))
    ]
    rng, pads, results = random.Random(seed), [], []
    print(f"{'set':>3} {'x_ptr':>14}  rms_norm bwd GB/s  layer_norm bwd GB/s  copy GB/s")
    for i in range(args.sets):
        pad = rng.randrange(1, 1 << 28)
        pads.append(torch.empty(pad, dtype=torch.uint8, device="cuda"))  # kept alive
        result = {"pad_bytes": pad, **time_one_set(launch, rows, hidden)}
        results.append(result)
        rms, ln, copy = (result["gbps"][k] for k in ("rms_norm bwd", "layer_norm bwd", "copy"))
        print(f"{i:>3} {result['x_ptr']:>#14x}  {rms:>17.0f}  {ln:>19.0f}  {copy:>9.0f}")
        torch.cuda.empty_cache()
    print(f"seed {seed}, {len(held) / 4:g} GiB held")
    save(args.out, results, shape=args.shape, seed=seed, held_gib=len(held) / 4)


if __name__ == "__main__":
    main()
