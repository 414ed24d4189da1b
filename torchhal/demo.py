"""`torchhal demo`: discovery, capabilities, device choice, kernel selection, A/B comparisons with
statistics (torchhal.evaluation) and a 2-process training run (torchhal.distributed; from a source
checkout, which has the example it trains), on whatever is here.

Uses only the HAL's public interfaces, so the same walk-through runs on a GPU host, a
CPU-only laptop or a simulated ASIC. Names and reasons from plugins are printed as text, not rich
markup: a reason naming "[/opt/rocm/lib]" crashed the demo with a MarkupError.
"""

from __future__ import annotations

import statistics

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from torchhal.hal_core import Device, DeviceRequirements, DType, NoDeviceMatchesError
from torchhal.hal_core.hal import HardwareAbstractionLayer

CALLS = 5  # timed per op and device: a single call on a busy host varied 7x between runs


def _demo_dtype(dev: Device) -> torch.dtype:
    return torch.bfloat16 if dev.capabilities.supports_dtype(DType.BF16) else torch.float32


def run(console: Console) -> None:
    hal = HardwareAbstractionLayer()
    console.rule("1. Discovery")
    for d in hal.diagnostics:
        console.print(f"  {d.name:<16} {d.status.value:<8} {d.reason}", markup=False)

    console.rule("2. Capabilities")
    for dev in hal.devices():
        caps = dev.capabilities
        kind = "simulated" if caps.simulated else "real"
        console.print(
            f"  [bold]{dev.id}[/] {escape(caps.name)} ({kind}): {escape(caps.arch)}, "
            f"{caps.compute_units} units × "
            f"simd {caps.simd_width}, {caps.memory_text}, "
            f"dtypes {','.join(sorted(d.value for d in caps.dtypes))}, "
            f"features {','.join(sorted(f.value for f in caps.features)) or '-'}, "
            f"collectives {','.join(caps.collective_backends)}"
        )

    console.rule("3. Best device for bf16 training")
    try:
        choice = hal.choose_device(DeviceRequirements(dtypes=frozenset({DType.BF16})))
        for line in choice.explain().splitlines():
            console.print(f"  {line}", markup=False)
    except NoDeviceMatchesError as exc:
        console.print(f"  {exc}", markup=False)

    console.rule("4. Kernel selection and a few calls per device")
    table = Table()
    timing = escape(f"time (ms): median of {CALLS} [min, max]")  # a header is markup
    for col in ("device", "op", "dtype", "chosen", "rejected", timing):
        table.add_column(col)
    for dev in hal.devices():
        dtype = _demo_dtype(dev)
        x = dev.to_device(torch.randn(512, 1024, dtype=dtype))
        w = dev.to_device(torch.randn(1024, dtype=dtype))
        q = dev.to_device(torch.randn(1, 8, 256, 64, dtype=dtype))
        kv = dev.to_device(torch.randn(1, 2, 256, 64, dtype=dtype))
        calls = {
            "rms_norm": ((x, w), {}),
            "attention": ((q, kv, kv), {"causal": True}),
        }
        for op, (args, kwargs) in calls.items():
            sel = hal.kernels.select(op, dev, *args, **kwargs)
            timer = dev.timer()
            times = []
            with hal.use(dev):
                hal.kernels.call(op, dev, *args, **kwargs)  # warm-up
                for _ in range(CALLS):
                    start = timer.mark()
                    hal.kernels.call(op, dev, *args, **kwargs)
                    times.append(timer.elapsed_ms(start, timer.mark()))
            rejected = "; ".join(f"{r.candidate}: {r.reason.value}" for r in sel.rejected) or "-"
            suffix = " (simulated)" if dev.simulated else ""
            cells = (dev.id, op, str(dtype).removeprefix("torch."), sel.candidate.qualified_name, rejected)
            spread = f"{statistics.median(times):.3f} [{min(times):.3f}, {max(times):.3f}]{suffix}"
            table.add_row(*(Text(cell) for cell in cells), spread)
    console.print(table)

    from torchhal.evaluation.demo import demo_section  # section 5: A/B with statistics

    demo_section(console, hal)
    from torchhal.distributed.demo import demo_section as training_section  # section 6

    training_section(console, hal)
