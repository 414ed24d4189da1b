"""The `torchhal` command: info, profile, conformance, demo, ab."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
import typer.core
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from torchhal.hal_core.errors import TorchHALError
from torchhal.hal_core.hal import HardwareAbstractionLayer

EXIT_BAD_INPUT = 2  # as `torchhal ab` and click's usage errors


class _Commands(typer.core.TyperGroup):
    """A TorchHALError (an unknown device or adapter, a malformed TORCHHAL_* setting) is the
    user's to fix: its message, which names the thing, the constraint and the value, on one
    error line and exit code 2. Any other exception is a bug and keeps its traceback."""

    def invoke(self, ctx: Any) -> Any:  # a click Context; recent typer vendors click privately
        try:
            return super().invoke(ctx)
        except TorchHALError as exc:
            Console(stderr=True).print("[red]error:[/] " + escape(str(exc)), soft_wrap=True)
            raise typer.Exit(EXIT_BAD_INPUT) from exc


app = typer.Typer(
    cls=_Commands, help="torchhal: one PyTorch code path across NVIDIA, AMD, Intel, ASICs and the CPU."
)
console = Console(width=None if Console().is_terminal else 140)  # pipes and CI logs get wide tables


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


@app.command()
def info(
    as_json: Annotated[bool, typer.Option("--json", help="Print the full report as JSON.")] = False,
) -> None:
    """Adapters, devices, capabilities, topology and plugin diagnostics."""
    hal = HardwareAbstractionLayer()
    report = hal.report()
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    console.print(f"[bold]torchhal {report['torchhal_version']}[/] on torch {report['torch_version']}")
    console.print(f"dispatch guards: {report['kernel_guards']}")  # python where torchhal-speedups is missing
    devices = Table(title="Devices")
    for col in ("id", "name", "arch", "units", "simd", "memory", "dtypes", "collectives", "notes"):
        devices.add_column(col)
    for dev in hal.devices():
        caps = dev.capabilities
        notes = "simulated" if caps.simulated else ""
        if caps.declared_peaks and caps.declared_peaks.tflops:
            dtype, peak = max(caps.declared_peaks.tflops.items(), key=lambda kv: kv[1])
            notes = (notes + " " if notes else "") + f"declared peak {dtype.value} {peak:g} {dtype.rate_unit}"
        devices.add_row(
            dev.id,
            caps.name,
            caps.arch,
            str(caps.compute_units),
            str(caps.simd_width),
            _gib(caps.memory_bytes),
            ",".join(sorted(d.value for d in caps.dtypes)),
            ",".join(caps.collective_backends),
            notes,
        )
    console.print(devices)
    links = hal.topology().links
    if links:
        topo = Table(title="Topology")
        for col in ("a", "b", "type", "count", "GB/s (declared)", "source"):
            topo.add_column(col)
        for lk in links:
            bandwidth = f"{lk.bandwidth_gbps:g}" if lk.bandwidth_gbps else "-"
            topo.add_row(lk.a, lk.b, lk.type.value, str(lk.count or "-"), bandwidth, lk.source)
        console.print(topo)
    diags = Table(title="Plugins and adapters")
    for col in ("name", "status", "stage", "reason"):
        diags.add_column(col)
    for d in hal.diagnostics:
        diags.add_row(d.name, d.status.value, d.stage, d.reason)
    console.print(diags)


@app.command()
def profile(
    device: Annotated[str | None, typer.Argument(help="Device id; default: the best device.")] = None,
    refresh: Annotated[bool, typer.Option(help="Measure again instead of reading the cache.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the profile as JSON.")] = False,
) -> None:
    """Measure matmul TFLOP/s per dtype, copy bandwidth and launch latency (cached on disk)."""
    hal = HardwareAbstractionLayer()
    dev = hal.best_device() if device is None else hal.device(device)  # "" is no device, not the best
    prof = hal.profile(dev, refresh=refresh)
    if as_json:
        typer.echo(prof.model_dump_json(indent=2))
        return
    kind = "simulated time" if prof.simulated else "measured"
    table = Table(title=f"{dev.id}: {prof.device_name} ({kind}, fingerprint {prof.fingerprint})")
    for col in ("measure", "through torchhal", "plain torch, same run"):
        table.add_column(col)
    direct = prof.direct_matmul_tflops or {}
    for dtype, tflops in prof.matmul_tflops.items():
        peer = f"{direct[dtype]:.3g}" if dtype in direct else "-"
        label = f"matmul {dtype.value} {dtype.rate_unit} (n={prof.matmul_sizes[dtype]})"
        table.add_row(label, f"{tflops:.3g}", peer)
    peer_copy = prof.direct_copy_bandwidth_gbps
    table.add_row(
        f"copy GB/s (read+write, {prof.copy_bytes >> 20} MiB)",
        f"{prof.copy_bandwidth_gbps:.4g}",
        f"{peer_copy:.4g}" if peer_copy else "-",
    )
    peer_launch = prof.direct_launch_latency_us
    table.add_row(
        "launch latency µs (one-element copy)",
        f"{prof.launch_latency_us:.3g}",
        f"{peer_launch:.3g}" if peer_launch else "-",
    )
    console.print(table)
    for note in prof.notes:
        console.print(f"note: {note}")


@app.command()
def conformance(
    adapter: Annotated[str, typer.Argument(help="Adapter name, as `torchhal info` lists it.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON report.")] = False,
    seed: Annotated[int | None, typer.Option(help="Replay the random inputs of an earlier run.")] = None,
    time_limit: Annotated[
        float | None, typer.Option(help="Fail a check still running after this many seconds (default 60).")
    ] = None,
) -> None:
    """Certify an adapter: every check passed, failed or not applicable, with reasons."""
    from torchhal.testing import format_report, run_conformance

    limit = {} if time_limit is None else {"time_limit_s": time_limit}
    report = run_conformance(adapter, seed=seed, **limit)
    typer.echo(report.to_json() if as_json else format_report(report))
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def demo() -> None:
    """Discovery, capabilities, device choice, kernel selection, A/B comparisons and a 2-process
    training run on the hardware present."""
    from torchhal.demo import run

    run(console)


def _register_ab() -> None:
    """`torchhal ab SPEC`: an A/B experiment from a spec file (torchhal.evaluation)."""
    from torchhal.evaluation.cli import ab

    app.command(name="ab")(ab)


_register_ab()


def main() -> None:
    app()
