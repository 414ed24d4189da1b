"""The `torchhal` command: info, profile, conformance, demo, ab."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Annotated, Any

import typer
import typer.core
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from torchhal.cli_ab import ab
from torchhal.console import results_console
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
console = results_console()


def _table(title: str | Text, *columns: str) -> Table:
    """Columns fold long cells rather than cut them to "…": in a pipe (140 columns) the dtype
    lists lost their tail, and in a narrow terminal every device id was cut short."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _row(table: Table, *cells: str) -> None:
    """Cells as plain text: device names and plugin reasons are not rich markup ("[gfx942]"
    vanished, and a reason naming "[/opt/rocm/lib]" crashed `torchhal info` with a MarkupError)."""
    table.add_row(*(Text(cell) for cell in cells))


@contextlib.contextmanager
def _stdout_for(as_json: bool) -> Iterator[None]:
    """While a --json document is made, what plugins and adapters print goes to stderr, so that
    stdout holds the document only (a vendor library's print broke `torchhal info --json | jq`).
    File descriptor 1 goes to stderr too: a C library's printf or an `os.write(1, ...)` bypasses
    sys.stdout. C stdio's buffer is flushed on the way in and out (POSIX; elsewhere a DLL's
    buffered printf can still land after the document). Without a usable fd 1 (stdout closed),
    only sys.stdout is redirected."""
    if not as_json:
        yield
        return
    if sys.stdout is not None:
        sys.stdout.flush()  # what was printed before goes where it was meant to
    _flush_c_stdio()
    try:
        real_stdout = os.dup(1)
    except OSError:  # fd 1 closed: nothing at the OS level to keep clean
        real_stdout = None
    try:
        if real_stdout is not None:
            os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        try:
            _flush_c_stdio()
        finally:
            if real_stdout is not None:
                os.dup2(real_stdout, 1)
                os.close(real_stdout)


def _flush_c_stdio() -> None:
    """fflush(NULL): what C code wrote through stdio (printf) leaves its buffer now. POSIX only;
    a Python without ctypes skips it."""
    if os.name != "posix":
        return
    try:
        import ctypes
    except ImportError:
        return
    ctypes.CDLL(None).fflush(None)


@app.command()
def info(
    as_json: Annotated[bool, typer.Option("--json", help="Print the full report as JSON.")] = False,
) -> None:
    """Adapters, devices, capabilities, topology and plugin diagnostics."""
    hal = HardwareAbstractionLayer()
    with _stdout_for(as_json):
        report = hal.report()
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    console.print(f"[bold]torchhal {report['torchhal_version']}[/] on torch {report['torch_version']}")
    console.print(f"dispatch guards: {report['kernel_guards']}")  # python where torchhal-speedups is missing
    devices = _table(
        "Devices", "id", "name", "arch", "units", "simd", "memory", "dtypes", "collectives", "notes"
    )
    for dev in hal.devices():
        caps = dev.capabilities
        notes = "simulated" if caps.simulated else ""
        if caps.declared_peaks and caps.declared_peaks.tflops:
            dtype, peak = max(caps.declared_peaks.tflops.items(), key=lambda kv: kv[1])
            notes = (notes + " " if notes else "") + f"declared peak {dtype.value} {peak:g} {dtype.rate_unit}"
        _row(
            devices,
            dev.id,
            caps.name,
            caps.arch,
            str(caps.compute_units),
            str(caps.simd_width),
            caps.memory_text,
            ", ".join(sorted(d.value for d in caps.dtypes)),
            ", ".join(caps.collective_backends),
            notes,
        )
    console.print(devices)
    links = hal.topology().links
    if links:
        topo = _table("Topology", "a", "b", "type", "count", "GB/s (declared)", "source")
        for lk in links:
            bandwidth = f"{lk.bandwidth_gbps:g}" if lk.bandwidth_gbps else "-"
            _row(topo, lk.a, lk.b, lk.type.value, str(lk.count or "-"), bandwidth, lk.source)
        console.print(topo)
    diags = _table("Plugins and adapters", "name", "status", "stage", "reason")
    for d in hal.diagnostics:
        _row(diags, d.name, d.status.value, d.stage, d.reason)
    console.print(diags)


@app.command()
def profile(
    device: Annotated[str | None, typer.Argument(help="Device id; default: the best device.")] = None,
    refresh: Annotated[bool, typer.Option(help="Measure again instead of reading the cache.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the profile as JSON.")] = False,
) -> None:
    """Measure matmul TFLOP/s per dtype, copy bandwidth and launch latency (cached on disk)."""
    hal = HardwareAbstractionLayer()
    started = time.time()
    with _stdout_for(as_json):
        dev = hal.best_device() if device is None else hal.device(device)  # "" is no device, not the best
        prof = hal.profile(dev, refresh=refresh)
    if as_json:
        typer.echo(prof.model_dump_json(indent=2))
        return
    kind = "simulated time" if prof.simulated else "measured"
    if prof.measured_at.timestamp() < started:  # measured before this command: read from the cache
        when = prof.measured_at.isoformat(timespec="seconds")
        cached = f"cached, measured {when}; --refresh to measure again"
        kind = f"simulated time, {cached}" if prof.simulated else cached
    title = Text(f"{dev.id}: {prof.device_name} ({kind}; fingerprint {prof.fingerprint})")
    table = _table(title, "measure", "through torchhal", "plain torch, same run")
    direct = prof.direct_matmul_tflops or {}
    for dtype, tflops in prof.matmul_tflops.items():
        peer = f"{direct[dtype]:.3g}" if dtype in direct else "-"
        label = f"matmul {dtype.value} {dtype.rate_unit} (n={prof.matmul_sizes[dtype]})"
        _row(table, label, f"{tflops:.3g}", peer)
    peer_copy = prof.direct_copy_bandwidth_gbps
    _row(
        table,
        f"copy GB/s (read+write, {prof.copy_bytes >> 20} MiB)",
        f"{prof.copy_bandwidth_gbps:.4g}",
        f"{peer_copy:.4g}" if peer_copy else "-",
    )
    peer_launch = prof.direct_launch_latency_us
    _row(
        table,
        "launch latency µs (one-element copy)",
        f"{prof.launch_latency_us:.3g}",
        f"{peer_launch:.3g}" if peer_launch else "-",
    )
    console.print(table)
    for note in prof.notes:
        console.print(Text(f"note: {note}"))


@app.command()
def conformance(
    adapter: Annotated[str, typer.Argument(help="Adapter name, as `torchhal info` lists it.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON report.")] = False,
    seed: Annotated[int | None, typer.Option(help="Replay the random inputs of an earlier run.")] = None,
    time_limit: Annotated[
        float | None,
        typer.Option(help="Fail a check still running after this many seconds (default 60)."),
    ] = None,
    discovery_time_limit: Annotated[
        float | None,
        typer.Option(
            help="Fail when the plugins' discovery has not finished after this many seconds (default 60)."
        ),
    ] = None,
) -> None:
    """Certify an adapter: every check passed, failed or not applicable, with reasons."""
    from torchhal.testing import ConformanceSuite, format_report, resolve_adapter
    from torchhal.testing.suite import (
        CHECK_TIME_LIMIT_S,
        DiscoveryStuck,
        checked_time_limit,
        discover_within_limit,
        exit_leaving_threads,
    )

    # before discovery, each named as the user wrote it
    limit = checked_time_limit(CHECK_TIME_LIMIT_S if time_limit is None else time_limit, "--time-limit")
    discovery_limit = checked_time_limit(
        CHECK_TIME_LIMIT_S if discovery_time_limit is None else discovery_time_limit,
        "--discovery-time-limit",
    )
    # the kit needs torch: imported now, its seconds do not count against the plugins' discovery
    import torch  # noqa: F401

    hal = HardwareAbstractionLayer()
    try:
        with _stdout_for(as_json):
            # a plugin's hanging discovery hung the command for good; a limit of its own, since
            # every plugin's discovery (a cold CUDA start, say) is more than one check
            discover_within_limit(hal, discovery_limit)
            suite = ConformanceSuite(resolve_adapter(adapter, hal), seed=seed, time_limit_s=limit)
            report = suite.run()
    except DiscoveryStuck as exc:  # no adapter to certify: not conforming, and no report
        Console(stderr=True).print("[red]error:[/] " + escape(str(exc)), soft_wrap=True)
        exit_leaving_threads(1)
    typer.echo(report.to_json() if as_json else format_report(report))
    code = 0 if report.ok else 1
    if suite.still_running():
        exit_leaving_threads(code)
    raise typer.Exit(code)


@app.command()
def demo() -> None:
    """Discovery, capabilities, device choice, kernel selection, A/B comparisons and a 2-process
    training run on the hardware present."""
    from torchhal.demo import run

    run(console)


app.command(name="ab")(ab)  # `torchhal ab SPEC`: an A/B experiment from a spec file (torchhal.evaluation)


def main() -> None:
    app()
