"""Split-KV decoding: how the slice count and the key tile set the split-KV kernel's speed, and
where its time goes (split pass vs combine pass), beside SDPA's cuDNN and flash kernels.

    python benchmarks/sweep_decode_splits.py --out sweep.json

For each decoding shape (bf16, 32 query heads over 8 kv heads, head dim 128, full attention), the
split-KV forward (`triton_attention_decode.forward`) under every (programs per compute unit,
key tile, stages) of the grid below, sized by `decode_splits` with DECODE_PROGRAMS_PER_UNIT set to
the sweep's value; GPU time from CUDA graphs. The rule's own choice and the fastest are then
profiled (torch.profiler, CUPTI kernel durations) to split their time between the two passes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from datetime import datetime, timezone

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.runtime.errors import OutOfResources

import torchhal
from torchhal.kernels import triton_attention_config as config
from torchhal.kernels import triton_attention_decode as decode
from torchhal.kernels.triton_attention_kernels import make_problem

HEADS_Q, HEADS_KV, DIM = 32, 8, 128
SHAPES = [  # (batch, query rows per head, cache length)
    (1, 1, 1024), (1, 1, 4096), (1, 1, 8192), (1, 1, 32768), (1, 1, 131072),
    (8, 1, 8192), (32, 1, 4096), (1, 8, 32768), (8, 16, 8192),
]  # fmt: skip
PROGRAMS_PER_UNIT = [1, 2, 4, 8]
BLOCK_N = [32, 64, 128]
STAGES = [2, 3, 4]


def gpu_us(fn) -> float:
    return statistics.median(triton.testing.do_bench_cudagraph(fn, rep=25) * 1e3 for _ in range(3))


def kernel_split_us(fn) -> dict[str, float]:
    """Mean CUPTI duration per call of each kernel `fn` launches, in µs."""
    calls = 20
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.count:
            times[event.key] = event.device_time_total / calls
    return times


def sized(caps, batch: int, seq_k: int, block_n: int, ppu: int) -> tuple[int, int]:
    saved = config.DECODE_PROGRAMS_PER_UNIT
    config.DECODE_PROGRAMS_PER_UNIT = ppu
    try:
        return config.decode_splits(caps, batch * HEADS_KV * seq_k, seq_k, block_n)
    finally:
        config.DECODE_PROGRAMS_PER_UNIT = saved


def shape_row(caps, batch: int, rows: int, cache: int) -> dict:
    q = torch.randn(batch, HEADS_Q, rows, DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, HEADS_KV, cache, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    problem = make_problem(q, k, seq_q=rows, seq_k=cache, batch=batch, causal=False, scale=None, window=None)
    tile_rows = decode.query_tile_rows(HEADS_Q, HEADS_KV, rows)
    rule_tile = config.decode_tile(caps, problem.head_dim_padded, 2, tile_rows)
    rule = (config.DECODE_PROGRAMS_PER_UNIT, rule_tile.block_n, rule_tile.num_stages)
    truth = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    results = []
    for ppu, block_n, stages in itertools.product(PROGRAMS_PER_UNIT, BLOCK_N, STAGES):
        tile = config.TileConfig(tile_rows, block_n, rule_tile.num_warps, stages)
        splits, per_split = sized(caps, batch, cache, block_n, ppu)

        def run(tile=tile, splits=splits, per_split=per_split):
            return decode.forward(q, k, v, problem, tile, splits, per_split)

        try:
            out = run()[0]
        except OutOfResources as error:  # a tile too large for shared memory: recorded, next
            results.append({"ppu": ppu, "block_n": block_n, "stages": stages, "error": repr(error)[:200]})
            continue
        err = (out.float() - truth.float()).abs().max().item()
        results.append(
            {"ppu": ppu, "block_n": block_n, "stages": stages, "splits": splits,
             "keys_per_split": per_split, "us": gpu_us(run), "max_err_vs_sdpa": err}
        )  # fmt: skip
    timed = [r for r in results if "us" in r]
    best = min(timed, key=lambda r: r["us"])
    chosen = next(r for r in timed if (r["ppu"], r["block_n"], r["stages"]) == rule)
    peers = {}
    for name, backend in (
        ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
        ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
    ):
        with sdpa_kernel(backend):
            peers[name] = gpu_us(
                lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            )
    breakdown = {}
    for label, r in (("rule", chosen), ("best", best)):
        tile = config.TileConfig(tile_rows, r["block_n"], rule_tile.num_warps, r["stages"])
        breakdown[label] = kernel_split_us(
            lambda tile=tile, r=r: decode.forward(q, k, v, problem, tile, r["splits"], r["keys_per_split"])
        )
    cache_bytes = 2 * k.numel() * k.element_size()
    return {
        "batch": batch, "query_rows": rows, "cache": cache, "rule": chosen, "best": best,
        "peers_us": peers, "kernels_us": breakdown, "cache_bytes": cache_bytes, "configs": results,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    hal = torchhal.HardwareAbstractionLayer()
    caps = hal.device_for_tensor(torch.empty(1, device="cuda")).capabilities
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    rows = []
    for batch, qrows, cache in SHAPES:
        rows.append(shape_row(caps, batch, qrows, cache))
        r = rows[-1]
        print(batch, qrows, cache, "rule", r["rule"].get("us"), "best", r["best"], r["peers_us"], flush=True)
        with open(args.out, "w") as f:  # after every shape: a run cut short keeps what it measured
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(
        f"{'batch x rows x cache':>22} {'rule us':>8} {'(ppu,bn,st)':>12} {'best us':>8} {'(ppu,bn,st)':>12}",
        f"{'cudnn':>7} {'flash':>7} {'rule split/comb':>16} {'best split/comb':>16}",
    )
    for r in rows:

        def parts(label, r=r):
            times = r["kernels_us"][label]
            split = sum(t for name, t in times.items() if "split" in name)
            comb = sum(t for name, t in times.items() if "combine" in name)
            return f"{split:.1f}/{comb:.1f}"

        rule, best = r["rule"], r["best"]
        print(
            f"{r['batch']}x{r['query_rows']}x{r['cache']:>7}".rjust(22),
            f"{rule['us']:8.1f} {(rule['ppu'], rule['block_n'], rule['stages'])!s:>12}",
            f"{best['us']:8.1f} {(best['ppu'], best['block_n'], best['stages'])!s:>12}",
            f"{r['peers_us']['sdpa_cudnn']:7.1f} {r['peers_us']['sdpa_flash']:7.1f}",
            f"{parts('rule'):>16} {parts('best'):>16}",
        )


if __name__ == "__main__":
    main()
