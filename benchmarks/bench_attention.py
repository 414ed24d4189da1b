"""Attention forward and backward TFLOP/s: torchhal's Triton FlashAttention against SDPA's backends.

Usage: python benchmarks/bench_attention.py [--seqlens 512 ... 16384] [--head-dims 64 128]
           [--compile-at 4096] [--compile-dims 128]
(writes $OUT/bench_attention.json if OUT is set)

FlashAttention's setup: bf16, batch x seqlen = 16k tokens, hidden 2048 (heads = 2048 / head dim),
seqlen 512 to 16k, head dim 64 and 128, causal and full. Before anything is timed, each
(head dim, causal) is checked at seqlen 1024 and unequal lengths 1000 x 1537: torchhal's forward
and gradients against fp64 under FlashAttention's rule (error at most 2x, gradients 3x, that of
PyTorch computing in bf16, plus torchhal.testing.tolerance's floor).

Peers, measured in the same run: SDPA pinned to its flash, cuDNN and memory-efficient backends,
eager PyTorch math (q k^T, masked softmax in fp32, p v), skipped with a note where its score
matrices would not fit in free memory, and torch.compile of that eager math (compiled per
shape, so only at the --compile-at seqlens and --compile-dims head dims, to keep the run near
2 minutes). Forward: one call without autograd. Backward: torchhal's backward kernels called
directly with the forward's saved (out, lse); peers through torch.autograd.grad of a retained
graph. Times are triton.testing.do_bench medians; do_bench clears the L2 cache before each call,
and the inputs (3 x 64 MiB) exceed L2 anyway. The backward's tiles come from
benchmarks/sweep_attention_backward.py.
FLOPs: forward 4 * batch * heads * seqlen^2 * head_dim (halved when causal), backward 2.5x that.
Targets: Triton forward >= 1.2x SDPA flash at seqlen >= 4k, backward >= 1.0x.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from gpu_capabilities import device_capabilities

DEVICE = "cuda"
DTYPE = torch.bfloat16
TOKENS = 16 * 1024
HIDDEN = 2048
SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
PEERS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "eager", "compiled")


def flops(batch: int, heads: int, seqlen: int, dim: int, causal: bool) -> float:
    return 4.0 * batch * heads * seqlen * seqlen * dim * (0.5 if causal else 1.0)


def eager_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Reference-style attention: bf16 matmuls, softmax in fp32, square causal mask."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


def eager_bytes(batch: int, heads: int, seqlen: int, backward: bool) -> int:
    """Score-sized tensors eager math keeps alive: bf16 scores, fp32 softmax, bf16 probabilities,
    and in the backward their gradients as well."""
    per_element = 2 + 4 + 2 + (8 if backward else 0)
    return batch * heads * seqlen * seqlen * per_element


def sdpa_with(backend: Any) -> Callable[..., torch.Tensor]:
    from torch.nn.attention import sdpa_kernel

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def peers() -> dict[str, Callable[..., torch.Tensor]]:
    from torch.nn.attention import SDPBackend

    return {
        "sdpa_flash": sdpa_with(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION),
        "sdpa_efficient": sdpa_with(SDPBackend.EFFICIENT_ATTENTION),
        "eager": eager_math,
    }


def timed(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def inputs(batch: int, heads: int, seq_q: int, seq_k: int, dim: int) -> tuple[torch.Tensor, ...]:
    q = torch.randn(batch, heads, seq_q, dim, device=DEVICE, dtype=DTYPE)
    k = torch.randn(batch, heads, seq_k, dim, device=DEVICE, dtype=DTYPE)
    v = torch.randn(batch, heads, seq_k, dim, device=DEVICE, dtype=DTYPE)
    return q, k, v


def check(caps: Any, dim: int, causal: bool) -> dict[str, Any]:
    """Triton forward and gradients against fp64 under FlashAttention's rule (bf16 PyTorch baseline)."""
    from torchhal.kernels import triton_attention
    from torchhal.testing import tolerance

    forward, backward = triton_attention.bind_forward(caps), triton_attention.bind_backward(caps)
    results: dict[str, Any] = {}
    for seq_q, seq_k in ((1024, 1024), (1000, 1537)):
        q, k, v = inputs(2, HIDDEN // dim, seq_q, seq_k, dim)
        grad = torch.randn_like(q)
        out, lse = forward(q, k, v, causal)
        got = (out, *backward(grad, q, k, v, out, lse, causal))
        same = math_with_grads((q, k, v), grad, causal, DTYPE)
        truth = math_with_grads((q, k, v), grad, causal, torch.float64)
        verdicts = {}
        for name, g, s, t, factor in zip(
            ("out", "dq", "dk", "dv"), got, same, truth, (2, 3, 3, 3), strict=True
        ):
            error = (g.double() - t).abs().max().item()
            bound = factor * (s.double() - t).abs().max().item() + tolerance.floor(t, DTYPE)
            verdicts[name] = {"error": error, "bound": bound, "ok": error <= bound}
        results[f"{seq_q}x{seq_k}"] = verdicts
    return results


def math_with_grads(
    qkv: tuple[torch.Tensor, ...], grad: torch.Tensor, causal: bool, dtype: torch.dtype
) -> list[torch.Tensor]:
    leaves = [t.to(dtype).requires_grad_(True) for t in qkv]
    out = bottom_right_math(*leaves, causal)
    return [out, *torch.autograd.grad(out, leaves, grad.to(dtype))]


def bottom_right_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """PyTorch math in the inputs' precision with the op's bottom-right causal mask."""
    from torchhal.kernels.attention import allowed_keys

    scores = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-1, -2))
    mask = allowed_keys(q.shape[2], k.shape[2], causal, None, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def measure_case(
    caps: Any, seqlen: int, dim: int, causal: bool, compile_at: set[int], notes: list[str]
) -> dict[str, Any]:
    from torchhal.kernels import triton_attention

    batch, heads = TOKENS // seqlen, HIDDEN // dim
    q, k, v = inputs(batch, heads, seqlen, seqlen, dim)
    grad = torch.randn_like(q)
    fwd_flops = flops(batch, heads, seqlen, dim, causal)
    row: dict[str, Any] = {
        "seqlen": seqlen,
        "head_dim": dim,
        "causal": causal,
        "batch": batch,
        "heads": heads,
    }

    def record(name: str, fwd: Callable[[], Any] | None, bwd: Callable[[], Any] | None) -> None:
        for kind, fn, work in (("fwd", fwd, fwd_flops), ("bwd", bwd, 2.5 * fwd_flops)):
            if fn is None:
                continue
            try:
                ms = timed(fn)
                row[f"{name}_{kind}_ms"] = ms
                row[f"{name}_{kind}_tflops"] = work / ms / 1e9
            except Exception as exc:  # one failing peer must not end the run
                row[f"{name}_{kind}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                print(f"  {name} {kind} failed at seqlen {seqlen} d {dim}: {row[f'{name}_{kind}_error']}")
            torch.cuda.empty_cache()

    forward, backward = triton_attention.bind_forward(caps), triton_attention.bind_backward(caps)
    saved = forward(q, k, v, causal)
    record("triton", lambda: forward(q, k, v, causal), lambda: backward(grad, q, k, v, *saved, causal))
    saved = ()

    free = torch.cuda.mem_get_info()[0]
    functions = peers()
    for name in PEERS:
        if name == "compiled":
            if seqlen not in compile_at:
                continue
            functions["compiled"] = torch.compile(eager_math, dynamic=False)
        if name in ("eager", "compiled") and eager_bytes(batch, heads, seqlen, True) > 0.7 * free:
            need = eager_bytes(batch, heads, seqlen, True) / 2**30
            notes.append(
                f"{name} skipped at seqlen {seqlen} d {dim}: needs ~{need:.0f} GiB, {free / 2**30:.0f} free"
            )
            continue
        fn = functions[name]
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        try:
            with torch.no_grad():
                fn(q, k, v, causal)
            peer_out = fn(*leaves, causal)
        except Exception as exc:
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            print(f"  {name} unavailable at seqlen {seqlen} d {dim}: {row[f'{name}_error']}")
            continue

        def run_forward(fn: Callable[..., Any] = fn) -> Any:
            with torch.no_grad():
                return fn(q, k, v, causal)

        def run_backward(out: torch.Tensor = peer_out, leaves: list[torch.Tensor] = leaves) -> Any:
            return torch.autograd.grad(out, leaves, grad, retain_graph=True)

        record(name, run_forward, run_backward)
        del peer_out, leaves
        torch.cuda.empty_cache()
    for kind in ("fwd", "bwd"):
        base, ours = row.get(f"sdpa_flash_{kind}_ms"), row.get(f"triton_{kind}_ms")
        if base and ours:
            row[f"triton_vs_flash_{kind}"] = base / ours
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=SEQLENS)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--compile-at", type=int, nargs="*", default=[4096], help="seqlens for torch.compile")
    parser.add_argument(
        "--compile-dims", type=int, nargs="*", default=[128], help="head dims for torch.compile"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    caps, caps_source = device_capabilities("bench_attention")
    from torchhal.kernels.triton_attention_config import launch_configs

    started = time.perf_counter()
    notes: list[str] = []
    checks, rows = {}, []
    for dim in args.head_dims:
        print(f"d={dim}: {launch_configs(caps, max(16, triton.next_power_of_2(dim)), 2)}")
        for causal in (False, True):
            key = f"d{dim}_{'causal' if causal else 'full'}"
            try:
                checks[key] = check(caps, dim, causal)
            except Exception:
                checks[key] = {"error": traceback.format_exc(limit=3)}
            print(f"check {key}: {json.dumps(checks[key])}")
    for dim in args.head_dims:
        for causal in (False, True):
            for seqlen in args.seqlens:
                compile_at = set(args.compile_at) if dim in args.compile_dims else set()
                rows.append(measure_case(caps, seqlen, dim, causal, compile_at, notes))

    providers = ("triton", *PEERS)
    print(f"\ndevice {torch.cuda.get_device_name(0)} ({caps_source})")
    print(f"torch {torch.__version__}, triton {triton.__version__}")
    print(f"bf16, {TOKENS} tokens per batch, hidden {HIDDEN}; TFLOP/s (median), ratio = Triton / SDPA flash")
    for note in notes:
        print(f"note: {note}")
    for kind in ("fwd", "bwd"):
        header = (
            f"{kind:<4}{'d':>4}{'causal':>7}{'seqlen':>7}"
            + "".join(f"{p:>15}" for p in providers)
            + f"{'ratio':>8}"
        )
        print("\n" + header)
        for row in rows:
            cells = "".join(
                f"{row[f'{p}_{kind}_tflops']:>15.1f}" if f"{p}_{kind}_tflops" in row else f"{'-':>15}"
                for p in providers
            )
            ratio = row.get(f"triton_vs_flash_{kind}")
            print(
                f"{'':<4}{row['head_dim']:>4}{row['causal']!s:>7}{row['seqlen']:>7}{cells}"
                + (f"{ratio:>8.2f}" if ratio else f"{'-':>8}")
            )
    record = {
        "benchmark": "bench_attention",
        "date": datetime.now(timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name(0),
        "capabilities_source": caps_source,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": "bf16",
        "tokens": TOKENS,
        "hidden": HIDDEN,
        "checks": checks,
        "rows": rows,
        "notes": notes,
        "seconds": time.perf_counter() - started,
    }
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "bench_attention.json").write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
