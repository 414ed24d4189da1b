"""Host time of one backward at a small shape (4096x2048 bf16), where bench_norms finds torchhal's
backwards slower than Liger's although the kernels move 16 MB a tensor in a few µs: is the time
the host's, and where does it go?

For swiglu and rms_norm it times `torch.autograd.grad` of one retained graph, torchhal's against
Liger's and eager PyTorch's: the host's time a call (many calls, one synchronize at the end) and
the latency of one call from an idle GPU (CUDA events around it after a synchronize; the GPU waits
for the host's enqueue, so this is host time plus whatever of the kernels it does not overlap).
Then the host time of the pieces of torchhal's swiglu and rms_norm backwards, each alone
(`pieces`), and cProfile of torchhal's backward calls, the top functions by own time.

    python3 benchmarks/profile_small_backward.py [--calls 2000] [--out $OUT/profile_small_backward.txt]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from sweep_common import host_ms

import torchhal

ROWS, HIDDEN = 4096, 2048


def graphs() -> dict[str, dict[str, Callable[[], Any]]]:
    """Per op and implementation, a call that runs the backward of one retained forward graph."""
    import liger_kernel.transformers.functional as lf

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().requires_grad_()

    x = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    up = torch.randn_like(x)
    w = (1 + 0.2 * torch.randn(HIDDEN, device="cuda")).to(torch.bfloat16)
    dy = torch.randn_like(x)
    forwards: dict[str, dict[str, Callable[..., torch.Tensor]]] = {
        "swiglu": {
            "torchhal": torchhal.ops.swiglu,
            "liger": lf.liger_swiglu,
            "eager": lambda g, u: F.silu(g) * u,
        },
        "rms_norm": {
            "torchhal": lambda a, b: torchhal.ops.rms_norm(a, b, 1e-6),
            "liger": lambda a, b: lf.liger_rms_norm(a, b, 1e-6),
            "eager": lambda a, b: F.rms_norm(a, (HIDDEN,), b, 1e-6),
        },
    }
    calls: dict[str, dict[str, Callable[[], Any]]] = {}
    for op, impls in forwards.items():
        second = up if op == "swiglu" else w
        calls[op] = {}
        for name, forward in impls.items():
            inputs = (leaf(x), leaf(second))
            out = forward(*inputs)
            grad = dy.clone()  # Liger's backwards may overwrite their output gradient
            calls[op][name] = lambda out=out, inputs=inputs, grad=grad: torch.autograd.grad(
                out, inputs, grad, retain_graph=True
            )
    return calls


def pieces() -> dict[str, dict[str, Callable[[], Any]]]:
    """Each layer of torchhal's backward alone: the autograd engine with a backward that does
    nothing, the HAL's dispatch of the backward op, the bound Triton candidate, its output
    allocations, and its kernel launch into preallocated outputs; Liger's backward called alone."""
    import liger_kernel.ops.rms_norm as liger_rms
    import liger_kernel.ops.swiglu as liger_swiglu

    from torchhal.kernels import triton_gated, triton_norms
    from torchhal.kernels.triton_rows import ELEMENTWISE_TILE, RowLaunch, next_power_of_2

    hal = torchhal.ops.default_hal()
    x = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    up, dy = torch.randn_like(x), torch.randn_like(x)
    w = (1 + 0.2 * torch.randn(HIDDEN, device="cuda")).to(torch.bfloat16)
    device = hal.device_for_tensor(x)
    launch = RowLaunch.from_caps(device.capabilities)
    a, b = (t.detach().clone().requires_grad_() for t in (x, up))
    grads = (torch.empty_like(x), torch.empty_like(x))

    class Nothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.empty_like(a)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return grads

    nothing = Nothing.apply(a, b)
    table: dict[str, dict[str, Callable[[], Any]]] = {
        "autograd engine, empty backward": {
            "both": lambda: torch.autograd.grad(nothing, (a, b), dy, retain_graph=True)
        }
    }
    swiglu_bound = hal.kernels.bound(
        hal.kernels.select("swiglu_backward", device, dy, x, up).candidate, device
    )
    rms_bound = hal.kernels.bound(
        hal.kernels.select("rms_norm_backward", device, dy, x, w, 1e-6).candidate, device
    )
    grid, block, warps = triton_gated._grid(launch, x, ELEMENTWISE_TILE)
    dgate, dup = torch.empty_like(x), torch.empty_like(x)
    rms_block = next_power_of_2(HIDDEN)
    rms_warps = launch.norm_warps(rms_block, 2)
    programs = launch.backward_programs(ROWS, rms_warps)
    dx, partial = torch.empty_like(x), torch.empty((programs, HIDDEN), dtype=torch.float32, device="cuda")
    rstd = torch.rand(ROWS, device="cuda") + 0.5
    table["HAL dispatch of the backward op"] = {
        "swiglu": lambda: hal.dispatch("swiglu_backward", dy, x, up),
        "rms_norm": lambda: hal.dispatch("rms_norm_backward", dy, x, w, 1e-6),
    }
    table["bound Triton candidate"] = {
        "swiglu": lambda: swiglu_bound(dy, x, up),
        "rms_norm": lambda: rms_bound(dy, x, w, 1e-6),
    }
    table["its output allocations"] = {
        "swiglu": lambda: (torch.empty(x.shape, dtype=x.dtype, device=x.device),
                           torch.empty(x.shape, dtype=x.dtype, device=x.device)),
        "rms_norm": lambda: (torch.empty(x.shape, dtype=x.dtype, device=x.device),
                             torch.empty((programs, HIDDEN), dtype=torch.float32, device=x.device)),
    }  # fmt: skip
    table["its kernel launch alone"] = {
        "swiglu": lambda: triton_gated._gated_bwd[grid](
            dy, x, up, dgate, dup, HIDDEN, HIDDEN, HIDDEN, HIDDEN,
            ACT=triton_gated.SILU, BLOCK=block, num_warps=warps,
        ),
        "rms_norm": lambda: triton_norms._rms_norm_bwd[(programs,)](
            dy, x, w, dx, partial, HIDDEN, HIDDEN, ROWS, HIDDEN, 1e-6,
            BLOCK=rms_block, RELOAD_ROW=launch.reload_row(rms_block, rms_warps), num_warps=rms_warps,
        ),
    }  # fmt: skip
    table["the weight-gradient sum and cast"] = {"rms_norm": lambda: partial.sum(0).to(w.dtype)}
    a2, b2, dy2 = x.clone(), up.clone(), dy.clone()  # Liger writes its gradients into these
    rms_block_liger, rms_warps_liger = liger_swiglu.calculate_settings(HIDDEN)
    table["Liger's backward alone"] = {
        "swiglu": lambda: liger_swiglu.swiglu_backward(a2, b2, dy2),
        "rms_norm": lambda: liger_rms.rms_norm_backward(
            dy2, x, w, rstd, 0.0, liger_rms._CASTING_MODE_LLAMA.value, rms_block_liger,
            rms_warps_liger, False, False,
        ),
    }  # fmt: skip
    return table


def host_us(fn: Callable[[], Any], calls: int) -> float:
    return host_ms(fn, calls) * 1e3


def idle_latency_us(fn: Callable[[], Any], calls: int) -> float:
    """Median of event-timed single calls, each after a synchronize (so from an idle GPU)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    calls = graphs()
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {ROWS}x{HIDDEN} bf16"]
    lines.append(f"{'op':9s} {'impl':9s} {'host us/call':>13s} {'idle-GPU latency us':>20s}")
    for op, impls in calls.items():
        for name, fn in impls.items():
            for _ in range(20):
                fn()
            host, idle = host_us(fn, args.calls), idle_latency_us(fn, args.calls // 10)
            lines.append(f"{op:9s} {name:9s} {host:13.1f} {idle:20.1f}")
    lines.append(f"\nPieces, host us/call ({args.calls} calls each):")
    for piece, impls in pieces().items():
        for op, fn in impls.items():
            for _ in range(20):
                fn()
            lines.append(f"{piece:34s} {op:9s} {host_us(fn, args.calls):8.1f}")
    for op, impls in calls.items():
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            impls["torchhal"]()
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(22)
        lines.append(f"\ncProfile of torchhal's {op} backward, {args.calls} calls, by own time:")
        lines.append(text.getvalue())
    report = "\n".join(lines)
    if args.out is not None:
        args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
