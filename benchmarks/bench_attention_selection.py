"""`torchhal.ops.attention` with measured selection against every candidate it could have chosen.

Usage: python benchmarks/bench_attention_selection.py [--modes forward training]
       [--seqlens 512 ... 16384] [--head-dims 64 128] [--selection-timing eager|graph] [--out FILE]

FlashAttention's sweep (bf16, batch x seqlen = 16k tokens, hidden 2048, head dim 64 and 128, causal
and full). A HAL with measured selection on (its winners cached in a fresh temporary directory, so
nothing from an earlier run is recalled) picks candidates on the first call of each shape.
- forward: `torchhal.ops.attention` with no gradient needed (the `attention` op) against each valid
  `attention` candidate called directly (bound to the device as selection binds it);
- training: one forward and backward through `torchhal.ops.attention` (torch.autograd.grad of q, k
  and v) against each backend's `attention_forward` then `attention_backward` called directly, no
  autograd (the kernels alone), against the fastest forward plus the fastest backward called
  directly (the best pairing), and against `scaled_dot_product_attention` with autograd pinned to
  each SDPA backend (what a PyTorch user gets).
Timed with triton.testing.do_bench (median of its repetitions) in `--rounds` interleaved rounds,
the order rotating. A variant's time is the median of its rounds; a peer's ratio is the median over
rounds of peer / ops.attention in the same round (paired, so drifts the rounds share cancel). The
fastest peer is the one with the lowest median time. Target: ops.attention >= 0.97x the fastest
candidate on every shape, in both modes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import torchhal
from torchhal.hal_core.settings import Settings

TOKENS, HIDDEN = 16 * 1024, 2048
TARGET = 0.97
BEST_PAIRING = "best pairing (fastest fwd + fastest bwd, alone)"


def round_times(variants: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Each variant's time (ms) in each round."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for i in range(rounds):  # the order rotates, so no variant always runs right after the slowest
        for name in names[i % len(names) :] + names[: i % len(names)]:
            times[name].append(
                triton.testing.do_bench(variants[name], warmup=10, rep=60, return_mode="median")
            )
    return times


def paired_ratios(times: dict[str, list[float]], names: list[str]) -> dict[str, float]:
    """Each name's median over rounds of its time / ops.attention's time in the same round."""
    ops = times["ops.attention"]
    return {n: statistics.median(a / b for a, b in zip(times[n], ops, strict=True)) for n in names}


def _verdict(times: dict[str, list[float]], peers: list[str]) -> dict:
    """Median times, the fastest peer, and each peer's paired ratio to ops.attention."""
    ms = {name: statistics.median(t) for name, t in times.items()}
    paired = paired_ratios(times, peers)
    fastest = min(peers, key=ms.__getitem__)
    return {
        "ms": ms,
        "round_ms": times,
        "paired_ratio": paired,
        "fastest": fastest,
        "ratio_vs_fastest": paired[fastest],
    }


def _bind(fn: Callable[..., object], args: tuple) -> Callable[[], object]:
    return lambda: fn(*args)


def _contenders(hal: torchhal.HardwareAbstractionLayer, op: str, device, args: tuple) -> tuple:
    """The selection for `args` and its candidates other than the reference, fastest first."""
    selection = hal.kernels.select(op, device, *args)
    return selection, [c for c in (selection.candidate, *selection.fallbacks) if c.name != "reference"]


def _qkv(seqlen: int, dim: int, grad: bool) -> tuple[torch.Tensor, ...]:
    batch, heads = TOKENS // seqlen, HIDDEN // dim
    shape = (batch, heads, seqlen, dim)
    return tuple(
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3)
    )


def forward_row(
    hal: torchhal.HardwareAbstractionLayer, seqlen: int, dim: int, causal: bool, rounds: int
) -> dict:
    q, k, v = _qkv(seqlen, dim, grad=False)
    args = (q, k, v, causal, None, None)
    device = hal.device_for_tensor(q)
    torchhal.ops.attention(q, k, v, causal=causal)  # the first call selects (and measures)
    selection, contenders = _contenders(hal, "attention", device, args)
    variants: dict[str, Callable[[], object]] = {
        "ops.attention": lambda: torchhal.ops.attention(q, k, v, causal=causal)
    }
    for cand in contenders:
        fn = hal.kernels.bound(cand, device)
        variants[cand.qualified_name] = _bind(fn, args)
    verdict = _verdict(round_times(variants, rounds), [n for n in variants if n != "ops.attention"])
    return {
        "mode": "forward",
        "seqlen": seqlen,
        "head_dim": dim,
        "causal": causal,
        "selected": selection.candidate.qualified_name,
        "measured_at_selection_ms": dict(selection.timings_ms),
        **verdict,
        "ratio_vs_selected_direct": verdict["paired_ratio"][selection.candidate.qualified_name],
    }


def training_row(
    hal: torchhal.HardwareAbstractionLayer, seqlen: int, dim: int, causal: bool, rounds: int
) -> dict:
    q, k, v = _qkv(seqlen, dim, grad=True)
    dout = torch.randn_like(q)
    args = (q.detach(), k.detach(), v.detach(), causal, None, None)
    device = hal.device_for_tensor(q)

    def ops_step() -> object:
        return torch.autograd.grad(torchhal.ops.attention(q, k, v, causal=causal), (q, k, v), dout)

    ops_step()  # the first step selects (and measures) the forward and the backward
    out, lse = hal.kernels.call("attention_forward", device, *args)
    backward_args = (dout, *args[:3], out, lse, *args[3:])
    fwd_selection, forwards = _contenders(hal, "attention_forward", device, args)
    bwd_selection, backwards = _contenders(hal, "attention_backward", device, backward_args)
    fwd_fns = {c.qualified_name: hal.kernels.bound(c, device) for c in forwards}
    bwd_fns = {c.qualified_name: hal.kernels.bound(c, device) for c in backwards}
    variants: dict[str, Callable[[], object]] = {"ops.attention": ops_step}
    for name in sorted(fwd_fns.keys() & bwd_fns.keys()):  # each backend's own pair, the kernels alone
        f, b = fwd_fns[name], bwd_fns[name]
        variants[f"pair {name}"] = lambda f=f, b=b: b(dout, *args[:3], *f(*args), *args[3:])
    for kind, fns, call_args in (("fwd", fwd_fns, args), ("bwd", bwd_fns, backward_args)):
        for name, fn in fns.items():
            variants[f"alone {kind} {name}"] = _bind(fn, call_args)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):

        def sdpa_step(backend: SDPBackend = backend) -> object:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return torch.autograd.grad(out, (q, k, v), dout)

        variants[f"sdpa autograd {backend.name.lower()}"] = sdpa_step
    times = round_times(variants, rounds)
    alone = {
        kind: [t for name, t in times.items() if name.startswith(f"alone {kind} ")] for kind in ("fwd", "bwd")
    }
    # the best pairing, round by round: that round's fastest forward plus its fastest backward
    times[BEST_PAIRING] = [
        min(t[i] for t in alone["fwd"]) + min(t[i] for t in alone["bwd"]) for i in range(rounds)
    ]
    peers = [n for n in times if n.startswith(("pair ", "sdpa autograd ")) or n == BEST_PAIRING]
    return {
        "mode": "training",
        "seqlen": seqlen,
        "head_dim": dim,
        "causal": causal,
        "selected": {
            "forward": fwd_selection.candidate.qualified_name,
            "backward": bwd_selection.candidate.qualified_name,
        },
        "measured_at_selection_ms": {
            "forward": dict(fwd_selection.timings_ms),
            "backward": dict(bwd_selection.timings_ms),
        },
        **_verdict(times, peers),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--modes", nargs="+", choices=("forward", "training"), default=["forward", "training"]
    )
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--out")
    parser.add_argument(
        "--selection-timing",
        choices=("eager", "graph"),
        default="eager",
        help="how measured selection times the candidates (TORCHHAL_SELECTION_TIMING)",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    row_of = {"forward": forward_row, "training": training_row}
    with tempfile.TemporaryDirectory() as cache:
        settings = Settings(autotune="on", cache_dir=Path(cache), selection_timing=args.selection_timing)
        hal = torchhal.HardwareAbstractionLayer(settings=settings)
        torchhal.ops.set_default_hal(hal)
        caps = hal.device_for_tensor(torch.empty(0, device="cuda")).capabilities
        rows = []
        for mode in args.modes:
            for dim in args.head_dims:
                for causal in (False, True):
                    for seqlen in args.seqlens:
                        r = row_of[mode](hal, seqlen, dim, causal, args.rounds)
                        rows.append(r)
                        print(
                            f"{mode} d{dim} {'causal' if causal else 'full'} s{seqlen} selected "
                            f"{r['selected']} fastest {r['fastest']} ops {r['ms']['ops.attention']:.3f} ms "
                            f"ratio {r['ratio_vs_fastest']:.3f}",
                            flush=True,
                        )
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": caps.model_dump(mode="json"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "selection_timing": args.selection_timing,
        "rows": rows,
        "min_ratio": {m: min(r["ratio_vs_fastest"] for r in rows if r["mode"] == m) for m in args.modes},
        "target": TARGET,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    for mode in args.modes:
        mine = [r for r in rows if r["mode"] == mode]
        below = ", ".join(
            f"d{r['head_dim']}{'c' if r['causal'] else 'f'}s{r['seqlen']}={r['ratio_vs_fastest']:.3f}"
            for r in mine
            if r["ratio_vs_fastest"] < TARGET
        )
        print(
            f"{mode}: ops.attention / fastest: min {result['min_ratio'][mode]:.3f} over {len(mine)} "
            f"shapes (target >= {TARGET}); below target: {below or 'none'}"
        )


if __name__ == "__main__":
    main()
