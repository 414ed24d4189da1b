"""What is alive at the peak of one linear_cross_entropy forward + backward, from CUDA's allocator history.

Records `torch.cuda.memory._record_memory_history` over one training call of
`torchhal.ops.linear_cross_entropy` (bf16, hidden 2048), replays the allocation trace to find the
moment of the highest allocated total, and lists the blocks alive then, largest first, each with
the innermost torchhal (else Python) frame that allocated it. The inputs are allocated before
recording starts, so the figures are bytes beyond the inputs, as bench_cross_entropy reports.

    python3 benchmarks/profile_lce_memory.py [--tokens 8192] [--vocab 128256] [--out peak.json]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

import torchhal

GIB = 2**30


def where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in torchhal, else the innermost Python frame."""
    python = [f for f in frames if f.get("filename", "").endswith(".py")]
    ours = [f for f in python if "torchhal" in f["filename"]]
    for f in ours or python or frames[:1]:
        return f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}"
    return "?"


def peak_blocks(trace: list[dict[str, Any]]) -> tuple[int, list[tuple[int, str]]]:
    """(peak bytes, [(bytes, where)] of the blocks alive at the peak), replaying alloc/free events."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: list[tuple[int, str]] = []
    for event in trace:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, where(event.get("frames", [])))
            total += size
            if total > peak:
                peak, at_peak = total, sorted(live.values(), reverse=True)
        elif action == "free_completed" and addr in live:
            total -= live.pop(addr)[0]
    return peak, at_peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--out")
    args = parser.parse_args()
    dev, dt = "cuda", torch.bfloat16
    hidden = torch.randn(args.tokens, args.hidden, device=dev, dtype=dt, requires_grad=True)
    weight = (torch.randn(args.vocab, args.hidden, device=dev) * args.hidden**-0.5).to(dt).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), device=dev)
    torchhal.ops.linear_cross_entropy(hidden, weight, target).backward()  # warm-up: compile, select
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    torchhal.ops.linear_cross_entropy(hidden, weight, target).backward()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    measured = torch.cuda.max_memory_allocated() - base
    peak, blocks = peak_blocks(snapshot["device_traces"][torch.cuda.current_device()])
    rows = [{"GiB": size / GIB, "where": place} for size, place in blocks]
    result = {"tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden,
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "max_memory_allocated_beyond_inputs_GiB": measured / GIB,
              "replayed_peak_GiB": peak / GIB, "alive_at_peak": rows}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"peak beyond inputs {measured / GIB:.3f} GiB (replayed trace: {peak / GIB:.3f} GiB); alive then:")
    for r in rows[:12]:
        print(f"  {r['GiB']:7.3f} GiB  {r['where']}")


if __name__ == "__main__":
    main()
