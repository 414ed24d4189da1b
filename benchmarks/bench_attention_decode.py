"""Attention at decoding shapes: a few query rows against a long key/value cache, where the work is
reading the cache (memory-bound) and a kernel that gives each (batch, head) one program leaves
most of the GPU idle when batch x heads is small. Every `attention` candidate the HAL has for the
shape, called directly (bound as selection binds it), and `torchhal.ops.attention` with measured
selection; GPU time from CUDA graphs (triton.testing.do_bench_cudagraph), so the host's launch
cost is not in it. Each row also gives the cache read rate (K and V bytes over the time) against
a device copy measured in the same run (read + write bytes of a copy of K over its time).

    python benchmarks/bench_attention_decode.py --out decode.json [--selection-timing graph]

bf16, 32 query heads and 8 key/value heads (GQA, Llama-3-8B's), head dim 128, full attention (a
single query row sees its whole cache; SDPA's causal mask is top-left aligned, so the op's
bottom-right causal is the same thing here only without the flag). Then packed decoding
(`attention_varlen`): sequences of different cache lengths in one call, its candidates alone.
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

HEADS_Q, HEADS_KV, DIM = 32, 8, 128
SHAPES = [  # (batch, query rows, cache length); 4 query heads per kv head, so 8 and 16 rows are 32
    # and 64 rows of a kv head's group (the split-KV kernel's limit)
    (1, 1, 1024), (1, 1, 4096), (1, 1, 8192), (1, 1, 32768), (1, 1, 131072),
    (8, 1, 8192), (8, 1, 32768), (32, 1, 4096), (32, 1, 16384), (4, 4, 32768),
    (1, 8, 32768), (8, 16, 8192),
]  # fmt: skip


def gpu_us(fn, rounds: int) -> float:
    """Median over rounds of CUDA-graph replays' median time, in µs."""
    return statistics.median(triton.testing.do_bench_cudagraph(fn, rep=40) * 1e3 for _ in range(rounds))


def row(hal: torchhal.HardwareAbstractionLayer, batch: int, rows: int, cache: int, rounds: int) -> dict:
    q = torch.randn(batch, HEADS_Q, rows, DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, HEADS_KV, cache, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    args = (q, k, v, False, None, None)
    device = hal.device_for_tensor(q)
    torchhal.ops.attention(q, k, v)  # the first call selects (and measures)
    selection = hal.kernels.select("attention", device, *args)
    contenders = [c for c in (selection.candidate, *selection.fallbacks) if c.name != "reference"]
    times = {"ops.attention": gpu_us(lambda: torchhal.ops.attention(q, k, v), rounds)}
    for cand in contenders:
        fn = hal.kernels.bound(cand, device)
        times[cand.qualified_name] = gpu_us(lambda fn=fn: fn(*args), rounds)
    copy_us = gpu_us(lambda: k.clone(), rounds)
    cache_bytes = 2 * k.numel() * k.element_size()
    copy_rate = 2 * k.numel() * k.element_size() / copy_us / 1e3  # GB/s: read + write
    return {
        "batch": batch,
        "query_rows": rows,
        "cache": cache,
        "selected": selection.candidate.qualified_name,
        "measured_at_selection_ms": dict(selection.timings_ms),
        "us": times,
        "cache_read_GBps": {name: cache_bytes / us / 1e3 for name, us in times.items()},
        "copy_GBps": copy_rate,
    }


# packed decoding (attention_varlen): (name, query rows per sequence, each sequence's cache length)
VARLEN_SHAPES = [
    ("8 seqs, caches 512..64k", 1, [512 << i for i in range(8)]),
    ("32 seqs, caches 1k..8k", 1, [1024 + (i * 7919) % 7168 for i in range(32)]),
    ("4 seqs x 4 rows, caches 32k", 4, [32768] * 4),
]


def varlen_row(
    hal: torchhal.HardwareAbstractionLayer, name: str, rows: int, caches: list[int], rounds: int
) -> dict:
    def offsets(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0, *lengths], device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)

    q = torch.randn(rows * len(caches), HEADS_Q, DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(caches), HEADS_KV, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    args = (q, k, v, offsets([rows] * len(caches)), offsets(caches), rows, max(caches), False, None)
    device = hal.device_for_tensor(q)
    torchhal.ops.attention_varlen(*args[:7])  # the first call selects (and measures)
    selection = hal.kernels.select("attention_varlen", device, *args)
    contenders = [c for c in (selection.candidate, *selection.fallbacks) if c.name != "reference"]
    times = {"ops.attention_varlen": gpu_us(lambda: torchhal.ops.attention_varlen(*args[:7]), rounds)}
    for cand in contenders:
        fn = hal.kernels.bound(cand, device)
        times[cand.qualified_name] = gpu_us(lambda fn=fn: fn(*args), rounds)
    cache_bytes = 2 * k.numel() * k.element_size()
    return {
        "shape": name,
        "query_rows": rows,
        "caches": caches,
        "selected": selection.candidate.qualified_name,
        "measured_at_selection_ms": dict(selection.timings_ms),
        "us": times,
        "cache_read_GBps": {n: cache_bytes / us / 1e3 for n, us in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out")
    parser.add_argument(
        "--selection-timing",
        choices=("eager", "graph"),
        default="eager",
        help="how ops.attention's measured selection times the candidates (TORCHHAL_SELECTION_TIMING)",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as cache:  # nothing recalled from an earlier run
        settings = Settings(autotune="on", cache_dir=Path(cache), selection_timing=args.selection_timing)
        hal = torchhal.HardwareAbstractionLayer(settings=settings)
        torchhal.ops.set_default_hal(hal)
        rows = []
        for batch, query_rows, cache_len in SHAPES:
            rows.append(row(hal, batch, query_rows, cache_len, args.rounds))
            print(rows[-1]["batch"], rows[-1]["cache"], rows[-1]["us"], flush=True)
        varlen_rows = []
        for name, query_rows, caches in VARLEN_SHAPES:
            varlen_rows.append(varlen_row(hal, name, query_rows, caches, args.rounds))
            print(name, varlen_rows[-1]["us"], flush=True)
    record = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "selection_timing": args.selection_timing,
        "rows": rows,
        "varlen_rows": varlen_rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))
    names = sorted({n for r in rows for n in r["us"]})
    print(
        f"{'batch x rows x cache':>22} {'selected':>20} "
        + " ".join(f"{n[-18:]:>18}" for n in names)
        + "  copy GB/s"
    )
    for r in rows:
        cells = " ".join(
            f"{r['us'][n]:8.1f}us {r['cache_read_GBps'][n]:5.0f}" if n in r["us"] else f"{'-':>18}"
            for n in names
        )
        shape = f"{r['batch']}x{r['query_rows']}x{r['cache']}"
        print(f"{shape:>22} {r['selected'][-20:]:>20} {cells}  {r['copy_GBps']:6.0f}")
    for r in varlen_rows:
        cells = "  ".join(f"{n}: {us:.1f}us {r['cache_read_GBps'][n]:.0f} GB/s" for n, us in r["us"].items())
        print(f"varlen {r['shape']}: selected {r['selected']}  {cells}")


if __name__ == "__main__":
    main()
