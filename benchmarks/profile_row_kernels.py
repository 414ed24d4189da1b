"""One row kernel, torchhal's or Liger-Kernel's, launched a few times inside an NVTX range for Nsight Compute.

Why: at 8192x16384 bf16 some of torchhal's Triton row kernels trail Liger-Kernel (docs/benchmarks.md,
"Fourth session": swiglu forward/backward 0.95-0.96x Liger at 95-96% of the copy's bandwidth,
rms_norm backward 0.84x at 70%, layer_norm forward at 76%, level with Liger). Timings do not say
whether the gap is bytes moved, occupancy, registers, spills or stalls; ncu's counters do, provided
it profiles only the launches that matter and not the warm-up, the input set-up or the JIT. So this
script allocates the inputs as bench_norms does (its `make_case`), warms up (the Triton kernels
compile there), then calls the op --iters times inside the NVTX start/end range "profiled", which
`ncu --nvtx --nvtx-include "profiled"` selects (no trailing slash: a start/end range, which holds
launches from every thread, autograd's backward thread included; a push/pop range would not).

torchhal runs its kernel functions directly (torchhal.kernels.triton_gated / triton_norms with cuda:0's
RowLaunch), so its range holds its own launches alone: for the norm backwards, the Triton kernel,
then torch's sum of the per-program weight-gradient partials and the cast to the weight's dtype.
Liger runs its functional API as bench_norms and sweep_row_warps do: forwards under no_grad,
backwards through autograd.grad on a retained graph, so its range also holds whatever its
autograd.Function launches beside its kernel. Every launch in the range is profiled;
benchmarks/summarize_ncu.py labels them by kernel name. `copy` is the bandwidth reference: a
torch.neg reading and writing one tensor (a kernel: copy_ between like tensors is a cudaMemcpy,
which ncu does not profile).

Usage:
    python3 benchmarks/profile_row_kernels.py --case swiglu-bwd --impl torchhal \
        [--rows 8192] [--cols 16384] [--iters 1] [--warmup 3]
    python3 benchmarks/profile_row_kernels.py --list
    All cases under ncu: OUT=dir bash benchmarks/profile_row_kernels.sh
Exit status: 0 done, 2 bad arguments or no CUDA device, 3 the implementation cannot be imported
here (Liger-Kernel), said on stderr.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable
from typing import Any

import torch
from bench_norms import DTYPE, Case, _leaves, liger_ops, make_case
from gpu_capabilities import device_capabilities

RANGE = "profiled"  # the NVTX start/end range profile_row_kernels.sh hands ncu
# case -> (bench_norms op, direction); "copy" is the bandwidth reference, not an op
CASES: dict[str, tuple[str, str]] = {
    "swiglu-fwd": ("swiglu", "fwd"),
    "swiglu-bwd": ("swiglu", "bwd"),
    "geglu-fwd": ("geglu", "fwd"),
    "geglu-bwd": ("geglu", "bwd"),
    "rms-fwd": ("rms_norm", "fwd"),
    "rms-bwd": ("rms_norm", "bwd"),
    "ln-fwd": ("layer_norm", "fwd"),
    "ln-bwd": ("layer_norm", "bwd"),
    "copy": ("copy", "fwd"),
}
KERNEL_IMPLS = ("torchhal", "liger")
COPY_IMPLS = ("torch",)


def impls_for(case: str) -> tuple[str, ...]:
    """The implementations a case can run: the copy is torch's alone, every op torchhal's or Liger's."""
    return COPY_IMPLS if case == "copy" else KERNEL_IMPLS


class ImplMissing(Exception):
    """The implementation asked for is not installed here; the case is skipped, not failed."""


def torchhal_call(op: str, direction: str, case: Case) -> Callable[[], Any]:
    """torchhal's kernel function for (op, direction), bound to the inputs and cuda:0's RowLaunch."""
    from torchhal.kernels import triton_gated, triton_norms
    from torchhal.kernels.triton_rows import RowLaunch

    launch = RowLaunch.from_caps(device_capabilities("profile_row_kernels")[0])
    dy = case.grads[0]
    if op in ("swiglu", "geglu"):
        gate, up = case.args
        if direction == "fwd":
            return lambda: triton_gated.gated_forward(launch, op, gate, up)
        return lambda: triton_gated.gated_backward(launch, op, dy, gate, up)
    if op == "rms_norm":
        x, w, eps = case.args
        if direction == "fwd":
            return lambda: triton_norms.rms_norm_forward(launch, x, w, eps)
        return lambda: triton_norms.rms_norm_backward(launch, dy, x, w, eps)
    x, w, b, eps = case.args
    if direction == "fwd":
        return lambda: triton_norms.layer_norm_forward(launch, x, w, b, eps)
    _, mean, rstd = triton_norms.layer_norm_forward_with_stats(launch, x, w, b, eps)
    return lambda: triton_norms.layer_norm_backward(launch, dy, x, w, mean, rstd)


def liger_call(op: str, direction: str, case: Case) -> Callable[[], Any]:
    """Liger's functional op: the forward under no_grad, or the backward of one retained forward graph."""
    try:
        fn = liger_ops()[op]
    except ImportError as exc:
        raise ImplMissing(f"Liger-Kernel cannot be imported ({exc})") from exc
    if direction == "fwd":

        def forward() -> Any:
            with torch.no_grad():
                return fn(*case.args)

        return forward
    leaves = _leaves(case)
    out = fn(*leaves)
    wrt = [leaves[i] for i in case.wrt]
    dy = case.grads[0].clone()  # Liger's backwards may overwrite their output gradient: not the shared one
    return lambda: torch.autograd.grad(out, wrt, dy, retain_graph=True)


def copy_call(rows: int, cols: int) -> tuple[Callable[[], Any], int]:
    """(a kernel reading and writing one rows x cols tensor, its bytes): what a streaming kernel reaches."""
    x = torch.randn(rows, cols, device="cuda", dtype=DTYPE)
    y = torch.empty_like(x)
    return (lambda: torch.neg(x, out=y)), 2 * x.numel() * x.element_size()


def build(name: str, impl: str, rows: int, cols: int) -> tuple[Callable[[], Any], int]:
    """(one call of the case, the bytes it must move at least: each input read once, each output written)."""
    op, direction = CASES[name]
    if op == "copy":
        return copy_call(rows, cols)
    case = make_case(op, rows, cols)
    least = case.forward_bytes if direction == "fwd" else case.backward_bytes
    if impl == "torchhal":
        return torchhal_call(op, direction, case), least
    return liger_call(op, direction, case), least


def versions(impl: str) -> str:
    """torch's and triton's versions, and Liger's when it runs, for the log beside ncu's counters."""
    names = ["torch", "triton"] + (["liger-kernel"] if impl == "liger" else [])
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} (no package metadata)")
    return ", ".join(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Launch one row kernel --iters times inside the NVTX range 'profiled' (for ncu)."
    )
    parser.add_argument("--case", choices=sorted(CASES))
    parser.add_argument("--impl", choices=(*KERNEL_IMPLS, *COPY_IMPLS), default="torchhal")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=1, help="calls inside the profiled range")
    parser.add_argument("--warmup", type=int, default=3, help="calls before it (JIT, allocator)")
    parser.add_argument("--list", action="store_true", help="print the cases and their impls, then exit")
    args = parser.parse_args(argv)
    if args.list:
        for name in CASES:
            print(f"{name:12s} {' '.join(impls_for(name))}")
        return 0
    if args.case is None:
        parser.error("--case is required (or --list)")
    if args.impl not in impls_for(args.case):
        parser.error(f"--case {args.case} runs with --impl {' or '.join(impls_for(args.case))}")
    if args.rows < 1 or args.cols < 1 or args.iters < 1 or args.warmup < 0:
        parser.error("--rows, --cols and --iters must be positive, --warmup not negative")
    if not torch.cuda.is_available():
        print("profile_row_kernels: no CUDA device", file=sys.stderr)
        return 2

    try:
        call, least = build(args.case, args.impl, args.rows, args.cols)
    except ImplMissing as exc:
        print(f"profile_row_kernels: {exc}: case {args.case} --impl {args.impl} skipped", file=sys.stderr)
        return 3
    for _ in range(args.warmup):
        call()
    torch.cuda.synchronize()
    # a start/end range, not push/pop: push/pop ranges belong to one thread, and autograd runs a
    # CUDA backward (Liger's) on its own device thread
    handle = torch.cuda.nvtx.range_start(RANGE)
    for _ in range(args.iters):
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_end(handle)
    print(
        f"{args.case} {args.impl} {args.rows}x{args.cols} {str(DTYPE).removeprefix('torch.')} on "
        f"{torch.cuda.get_device_name(0)} ({versions(args.impl)}): {args.iters} call(s) in NVTX range "
        f"'{RANGE}' after {args.warmup} warm-up calls; at least {least / 1e9:.3f} GB moved per call"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
