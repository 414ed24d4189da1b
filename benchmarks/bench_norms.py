"""torchhal's Triton rms_norm, layer_norm, swiglu, geglu and rope against their peers, bf16, on a GPU.

Usage: python benchmarks/bench_norms.py [--budget-s 110] [--ops rms_norm ...] [--shapes 16384x8192 ...]
    [--out FILE]   (default: $OUT/bench_norms.json if OUT is set)

For each op, the first shape is checked before anything is timed: every implementation's outputs
and gradients against the reference in fp64, torchhal's within FlashAttention's rule of the eager
PyTorch error (2x forward, 3x gradients, plus torchhal.testing.tolerance's floor). Then forward and
backward are timed with triton.testing.do_bench (median). do_bench flushes the L2 cache before
every timed call, so inputs small enough for L2 are read from memory like the large ones. Each
backward is also timed by its host time a call and its kernels' GPU time (torch.profiler): the
Python-side backwards (torchhal's, Liger's) take about as long to enqueue as the GPU takes to run
them at the large shapes, and do_bench's events then time the host; the table marks those rows
host-bound and gives the kernels' ratio beside the events' (docs/benchmarks.md, twenty-ninth session).
Forwards get both figures too, and the copy its kernel's time: "kernels" is the copy kernel's
time over torchhal's kernels' (the profiler's kernels run back to back without do_bench's L2
flush, so at the small shape, which fits in L2, both read from L2).

Peers, measured in the same run: eager PyTorch (F.rms_norm, F.layer_norm, silu/gelu * up, Hugging
Face's rotate-half rope), torch.compile of that eager code, Liger-Kernel's functional API, and a
plain device-to-device copy moving the same number of bytes. Forward and backward both run
through torch.autograd (no_grad for the forward, autograd.grad for the backward), torchhal's kernels
through torchhal.kernels.autograd as torchhal.ops runs them, so each gets the same overhead.
GB/s counts the bytes an op must move at least: each input read once, each output written once.
Targets: forward >= 85% of the copy's GB/s and >= 1.0x Liger; backward >= 1.0x Liger.
torch.compile peers are skipped, with a note, once the run passes its time budget; they are
compiled without donated buffers, since each backward is timed by replaying one retained graph.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch.nn.functional as F
from gpu_capabilities import device_capabilities
from sweep_common import host_ms, kernel_ms
from sweep_common import ms as timed

DEVICE = "cuda"
DTYPE = torch.bfloat16
SHAPES = [(4096, 2048), (32768, 4096), (8192, 16384)]  # (rows, hidden); rope: tokens, heads x HEAD_DIM
HEAD_DIM = 128
OPS = ("rms_norm", "layer_norm", "swiglu", "geglu", "rope")


def row_ops_registry() -> Any:
    from torchhal.hal_core import KernelRegistry
    from torchhal.kernels import layer_norm, rms_norm, rope, swiglu

    registry = KernelRegistry()
    for module in (rms_norm, layer_norm, swiglu, rope):
        module.register(registry)
    return registry


def torchhal_ops(registry: Any, caps: Any) -> dict[str, Callable[..., Any]]:
    """Each op's public function, as torchhal.ops makes it, running the Triton candidates bound to `caps`."""
    from torchhal.kernels import layer_norm, rms_norm, rope, swiglu
    from torchhal.kernels.autograd import DifferentiableOp

    bound: dict[str, Callable[..., Any]] = {}
    for op in registry.ops():
        triton = next(c for c in registry.candidates(op) if c.name == "triton")
        bound[op] = triton.bind(caps)

    def dispatch(op: str, *args: Any) -> Any:
        return bound[op](*args)

    specs = {
        "rms_norm": rms_norm.AUTOGRAD,
        "layer_norm": layer_norm.AUTOGRAD,
        "swiglu": swiglu.SWIGLU_AUTOGRAD,
        "geglu": swiglu.GEGLU_AUTOGRAD,
        "rope": rope.AUTOGRAD,
    }
    return {op: DifferentiableOp(spec, dispatch, namespace="torchhal_bench") for op, spec in specs.items()}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


EAGER: dict[str, Callable[..., Any]] = {
    "rms_norm": lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps),
    "layer_norm": lambda x, w, b, eps: F.layer_norm(x, (x.shape[-1],), w, b, eps),
    "swiglu": lambda g, u: F.silu(g) * u,
    "geglu": lambda g, u: F.gelu(g, approximate="tanh") * u,
    "rope": lambda q, k, cos, sin: (q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin),
}


def liger_ops() -> dict[str, Callable[..., Any]]:
    from liger_kernel.transformers import functional as lf

    return {
        "rms_norm": lambda x, w, eps: lf.liger_rms_norm(x, w, eps),
        "layer_norm": lambda x, w, b, eps: lf.liger_layer_norm(x, w, b, eps),
        "swiglu": lambda g, u: lf.liger_swiglu(g, u),
        "geglu": lambda g, u: lf.liger_geglu(g, u),
        # Liger takes the (batch, seq, dim) tables and rotates q and k in place
        "rope": lambda q, k, cos, sin: lf.liger_rope(q, k, cos.squeeze(1), sin.squeeze(1))[:2],
    }


@dataclass
class Case:
    op: str
    rows: int
    hidden: int
    args: tuple[Any, ...]
    grads: tuple[torch.Tensor, ...]
    wrt: tuple[int, ...]
    forward_bytes: int
    backward_bytes: int
    results: list[dict[str, Any]] = field(default_factory=list)


def make_case(op: str, rows: int, hidden: int) -> Case:
    dev = DEVICE
    e = torch.finfo(DTYPE).bits // 8
    n = rows * hidden * e
    if op in ("rms_norm", "layer_norm"):
        x = torch.randn(rows, hidden, device=dev, dtype=DTYPE)
        w = (1 + 0.2 * torch.randn(hidden, device=dev)).to(DTYPE)
        dy = (torch.randn_like(x),)
        if op == "rms_norm":  # bytes: x, y (dx, dy) and weight (and its gradient)
            return Case(
                op, rows, hidden, (x, w, 1e-6), dy, (0, 1), 2 * n + hidden * e, 3 * n + 2 * hidden * e
            )
        b = (0.2 * torch.randn(hidden, device=dev)).to(DTYPE)
        return Case(
            op, rows, hidden, (x, w, b, 1e-5), dy, (0, 1, 2), 2 * n + 2 * hidden * e, 3 * n + 3 * hidden * e
        )
    if op in ("swiglu", "geglu"):
        gate = 2 * torch.randn(rows, hidden, device=dev, dtype=DTYPE)
        up = torch.randn(rows, hidden, device=dev, dtype=DTYPE)
        return Case(op, rows, hidden, (gate, up), (torch.randn_like(gate),), (0, 1), 3 * n, 5 * n)
    seq = min(rows, 4096)
    batch, heads_q = rows // seq, hidden // HEAD_DIM
    heads_k = max(1, heads_q // 4)
    # projections (batch, seq, heads, dim) viewed as (batch, heads, seq, dim), as Hugging Face models do
    q = torch.randn(batch, seq, heads_q, HEAD_DIM, device=dev, dtype=DTYPE).transpose(1, 2)
    k = torch.randn(batch, seq, heads_k, HEAD_DIM, device=dev, dtype=DTYPE).transpose(1, 2)
    inv_freq = 1.0 / 500000 ** (torch.arange(0, HEAD_DIM, 2, device=dev) / HEAD_DIM)
    angles = torch.arange(seq, device=dev).unsqueeze(-1) * inv_freq
    emb = torch.cat((angles, angles), dim=-1).expand(batch, seq, HEAD_DIM).unsqueeze(1)
    cos, sin = emb.cos().to(DTYPE), emb.sin().to(DTYPE)
    qk = (q.numel() + k.numel()) * e
    tables = 2 * cos.numel() * e
    grads = (torch.randn(q.shape, device=dev, dtype=DTYPE), torch.randn(k.shape, device=dev, dtype=DTYPE))
    return Case(op, rows, hidden, (q, k, cos, sin), grads, (0, 1), 2 * qk + tables, 2 * qk + tables)


def _leaves(case: Case, dtype: torch.dtype | None = None) -> tuple[Any, ...]:
    """Fresh copies of the inputs (same strides), requiring grad where the op differentiates."""
    out = []
    for i, a in enumerate(case.args):
        if isinstance(a, torch.Tensor):
            a = a.detach().clone().to(dtype or a.dtype).requires_grad_(i in case.wrt)
        out.append(a)
    return tuple(out)


def _outputs(value: Any) -> tuple[torch.Tensor, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def check(case: Case, reference: Callable[..., Any], impls: dict[str, Callable[..., Any]]) -> dict[str, Any]:
    """Max errors of outputs and gradients against the fp64 reference; torchhal's verdict by the rule."""
    from torchhal.testing.tolerance import floor

    def run(fn: Callable[..., Any], dtype: torch.dtype | None) -> list[torch.Tensor]:
        leaves = _leaves(case, dtype)
        outs = _outputs(fn(*leaves))
        out_grads = [
            g.to(o.dtype, copy=True) for g, o in zip(case.grads, outs, strict=True)
        ]  # Liger: in place
        grads = torch.autograd.grad(outs, [leaves[i] for i in case.wrt], out_grads)
        return [t.detach().double() for t in (*outs, *grads)]

    truth = run(reference, torch.float64)
    errors: dict[str, Any] = {}
    for name, fn in impls.items():
        try:
            errors[name] = [float((t - r).abs().max()) for t, r in zip(run(fn, None), truth, strict=True)]
        except Exception as exc:  # a peer that cannot run this case is reported, not fatal
            errors[name] = f"{type(exc).__name__}: {exc}"
    ours, eager = errors.get("torchhal"), errors.get("eager")
    verdict = "not checked"
    if isinstance(ours, list) and isinstance(eager, list):
        n_out = len(ours) - len(case.wrt)
        bounds = [
            (2.0 if i < n_out else 3.0) * e + floor(t, DTYPE)
            for i, (e, t) in enumerate(zip(eager, truth, strict=True))
        ]
        verdict = (
            "ok" if all(o <= b for o, b in zip(ours, bounds, strict=True)) else f"FAILED (bounds {bounds})"
        )
    return {"max_abs_errors": errors, "torchhal_within_rule": verdict}


ALLOCATOR_CALLS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def allocator_calls() -> dict[str, int]:
    """The caching allocator's device allocations, frees and retries so far: a timed loop that
    makes any times the allocator too (a suspect for the backwards' slow processes)."""
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_CALLS}


def timed_with_allocator(fn: Callable[[], Any]) -> tuple[float, dict[str, int]]:
    before = allocator_calls()
    ms = timed(fn)
    return ms, {k: v - before[k] for k, v in allocator_calls().items()}


def record(case: Case, impl: str, direction: str, ms: float, nbytes: int, **extra: Any) -> None:
    """One timing of `case`: its time and the bandwidth that moving `nbytes` in it makes."""
    case.results.append({"impl": impl, "direction": direction, "ms": ms, "gbps": nbytes / ms / 1e6, **extra})


def measure(case: Case, name: str, fn: Callable[..., Any]) -> None:
    """Time `fn`'s forward and backward on fresh copies of the inputs; the backward also by its host
    time and its kernels' time."""
    leaves = _leaves(case)

    def forward_fn() -> Any:
        with torch.no_grad():
            return fn(*leaves)

    forward = timed_with_allocator(forward_fn)
    outs = _outputs(fn(*leaves))
    wrt = [leaves[i] for i in case.wrt]
    grads = tuple(g.clone() for g in case.grads)  # Liger's rms_norm backward overwrites its dy
    backward_fn = lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=True)  # noqa: E731
    backward = timed_with_allocator(backward_fn)
    # the Python-side backwards (torchhal's, Liger's) take about as long on the host as on the GPU
    # at the large shapes: where the host is slower, do_bench times the host (twenty-ninth session)
    for direction, (ms, allocator), nbytes, timed_fn in (
        ("forward", forward, case.forward_bytes, forward_fn),
        ("backward", backward, case.backward_bytes, backward_fn),
    ):
        extra = {"host_ms": host_ms(timed_fn), "kernel_ms": kernel_ms(timed_fn)}
        record(case, name, direction, ms, nbytes, allocator=allocator, **extra)
        if any(allocator.values()):
            print(
                f"{case.op} {case.rows}x{case.hidden} {direction} {name}: "
                f"allocator calls while timed {allocator}"
            )


def measure_copy(case: Case) -> None:
    """A device-to-device copy reading nbytes / 2 and writing nbytes / 2, for each direction's
    bytes: do_bench's time and the copy kernel's own."""
    for direction, nbytes in (("forward", case.forward_bytes), ("backward", case.backward_bytes)):
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=DEVICE)
        dst = torch.empty_like(src)
        copy = functools.partial(dst.copy_, src)
        record(case, "copy", direction, timed(copy), nbytes, kernel_ms=kernel_ms(copy))


HOST_BOUND = 0.9  # a call whose host time is this fraction of do_bench's or more: do_bench timed the host


def summarize(case: Case) -> list[dict[str, Any]]:
    rows = []
    for direction in ("forward", "backward"):
        by_impl = {r["impl"]: r for r in case.results if r["direction"] == direction}
        ours = by_impl.get("torchhal")
        if ours is None:
            continue
        row = {
            "op": case.op,
            "shape": f"{case.rows}x{case.hidden}",
            "direction": direction,
            "torchhal_gbps": ours["gbps"],
        }
        for peer, r in by_impl.items():
            if peer not in ("torchhal", "copy"):
                row[f"vs_{peer}"] = r["ms"] / ours["ms"]  # > 1: torchhal is faster
                if "kernel_ms" in r:
                    row[f"kernels_vs_{peer}"] = r["kernel_ms"] / ours["kernel_ms"]
        host_bound = [impl for impl, r in by_impl.items() if r.get("host_ms", 0.0) >= HOST_BOUND * r["ms"]]
        if host_bound:
            row["host_bound"] = host_bound
        if "copy" in by_impl:
            copy = by_impl["copy"]
            row["fraction_of_copy"] = ours["gbps"] / copy["gbps"]
            row["kernel_fraction_of_copy"] = copy["kernel_ms"] / ours["kernel_ms"]
        rows.append(row)
    return rows


def shape(text: str) -> tuple[int, int]:
    rows, sep, hidden = text.partition("x")
    if not sep or not rows.isdigit() or not hidden.isdigit() or int(rows) < 1 or int(hidden) < 1:
        raise argparse.ArgumentTypeError(
            f"a shape is ROWSxHIDDEN with both positive, e.g. 8192x16384; got {text!r}"
        )
    return int(rows), int(hidden)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=110.0, help="skip torch.compile peers after this")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="the ops to time (all)")
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=shape,
        default=SHAPES,
        help="ROWSxHIDDEN, checked at the first (default: %(default)s)",
    )
    parser.add_argument("--out", help="the JSON record's path (default: $OUT/bench_norms.json if OUT is set)")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_norms: needs a CUDA device; none is available", file=sys.stderr)
        return 2
    start = time.perf_counter()
    caps, caps_source = device_capabilities("bench_norms")
    registry = row_ops_registry()
    ours = torchhal_ops(registry, caps)
    peers: dict[str, dict[str, Callable[..., Any]]] = {"eager": EAGER}
    try:
        peers["liger"] = liger_ops()
    except Exception as exc:
        print(f"liger: unavailable: {type(exc).__name__}: {exc}")
    # the backward is timed by replaying one graph (retain_graph=True), which donated buffers forbid
    functorch_config.donated_buffer = False
    compiled = {op: torch.compile(fn, dynamic=False) for op, fn in EAGER.items()}
    print(f"device: {caps.name} ({caps.arch}, {caps.compute_units} units); capabilities: {caps_source}")

    cases, checks, notes = [], {}, []
    for op in options.ops:
        for index, (rows, hidden) in enumerate(options.shapes):
            case = make_case(op, rows, hidden)
            impls = {"torchhal": ours[op], **{name: table[op] for name, table in peers.items()}}
            over_budget = time.perf_counter() - start > options.budget_s
            if over_budget:
                notes.append(
                    f"{op} {rows}x{hidden}: torch.compile skipped, past the {options.budget_s:g} s budget"
                )
            else:
                impls["torch.compile"] = compiled[op]
            if index == 0:
                checks[op] = check(case, registry.op(op).reference, impls)
                print(f"{op}: torchhal within the rule: {checks[op]['torchhal_within_rule']}")
            for name, fn in impls.items():
                try:
                    measure(case, name, fn)
                except Exception:  # one failing peer must not end the run
                    print(f"{op} {rows}x{hidden} {name}: failed\n{traceback.format_exc(limit=3)}")
            measure_copy(case)
            case.args, case.grads = (), ()  # free the device memory before the next shape
            cases.append(case)

    summary = [row for case in cases for row in summarize(case)]
    record = {
        "benchmark": "bench_norms",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": caps.name,
        "arch": caps.arch,
        "capabilities_from": caps_source,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "dtype": str(DTYPE),
        "checks": checks,
        "notes": notes,
        "results": [{"op": c.op, "rows": c.rows, "hidden": c.hidden, **r} for c in cases for r in c.results],
        "summary": summary,
        "wall_s": time.perf_counter() - start,
    }
    out_dir = os.environ.get("OUT")
    out = options.out or (Path(out_dir, "bench_norms.json") if out_dir else None)
    if out:
        Path(out).write_text(json.dumps(record, indent=2))
    for note in notes:
        print(note)
    peers_cols = ["vs_eager", "vs_torch.compile", "vs_liger", "kernels_vs_liger"]
    header = f"\n{'op':<11}{'shape':>12} {'dir':<9}{'GB/s':>8}{'of copy':>9}{'kernels':>9}"
    print(header + "".join(f"{c:>18}" for c in peers_cols))
    for row in summary:
        cells = "".join(f"{row[c]:>17.2f}x" if c in row else f"{'-':>18}" for c in peers_cols)
        frac = "".join(
            f"{100 * row[c]:>8.0f}%" if c in row else f"{'-':>9}"
            for c in ("fraction_of_copy", "kernel_fraction_of_copy")
        )
        label = f"{row['op']:<11}{row['shape']:>12} {row['direction']:<9}"
        host_bound = f"  host-bound: {', '.join(row['host_bound'])}" if "host_bound" in row else ""
        print(f"{label}{row['torchhal_gbps']:>8.0f}{frac}{cells}{host_bound}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
