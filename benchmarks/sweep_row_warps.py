"""Warps per program of the norm, gated and rope kernels at large rows, against Liger-Kernel, bf16, on a GPU.

The row kernels take their warps from `RowLaunch` (forward, backward and RoPE rules set from
this sweep's first run). This times torchhal's rms_norm and layer_norm kernels, forward and
backward, with the warps forced to 4, 8, 16 and 32 beside RowLaunch's own rule and Liger's
functional ops (rope too, whose tile is heads x half the head dim, and the swiglu and geglu
kernels, whose tile is `RowLaunch.elementwise`'s), in one run (do_bench
medians, L2 flushed), so the launch rules rest on measurements.

    python3 benchmarks/sweep_row_warps.py [--cases "layer_norm fwd" ...] [--out sweep.json]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from gpu_capabilities import device_capabilities
from sweep_common import ms, save

from torchhal.kernels import layer_norm, triton_gated, triton_norms, triton_rope
from torchhal.kernels.triton_rows import RowLaunch

SHAPES = [(32768, 4096), (8192, 16384), (16384, 8192)]
WARPS = (4, 8, 16, 32)


@dataclass(frozen=True)
class ForcedWarps(RowLaunch):
    """RowLaunch with its warps fixed (programs per unit still follow from them)."""

    forced: int = 0

    def warps(self, block: int, element_bytes: int, *_: int, **__: int) -> int:
        return self.forced


def cases(rows: int, hidden: int) -> dict[str, tuple[Callable[..., Any], Callable[[], Any]]]:
    """(torchhal kernel call for a launch, Liger's call) per op and direction. The norm and gated
    calls take their kernels module as an optional second argument (ab_row_backward.py passes
    another version of it)."""
    import liger_kernel.transformers.functional as lf

    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.2 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    b = (0.2 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    dy = torch.randn_like(x)
    up = torch.randn_like(x)
    xl = x.clone().requires_grad_()
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
    rms_out = lf.liger_rms_norm(xl, wl, 1e-6)
    ln_out = lf.liger_layer_norm(xl, wl, bl, 1e-5)
    seq, head_dim = min(rows, 4096), 128  # rope as bench_norms lays it out: tokens x (heads x 128)
    batch, heads_q = rows // seq, hidden // head_dim
    heads_k = max(1, heads_q // 4)
    q = torch.randn(batch, seq, heads_q, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(batch, seq, heads_k, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    angles = (
        torch.arange(seq, device="cuda").unsqueeze(-1) * 1e-3 * torch.arange(head_dim // 2, device="cuda")
    )
    emb = torch.cat((angles, angles), -1).expand(batch, seq, head_dim).unsqueeze(1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    dq, dk = (
        torch.randn(q.shape, device="cuda", dtype=q.dtype),
        torch.randn(k.shape, device="cuda", dtype=k.dtype),
    )
    ql, kl = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    rope_out = lf.liger_rope(ql * 1, kl * 1, cos.squeeze(1), sin.squeeze(1))[:2]
    _, *ln_stats = layer_norm.reference_forward(x, w, b, 1e-5)  # the backward's saved mean and rstd
    # Liger's backwards may overwrite their output gradients: cloned once, as bench_norms does
    dql, dkl, dyl = dq.clone(), dk.clone(), dy.clone()
    gated: dict[str, tuple[Callable[..., Any], Callable[[], Any]]] = {}
    for op, liger in (("swiglu", lf.liger_swiglu), ("geglu", lf.liger_geglu)):
        gl, ul = x.clone().requires_grad_(), up.clone().requires_grad_()
        out = liger(gl, ul)
        gated[f"{op} fwd"] = (
            lambda launch, m=triton_gated, op=op: m.gated_forward(launch, op, x, up),
            lambda liger=liger: liger(x, up),
        )
        gated[f"{op} bwd"] = (
            lambda launch, m=triton_gated, op=op: m.gated_backward(launch, op, dy, x, up),
            lambda out=out, gl=gl, ul=ul: torch.autograd.grad(out, (gl, ul), dyl, retain_graph=True),
        )
    return {
        **gated,
        "rope fwd": (
            lambda launch: triton_rope.rope(launch, q, k, cos, sin),
            lambda: lf.liger_rope(q, k, cos.squeeze(1), sin.squeeze(1)),
        ),
        "rope bwd": (
            lambda launch: triton_rope.rope_backward(launch, dq, dk, cos, sin),
            lambda: torch.autograd.grad(rope_out, (ql, kl), (dql, dkl), retain_graph=True),
        ),
        "rms_norm fwd": (
            lambda launch, m=triton_norms: m.rms_norm_forward(launch, x, w, 1e-6),
            lambda: lf.liger_rms_norm(x, w, 1e-6),
        ),
        "rms_norm bwd": (
            lambda launch, m=triton_norms: m.rms_norm_backward(launch, dy, x, w, 1e-6),
            lambda: torch.autograd.grad(rms_out, (xl, wl), dyl, retain_graph=True),
        ),
        "layer_norm fwd": (
            lambda launch, m=triton_norms: m.layer_norm_forward(launch, x, w, b, 1e-5),
            lambda: lf.liger_layer_norm(x, w, b, 1e-5),
        ),
        "layer_norm bwd": (
            lambda launch, m=triton_norms: m.layer_norm_backward(launch, dy, x, w, *ln_stats),
            lambda: torch.autograd.grad(ln_out, (xl, wl, bl), dyl, retain_graph=True),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", help="only these cases, e.g. 'layer_norm fwd'")
    parser.add_argument("--out")
    args = parser.parse_args()
    caps, _ = device_capabilities("sweep_row_warps")
    base = RowLaunch.from_caps(caps)
    rows_out: list[dict[str, Any]] = []
    for rows, hidden in SHAPES:
        shape_cases = cases(rows, hidden)
        unknown = set(args.cases or ()) - set(shape_cases)
        if unknown:
            raise SystemExit(f"sweep_row_warps: no cases {sorted(unknown)}; known: {sorted(shape_cases)}")
        for name, (ours, liger) in shape_cases.items():
            if args.cases and name not in args.cases:
                continue
            liger_ms = ms(liger)
            row: dict[str, Any] = {
                "case": name,
                "shape": f"{rows}x{hidden}",
                "liger_ms": liger_ms,
                "default_ms": ms(lambda ours=ours: ours(base)),
            }
            for warps in WARPS:
                launch = ForcedWarps(**vars(base), forced=warps)
                row[f"w{warps}_ms"] = ms(lambda ours=ours, launch=launch: ours(launch))
            rows_out.append(row)
        torch.cuda.empty_cache()
    save(args.out, rows_out)
    print("time / Liger's time, by warps per program (dflt: RowLaunch's own rule)")
    print(f"{'case':16s} {'shape':11s}    dflt " + " ".join(f"{'w' + str(w):>7s}" for w in WARPS))
    for r in rows_out:
        times = " ".join(f"{r[f'w{w}_ms'] / r['liger_ms']:7.3f}" for w in WARPS)
        print(f"{r['case']:16s} {r['shape']:11s} {r['default_ms'] / r['liger_ms']:7.3f} {times}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
