"""`torchhal.ops.attention` with measured selection against every candidate it could have chosen.

Usage: python benchmarks/bench_attention_selection.py [--seqlens 512 ... 16384] [--out FILE]

FlashAttention's forward sweep (bf16, batch x seqlen = 16k tokens, hidden 2048, head dim 64 and
128, causal and full). A HAL with measured selection on (its winners cached in a fresh temporary
directory, so nothing from an earlier run is recalled) picks an `attention` candidate on the first
call of each shape; then `torchhal.ops.attention` and each valid candidate called directly (bound
to the device as selection binds it) are timed with triton.testing.do_bench, in five interleaved
rounds (the order rotating), median of the rounds.
Target: ops.attention >= 0.97x the fastest candidate on every shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton.testing

import torchhal
from torchhal.hal_core.settings import Settings

TOKENS, HIDDEN, ROUNDS = 16 * 1024, 2048, 5
TARGET = 0.97


def shape_rows(hal: torchhal.HardwareAbstractionLayer, seqlen: int, dim: int, causal: bool) -> dict:
    batch, heads = TOKENS // seqlen, HIDDEN // dim
    q, k, v = (torch.randn(batch, heads, seqlen, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    args = (q, k, v, causal, None, None)
    device = hal.device_for_tensor(q)
    torchhal.ops.attention(q, k, v, causal=causal)  # the first call selects (and measures)
    selection = hal.kernels.select("attention", device, *args)
    contenders = [selection.candidate, *selection.fallbacks]
    variants = {"ops.attention": lambda: torchhal.ops.attention(q, k, v, causal=causal)}
    for cand in contenders:
        if cand.name != "reference":
            fn = hal.kernels.bound(cand, device)
            variants[cand.qualified_name] = lambda fn=fn: fn(*args)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for i in range(ROUNDS):  # the order rotates, so no variant always runs right after the slowest
        for name in names[i % len(names) :] + names[: i % len(names)]:
            times[name].append(triton.testing.do_bench(variants[name], warmup=10, rep=60))
    ms = {name: statistics.median(t) for name, t in times.items()}
    fastest = min((n for n in ms if n != "ops.attention"), key=ms.__getitem__)
    return {
        "seqlen": seqlen,
        "head_dim": dim,
        "causal": causal,
        "batch": batch,
        "heads": heads,
        "selected": selection.candidate.qualified_name,
        "measured_at_selection_ms": dict(selection.timings_ms),
        "ms": ms,
        "fastest": fastest,
        "ratio_vs_fastest": ms[fastest] / ms["ops.attention"],
        "ratio_vs_selected_direct": ms[selection.candidate.qualified_name] / ms["ops.attention"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as cache:
        hal = torchhal.HardwareAbstractionLayer(settings=Settings(autotune="on", cache_dir=Path(cache)))
        torchhal.ops.set_default_hal(hal)
        caps = hal.device_for_tensor(torch.empty(0, device="cuda")).capabilities
        rows = []
        for dim in args.head_dims:
            for causal in (False, True):
                for seqlen in args.seqlens:
                    rows.append(shape_rows(hal, seqlen, dim, causal))
                    r = rows[-1]
                    print(
                        f"d{dim} {'causal' if causal else 'full'} s{seqlen} selected {r['selected']} "
                        f"fastest {r['fastest']} ops {r['ms']['ops.attention']:.3f} ms  "
                        f"ratio {r['ratio_vs_fastest']:.3f}",
                        flush=True,
                    )
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": caps.model_dump(mode="json"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rows": rows,
        "min_ratio": min(r["ratio_vs_fastest"] for r in rows),
        "target": TARGET,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        f"\nops.attention / fastest candidate: min {result['min_ratio']:.3f} over {len(rows)} shapes "
        f"(target >= {TARGET}); below target: "
        + (
            ", ".join(
                f"d{r['head_dim']}{'c' if r['causal'] else 'f'}s{r['seqlen']}={r['ratio_vs_fastest']:.3f}"
                for r in rows
                if r["ratio_vs_fastest"] < TARGET
            )
            or "none"
        )
    )


if __name__ == "__main__":
    main()
