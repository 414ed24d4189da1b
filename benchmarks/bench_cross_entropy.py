"""torchhal's fused linear_cross_entropy against its peers on a GPU: time and peak memory, bf16.

Usage: python benchmarks/bench_cross_entropy.py [--tokens 8192] [--hidden 2048]
           [--vocabs 32000 128256 151936] [--out results.json] [--budget-s 150]
(also writes $OUT/bench_cross_entropy.json when OUT is set and --out is not given)

The LM head's loss: hidden (tokens, hidden) @ weight.T (vocab, hidden), then cross-entropy over
the vocabulary against int64 targets (10% of them ignore_index), reduction "mean", bf16 inputs.
Before anything is timed, at the first vocabulary, each implementation's loss and gradients of
hidden and weight are compared with fp64 (torch's own F.linear + F.cross_entropy in fp64);
torchhal's are held to FlashAttention's rule against eager PyTorch's error in bf16 (loss 2x,
gradients 3x, plus torchhal.testing.tolerance's floor).

Peers, measured in the same run: eager PyTorch (F.linear then F.cross_entropy: the full logits),
torch.compile of that eager code, and Liger-Kernel's LigerFusedLinearCrossEntropyLoss (reported
"absent" where liger_kernel is not installed). torchhal runs as torchhal.ops runs it: the autograd
glue over its Triton candidates bound to this device's capabilities (which set the chunk size).

Per implementation: forward + backward time (one call of loss.backward() with the gradients of
hidden and weight reset to None before each, triton.testing.do_bench median), forward-only time
(no_grad), and the peak memory of one forward + backward beyond the inputs
(torch.cuda.max_memory_allocated; the gradients themselves included, as every implementation
returns them). The closing table gives torchhal's times, its speed-up over each peer (> 1 =
torchhal faster) and each implementation's peak memory as a fraction of eager's.
"""

from __future__ import annotations

import argparse
import gc
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
import torch._functorch.config as functorch_config
import torch.nn.functional as F
from gpu_capabilities import device_capabilities

DEVICE = "cuda"
DTYPE = torch.bfloat16
IGNORED = 0.1  # fraction of targets set to ignore_index
GIB = 2**30


def eager(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight), target)


def torchhal_op(caps: Any) -> tuple[Callable[..., torch.Tensor], int]:
    """linear_cross_entropy as torchhal.ops makes it, on the Triton candidates bound to `caps`;
    and the chunk plan's minimum rows for this device."""
    from torchhal.hal_core import KernelRegistry
    from torchhal.kernels import linear_cross_entropy as lce
    from torchhal.kernels.autograd import DifferentiableOp

    registry = KernelRegistry()
    lce.register(registry)
    bound = {}
    for op in registry.ops():
        triton = next(c for c in registry.candidates(op) if c.name == "triton")
        bound[op] = triton.bind(caps)

    def dispatch(op: str, *args: Any) -> Any:
        return bound[op](*args)

    fused = DifferentiableOp(lce.AUTOGRAD, dispatch, namespace="torchhal_bench_ce")

    def fn(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        args = lce.public_arguments(hidden, weight, target, None, -100, 0.0, "mean")
        return fused(*args)  # type: ignore[no-any-return]

    return fn, lce.ChunkPlan.from_caps(caps).min_rows


def liger_op() -> Callable[..., torch.Tensor]:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="mean")
    return lambda hidden, weight, target: loss(weight, hidden, target)  # Liger takes the weight first


def make_inputs(tokens: int, hidden: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE)
    w = (torch.randn(vocab, hidden, device=DEVICE) * (2 / math.sqrt(hidden))).to(DTYPE)
    t = torch.randint(0, vocab, (tokens,), device=DEVICE)
    t[torch.rand(tokens, device=DEVICE) < IGNORED] = -100
    return h, w, t


def _leaves(h: torch.Tensor, w: torch.Tensor, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    return [x.detach().clone().to(dtype or x.dtype).requires_grad_(True) for x in (h, w)]


def check(
    impls: dict[str, Callable[..., torch.Tensor]], h: torch.Tensor, w: torch.Tensor, t: torch.Tensor
) -> dict[str, Any]:
    """Max abs errors of loss, d hidden, d weight against fp64; torchhal's verdict by the rule."""
    from torchhal.testing.tolerance import floor

    def run(fn: Callable[..., torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
        leaves = _leaves(h, w, dtype)
        loss = fn(*leaves, t)
        grads = torch.autograd.grad(loss, leaves)
        return [x.detach().double() for x in (loss, *grads)]

    truth = run(eager, torch.float64)
    errors: dict[str, Any] = {}
    for name, fn in impls.items():
        try:
            errors[name] = [float((x - y).abs().max()) for x, y in zip(run(fn, None), truth, strict=True)]
        except Exception as exc:  # a peer that cannot run is reported, not fatal
            errors[name] = f"{type(exc).__name__}: {exc}"
    ours, base = errors.get("torchhal"), errors.get("eager")
    verdict = "not checked"
    if isinstance(ours, list) and isinstance(base, list):
        bounds = [
            (2.0 if i == 0 else 3.0) * e + floor(x, DTYPE)
            for i, (e, x) in enumerate(zip(base, truth, strict=True))
        ]
        ok = all(o <= b for o, b in zip(ours, bounds, strict=True))
        verdict = "ok" if ok else f"FAILED (bounds {bounds})"
    return {"max_abs_errors [loss, d_hidden, d_weight]": errors, "torchhal_within_rule": verdict}


def timed(fn: Callable[[], Any], grad_to_none: list[torch.Tensor] | None = None) -> float:
    import triton.testing

    ms = triton.testing.do_bench(fn, warmup=50, rep=300, grad_to_none=grad_to_none, return_mode="median")
    return float(ms)


def peak_bytes(fn: Callable[..., torch.Tensor], h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> int:
    leaves = _leaves(h, w)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*leaves, t).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del leaves
    return int(peak)


def measure(
    name: str, fn: Callable[..., torch.Tensor], h: torch.Tensor, w: torch.Tensor, t: torch.Tensor
) -> dict[str, Any]:
    leaves = _leaves(h, w)
    fn(*leaves, t).backward()  # compile / autotune / first-launch costs, untimed
    with torch.no_grad():
        forward_ms = timed(lambda: fn(*leaves, t))
    step_ms = timed(lambda: fn(*leaves, t).backward(), grad_to_none=leaves)
    leaves.clear()
    peak = peak_bytes(fn, h, w, t)
    return {"impl": name, "forward_ms": forward_ms, "forward_backward_ms": step_ms, "peak_bytes": peak}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256, 151936])
    parser.add_argument("--out", type=Path, help="JSON results (default: $OUT/bench_cross_entropy.json)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="skip torch.compile peers after this")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_cross_entropy: needs a CUDA device; none is available", file=sys.stderr)
        return 2
    start = time.perf_counter()
    caps, caps_source = device_capabilities("bench_cross_entropy")
    ours, min_rows = torchhal_op(caps)
    impls: dict[str, Callable[..., torch.Tensor]] = {"torchhal": ours, "eager": eager}
    notes: list[str] = []
    try:
        impls["liger"] = liger_op()
    except Exception as exc:
        notes.append(f"liger: absent ({type(exc).__name__}: {exc})")
    functorch_config.donated_buffer = False
    compiled = torch.compile(eager, dynamic=False)
    print(f"device: {caps.name} ({caps.arch}, {caps.compute_units} units); capabilities: {caps_source}")
    print(f"torchhal chunk plan: at least {min_rows} rows per chunk")

    checks: dict[str, Any] = {}
    results: list[dict[str, Any]] = []
    for index, vocab in enumerate(options.vocabs):
        h, w, t = make_inputs(options.tokens, options.hidden, vocab)
        run = dict(impls)
        if time.perf_counter() - start > options.budget_s:
            notes.append(f"vocab {vocab}: torch.compile skipped, past the {options.budget_s:g} s budget")
        else:
            run["torch.compile"] = compiled
        if index == 0:
            checks[str(vocab)] = check(run, h, w, t)
            print(f"vocab {vocab}: torchhal within the rule: {checks[str(vocab)]['torchhal_within_rule']}")
        for name, fn in run.items():
            try:
                row = measure(name, fn, h, w, t)
            except torch.OutOfMemoryError:
                row = {"impl": name, "error": "out of memory"}
                print(f"vocab {vocab} {name}: out of memory")
            except Exception:  # one failing peer must not end the run
                row = {"impl": name, "error": traceback.format_exc(limit=3)}
                print(f"vocab {vocab} {name}: failed\n{row['error']}")
            results.append({"tokens": options.tokens, "hidden": options.hidden, "vocab": vocab, **row})
            gc.collect()
            torch.cuda.empty_cache()
        del h, w, t

    summary = []
    for vocab in options.vocabs:
        by_impl = {r["impl"]: r for r in results if r["vocab"] == vocab and "error" not in r}
        mine = by_impl.get("torchhal")
        if mine is None:
            continue
        row: dict[str, Any] = {
            "vocab": vocab,
            "torchhal_ms": mine["forward_backward_ms"],
            "torchhal_forward_ms": mine["forward_ms"],
        }
        for peer, r in by_impl.items():
            if peer != "torchhal":
                row[f"vs_{peer}"] = r["forward_backward_ms"] / mine["forward_backward_ms"]
        eager_peak = by_impl.get("eager", {}).get("peak_bytes")
        for name, r in by_impl.items():
            row[f"peak_gib_{name}"] = r["peak_bytes"] / GIB
            if eager_peak:
                row[f"peak_vs_eager_{name}"] = r["peak_bytes"] / eager_peak
        summary.append(row)

    record = {
        "benchmark": "bench_cross_entropy",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": caps.name,
        "arch": caps.arch,
        "capabilities_from": caps_source,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "liger_kernel": _version("liger_kernel"),
        "dtype": str(DTYPE),
        "tokens": options.tokens,
        "hidden": options.hidden,
        "ignored_fraction": IGNORED,
        "torchhal_min_chunk_rows": min_rows,
        "checks": checks,
        "notes": notes,
        "results": results,
        "summary": summary,
        "wall_s": time.perf_counter() - start,
    }
    out = options.out
    if out is None and os.environ.get("OUT"):
        out = Path(os.environ["OUT"], "bench_cross_entropy.json")
    if out is not None:
        out.write_text(json.dumps(record, indent=2))
    for note in notes:
        print(note)
    print_table(options, summary, liger_absent="liger" not in impls)
    return 0


def print_table(options: argparse.Namespace, summary: list[dict[str, Any]], liger_absent: bool) -> None:
    peers = ["eager", "torch.compile", "liger"]
    print(f"\n{options.tokens} tokens x hidden {options.hidden}, bf16, forward + backward")
    print("vs X: X's time / torchhal's (> 1: torchhal faster); peak: GiB beyond the inputs (of eager's)")
    header = f"{'vocab':>7}{'torchhal ms':>12}{'fwd ms':>8}" + "".join(f"{'vs ' + p:>17}" for p in peers)
    print(header + "".join(f"{'peak ' + p:>20}" for p in ["torchhal", *peers]))
    for row in summary:
        cells = f"{row['vocab']:>7}{row['torchhal_ms']:>12.2f}{row['torchhal_forward_ms']:>8.2f}"
        for p in peers:
            absent = "absent" if p == "liger" and liger_absent else "-"
            cells += f"{row['vs_' + p]:>16.2f}x" if f"vs_{p}" in row else f"{absent:>17}"
        for p in ["torchhal", *peers]:
            if f"peak_gib_{p}" in row:
                cells += f"{row['peak_gib_' + p]:>12.2f} ({row.get('peak_vs_eager_' + p, math.nan):5.2f})"
            else:
                cells += f"{'-':>20}"
        print(cells)


def _version(module: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(module.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
