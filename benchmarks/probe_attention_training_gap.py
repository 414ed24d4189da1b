"""Where a training step through `torchhal.ops.attention` loses up to 3% against the same cuDNN
kernels called directly, at some shapes (bench_attention_selection.py --modes training).

Per shape (bf16, batch x seqlen = 16k tokens, hidden 2048, full attention), three steps that run
cuDNN's forward and backward: `torchhal.ops.attention` under autograd (measured selection on, in a
fresh cache), the NVIDIA plugin's two candidates called directly (no autograd), and SDPA pinned to
cuDNN under autograd. For each: the GPU kernels of five steps (torch.profiler, per step), and the
steps timed as bench_attention_selection times them (`round_times`: `--rounds` rotating rounds of
do_bench medians; `paired_ratios`: each peer's median over rounds of peer / ops).

    python3 benchmarks/probe_attention_training_gap.py [--shapes 64:2048 128:2048 128:4096]
        [--rounds 21] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_attention_selection import paired_ratios, round_times
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from torchhal_nvidia.sdpa import sdpa_cudnn_backward, sdpa_cudnn_forward

import torchhal
from torchhal.hal_core.settings import Settings

TOKENS, HIDDEN, PROFILED_STEPS = 16 * 1024, 2048, 5


def steps(dim: int, seqlen: int) -> tuple[dict[str, Callable[[], object]], tuple[torch.Tensor, ...]]:
    """The three steps, and their (q, k, v, dout) without autograd."""
    shape = (TOKENS // seqlen, HIDDEN // dim, seqlen, dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    qd, kd, vd = q.detach(), k.detach(), v.detach()

    def ops() -> object:
        return torch.autograd.grad(torchhal.ops.attention(q, k, v), (q, k, v), dout)

    def direct() -> object:
        out, lse = sdpa_cudnn_forward(qd, kd, vd)
        return sdpa_cudnn_backward(dout, qd, kd, vd, out, lse)

    def sdpa() -> object:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(q, k, v)
        return torch.autograd.grad(out, (q, k, v), dout)

    return {"ops.attention": ops, "direct cudnn pair": direct, "sdpa autograd cudnn": sdpa}, (
        qd,
        kd,
        vd,
        dout,
    )


def kernels(step: Callable[[], object]) -> dict[str, float]:
    """µs of GPU time a step, by kernel name."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        torch.cuda.synchronize()
    totals: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:90]] += event.device_time / PROFILED_STEPS
    return dict(totals.most_common())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["64:2048", "128:2048", "128:4096"])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        hal = torchhal.HardwareAbstractionLayer(settings=Settings(autotune="on", cache_dir=Path(cache)))
        torchhal.ops.set_default_hal(hal)
        for spec in args.shapes:
            dim, seqlen = (int(x) for x in spec.split(":"))
            variants, (q, k, v, dout) = steps(dim, seqlen)
            variants["ops.attention"]()  # selects and measures
            device = hal.device_for_tensor(q)
            fwd_args = (q, k, v, False, None, None)
            out, lse = hal.kernels.call("attention_forward", device, *fwd_args)
            selected = {
                "forward": hal.kernels.select(
                    "attention_forward", device, *fwd_args
                ).candidate.qualified_name,
                "backward": hal.kernels.select(
                    "attention_backward", device, dout, q, k, v, out, lse, False, None, None
                ).candidate.qualified_name,
            }
            profiles = {name: kernels(step) for name, step in variants.items()}
            times = round_times(variants, args.rounds)
            rows.append(
                {
                    "head_dim": dim,
                    "seqlen": seqlen,
                    "selected": selected,
                    "kernels_us": profiles,
                    "gpu_us": {name: sum(p.values()) for name, p in profiles.items()},
                    "round_ms": times,
                    "median_ms": {name: statistics.median(t) for name, t in times.items()},
                    "paired_ratio": paired_ratios(times, list(times)),
                }
            )
    if args.out:
        Path(args.out).write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=2))
    for r in rows:
        print(f"d{r['head_dim']} s{r['seqlen']} selected {r['selected']}")
        for name, profile_us in r["kernels_us"].items():
            print(f"  {name}: " + "; ".join(f"{k[:60]} {v:.1f}" for k, v in profile_us.items()))
    print(f"{'shape':<12} {'variant':<22} {'step ms':>8} {'peer/ops':>9} {'GPU µs':>9}")
    for r in rows:
        for name in r["median_ms"]:
            print(
                f"d{r['head_dim']} s{r['seqlen']:<7} {name:<22} {r['median_ms'][name]:8.3f} "
                f"{r['paired_ratio'][name]:9.3f} {r['gpu_us'][name]:9.1f}"
            )


if __name__ == "__main__":
    main()
