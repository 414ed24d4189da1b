"""In-process A/B of the norm kernels (the backwards unless --cases says otherwise), or of the
gated kernels: an older triton_norms.py (triton_gated.py for the gated cases) against the
installed one.

Separate runs of bench_norms swing by up to 40% on the backward (both torchhal's and Liger's, one
run to the next), more than the changes they should judge. This loads the older file as its own
module beside the installed one and times, in each of several rounds, the old
kernel, the new one (by its launch rule and with the warps forced, if asked) and Liger's
one after the other (do_bench medians, L2 flushed), so drift hits them alike. Every variant's
outputs are compared with the old kernel's before anything is timed. The old file imports
the installed `triton_rows`, so "old" is the old kernels under the current launch rules (for
triton_gated.py, under the tiles the old file itself asks `RowLaunch.elementwise` for).

    python3 benchmarks/ab_row_backward.py --old /tmp/old/triton_norms.py [--warps 4 8] [--out ab.json]
        [--variant NAME=PATH ...]   # more kernels files, each timed beside old and new
        [--cases "rms_norm fwd" "layer_norm fwd"]   # the forwards instead
    python3 benchmarks/ab_row_backward.py --old /tmp/old/triton_gated.py --cases "swiglu fwd" "geglu fwd"
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
from gpu_capabilities import device_capabilities
from sweep_common import load_module, ms, save
from sweep_row_warps import ForcedWarps, cases

from torchhal.kernels.triton_rows import RowLaunch

SHAPES = [(32768, 4096), (16384, 8192), (8192, 16384)]


Call = Callable[[RowLaunch, Any], Any]  # a kernel call, given the launch and the kernels module
NORM_CASES = ("rms_norm fwd", "rms_norm bwd", "layer_norm fwd", "layer_norm bwd")  # sweep_row_warps' cases
# these call triton_gated.py, the others triton_norms.py; one run's --cases call one file
GATED_CASES = ("swiglu fwd", "swiglu bwd", "geglu fwd", "geglu bwd")


def check(name: str, variant: str, old_out: Any, out: Any) -> None:
    """Each output (a forward's, or a backward's gradients) of `variant` against the old kernel's,
    element by element, within two roundings of its dtype: both compute the same sums in fp32, in
    another order at most."""
    old_out, out = (t if isinstance(t, tuple) else (t,) for t in (old_out, out))
    for i, (a, b) in enumerate(zip(old_out, out, strict=True)):
        a, b, ulp = a.float(), b.float(), torch.finfo(a.dtype).eps
        if not torch.allclose(b, a, rtol=2 * ulp, atol=2 * ulp * a.abs().max().item()):
            err = (b - a).abs().max().item()
            raise SystemExit(f"{name}: output {i} of {variant} differs from old's by up to {err:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", required=True, help="path of the older triton_norms.py or triton_gated.py")
    parser.add_argument("--warps", type=int, nargs="*", default=[], help="also the new kernel at these warps")
    parser.add_argument("--variant", action="append", default=[], help="NAME=PATH of another kernels file")
    parser.add_argument("--rounds", type=int, default=5)
    backwards = ["rms_norm bwd", "layer_norm bwd"]
    parser.add_argument("--cases", nargs="+", choices=NORM_CASES + GATED_CASES, default=backwards)
    parser.add_argument("--out")
    args = parser.parse_args()
    if len({case in GATED_CASES for case in args.cases}) > 1:
        parser.error(f"--cases mixes norm and gated cases, which call different kernels files: {args.cases}")
    old = load_module(args.old)
    caps, _ = device_capabilities("ab_row_backward")
    base = RowLaunch.from_caps(caps)
    forced = {f"new_w{w}": ForcedWarps(**vars(base), forced=w) for w in args.warps}
    variants: dict[str, Callable[[Call], Any]] = {
        "old": lambda f: f(base, old),
        "new": lambda f: f(base),  # the installed kernels file, the cases' default
        **{name: (lambda f, launch=launch: f(launch)) for name, launch in forced.items()},
    }
    for spec in args.variant:
        name, _, path = spec.partition("=")
        if not name or not path or name in (*variants, "liger"):
            parser.error(
                f"--variant takes NAME=PATH with a new NAME (not old, new, liger or a new_w*), got {spec!r}"
            )
        module = load_module(path)
        variants[name] = lambda f, module=module: f(base, module)
    rows_out: list[dict[str, Any]] = []
    for rows, hidden in SHAPES:
        shape_cases = cases(rows, hidden)
        for name in args.cases:
            ours, liger = shape_cases[name]
            reference = ours(base, old)
            for v, run in variants.items():
                check(name, v, reference, run(ours))
            times: dict[str, list[float]] = {v: [] for v in (*variants, "liger")}
            for _ in range(args.rounds):
                for v, run in variants.items():
                    times[v].append(ms(lambda run=run, ours=ours: run(ours)))
                times["liger"].append(ms(liger))
            rows_out.append({"case": name, "shape": f"{rows}x{hidden}", "ms": times})
        torch.cuda.empty_cache()
    save(args.out, rows_out, rounds=args.rounds, old=args.old, variants=args.variant)
    names = list(variants)
    print("speed vs Liger, median over rounds (range); new's speed over old's; Liger's ms median")
    print(f"{'case':15s} {'shape':11s} " + " ".join(f"{v:>21s}" for v in names) + "  new/old  liger ms")
    for r in rows_out:
        liger = r["ms"]["liger"]
        cells = []
        for v in names:
            ratios = [lt / t for lt, t in zip(liger, r["ms"][v], strict=True)]
            cells.append(f"{statistics.median(ratios):5.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
        gain = statistics.median(o / n for o, n in zip(r["ms"]["old"], r["ms"]["new"], strict=True))
        print(
            f"{r['case']:15s} {r['shape']:11s} "
            + " ".join(f"{c:>21s}" for c in cells)
            + f"  {gain:7.3f}  {statistics.median(liger):8.3f}"
        )


if __name__ == "__main__":
    main()
