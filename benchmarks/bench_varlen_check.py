"""What `torchhal.ops.attention_varlen` costs per call, forward and forward+backward, at packed
shapes from decoding-sized to prefill-sized: run once with each build (a session's start and its
new one: session 24's queues the device check of cu_seqlens and max_seqlen, session 25's memoises
the op's validation off the CPU) in alternation, and compare the rows. Wall time per call over a
block of calls between synchronisations (so a launch-bound call shows its host cost), median of
blocks.

    PYTHONPATH=/tmp/site python benchmarks/bench_varlen_check.py --label new --out new.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

# (name, sequence lengths of q, of k): 4 decoding steps against 1k-token caches, a small prefill
# batch, and 16k tokens of prefill
SHAPES = {
    "decode 4x(1 vs 1024)": ([1] * 4, [1024] * 4),
    "prefill 8x128": ([128] * 8, [128] * 8),
    "prefill 16x1024": ([1024] * 16, [1024] * 16),
}
HEADS_Q, HEADS_KV, DIM = 32, 8, 128


def offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)


def per_call_us(run, calls: int, blocks: int, best: bool = False) -> float:
    """Median over blocks, or with `best` their minimum: a host-bound call on a shared host gains
    whatever else runs there, so the fastest block is the closer reading of the call's own cost."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return min(times) if best else statistics.median(times)


def measure(attention_varlen, lq: list[int], lk: list[int]) -> dict[str, float]:
    q = torch.randn(sum(lq), HEADS_Q, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lk), HEADS_KV, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    args = (q, k, v, offsets(lq), offsets(lk), max(lq), max(lk))

    def forward():
        with torch.no_grad():
            return attention_varlen(*args, causal=True)

    def training():
        attention_varlen(*args, causal=True).sum().backward()

    result = {
        "forward_us": per_call_us(forward, 50, 7),
        "forward_backward_us": per_call_us(training, 20, 7),
        "forward_best_us": per_call_us(forward, 50, 15, best=True),
    }
    try:  # the check alone, in the builds that have it: the first sight of the offsets, and again
        from torchhal.kernels.attention_varlen import check_offsets, queue_offsets_check
        from torchhal.kernels.triton_attention_kernels import offsets_ok
    except ImportError:
        return result
    cu_q, cu_k, max_q, max_k = args[3:]
    check_args = ("attention_varlen", q, k, cu_q, cu_k, max_q, max_k)

    def flag() -> torch.Tensor:
        return offsets_ok(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)

    return {
        **result,
        "check_queued_us": per_call_us(lambda: queue_offsets_check(*check_args, flag), 200, 7),
        "check_seen_us": per_call_us(lambda: check_offsets(*check_args, flag), 200, 7),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--label", required=True)
    p.add_argument("--out")
    p.add_argument("--pin", type=int, help="run on this CPU core only")
    args = p.parse_args()
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    import torchhal

    results = {name: measure(torchhal.ops.attention_varlen, lq, lk) for name, (lq, lk) in SHAPES.items()}
    record = {
        "label": args.label,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        **results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    for name, r in results.items():
        fwd, both, best = r["forward_us"], r["forward_backward_us"], r["forward_best_us"]
        queued, seen = r.get("check_queued_us", float("nan")), r.get("check_seen_us", float("nan"))
        print(
            f"{args.label:>5} {name:>22} fwd {fwd:7.1f} us (best {best:6.1f})  fwd+bwd {both:7.1f} us  "
            f"check queued {queued:5.1f} us, seen {seen:5.1f} us"
        )


if __name__ == "__main__":
    main()
