"""Where a decoding-sized `torchhal.ops.attention_varlen` call spends its host time: cProfile over
many calls of one shape (4 queries against 1k-key caches, bf16, GQA 32/8, head dim 128), after a
warm-up, with the GPU kept busy enough not to block the host. Prints the functions with the most
own time and the most cumulative time per call.

    python benchmarks/profile_varlen_host.py --calls 300
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--out", help="pstats file")
    args = p.parse_args()
    import torchhal

    lq, lk = [1] * 4, [1024] * 4
    q = torch.randn(sum(lq), 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lk), 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu_q = torch.tensor([0, *lq], device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0, *lk], device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def call() -> torch.Tensor:
        with torch.no_grad():
            return torchhal.ops.attention_varlen(q, k, v, cu_q, cu_k, 1, 1024, causal=True)

    for _ in range(20):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    print(f"wall per call: {(time.perf_counter() - t0) / args.calls * 1e6:.1f} us", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        call()
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile)
    if args.out:
        stats.dump_stats(args.out)
    for key in ("tottime", "cumulative"):
        print(f"--- by {key} (seconds over {args.calls} calls)")
        stats.sort_stats(key).print_stats(22)


if __name__ == "__main__":
    main()
