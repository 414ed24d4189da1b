"""What the launch-configuration sweeps and kernel A/Bs share: one timing rule, one result record,
and loading another version of a kernels file beside the installed one."""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch
import triton.testing


def load_module(path: str) -> Any:
    """The Python file at `path` as a module of its own (e.g. an older triton_norms.py)."""
    spec = importlib.util.spec_from_file_location(f"triton_norms_{abs(hash(path))}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ms(fn: Callable[[], Any], rep: int = 60) -> float:
    """do_bench's median in ms (L2 flushed between calls)."""
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def host_ms(fn: Callable[[], Any], calls: int = 30) -> float:
    """The host's time to enqueue one call of `fn`: calls back to back, one synchronize after. Where
    it reaches do_bench's time, do_bench times the host (its events wait on the enqueue)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e3


def kernel_ms(fn: Callable[[], Any], calls: int = 30) -> float:
    """The GPU's kernel time of one call of `fn` (torch.profiler: the kernels' own durations, no gaps
    between them), whatever the host's pace."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) for e in kernels)
    return total_us / calls / 1e3


def save(out: str | None, rows: list[dict[str, Any]], **extra: Any) -> None:
    """Write the sweep's rows with date, device and torch version to `out` (nothing when None)."""
    if not out:
        return
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        **extra,
        "rows": rows,
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
