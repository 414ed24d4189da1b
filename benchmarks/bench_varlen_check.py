"""What `torchhal.ops.attention_varlen` costs per call, forward and forward+backward, at packed
shapes from decoding-sized to prefill-sized: run once with each build (the session's start and
the new one, which queues the device check of cu_seqlens and max_seqlen) in alternation, and
compare the rows. Wall time per call over a block of calls between synchronisations (so a
launch-bound call shows its host cost), median of blocks.

    PYTHONPATH=/tmp/site python benchmarks/bench_varlen_check.py --label new --out new.json
"""

from __future__ import annotations

import argparse
import json
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


def per_call_us(run, calls: int, blocks: int) -> float:
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
    return statistics.median(times)


def measure(attention_varlen, lq: list[int], lk: list[int]) -> dict[str, float]:
    q = torch.randn(sum(lq), HEADS_Q, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lk), HEADS_KV, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    args = (q, k, v, offsets(lq), offsets(lk), max(lq), max(lk), True)

    def forward():
        with torch.no_grad():
            return attention_varlen(*args)

    def training():
        attention_varlen(*args).sum().backward()

    return {"forward_us": per_call_us(forward, 50, 7), "forward_backward_us": per_call_us(training, 20, 7)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--label", required=True)
    p.add_argument("--out")
    args = p.parse_args()
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
        fwd, both = r["forward_us"], r["forward_backward_us"]
        print(f"{args.label:>5} {name:>22} fwd {fwd:9.1f} us  fwd+bwd {both:9.1f} us")


if __name__ == "__main__":
    main()
