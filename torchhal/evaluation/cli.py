"""`torchhal ab SPEC`: run an A/B experiment from a spec file, write its reports, gate CI on it.

Exit codes: 0 when the experiment ran (with `--gate`: and no metric regressed significantly
beyond its noise threshold); 1 with `--gate` when one did; 2 for a bad spec or bad arguments
(`--gate-metric` naming a metric the spec does not measure included); 3 when a variant failed
while running, whatever it raised (a torchhal error from its code, an out-of-memory, too), with
the path of the finished samples.
Finished samples go to OUT/samples.sqlite as they are measured, so running the same command
again after an interruption resumes; `--fresh` discards them first.
"""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from torchhal.cli_ab import ab
from torchhal.console import results_console
from torchhal.evaluation.compare import Verdict
from torchhal.evaluation.experiment import ExperimentResult, run_experiment
from torchhal.evaluation.harness import raised_in_variant
from torchhal.evaluation.metrics import METRICS
from torchhal.evaluation.plots import available as plots_available
from torchhal.evaluation.plots import write_plots
from torchhal.evaluation.report import write_json, write_markdown
from torchhal.evaluation.spec import load_spec
from torchhal.evaluation.store import SampleStore
from torchhal.hal_core import TorchHALError

EXIT_REGRESSION = 1
EXIT_BAD_INPUT = 2
EXIT_FAILED = 3

app = typer.Typer(help="A/B experiments on the HAL.")
app.command()(ab)  # its options live in torchhal.cli_ab: `torchhal --help` lists it without torch
_COLORS = {
    Verdict.IMPROVED: "green",
    Verdict.REGRESSED: "red",
    Verdict.EQUIVALENT: "cyan",
    Verdict.INCONCLUSIVE: "yellow",
}


def run(
    spec: Path,
    *,
    gate: bool,
    gate_metric: list[str] | None,
    out: Path | None,
    plots: bool | None,
    fresh: bool,
) -> None:
    """`torchhal ab`'s work, with the options of `torchhal.cli_ab.ab`."""
    console = Console(stderr=True)  # progress, notes and errors; results go to stdout (`> file`)
    results = results_console()
    unknown = sorted(set(gate_metric or ()) - set(METRICS))
    if unknown:
        _error(console, f"--gate-metric: unknown metric(s) {unknown}; known: {sorted(METRICS)}")
        raise typer.Exit(EXIT_BAD_INPUT)
    if plots and not plots_available():
        _error(console, "--plots needs matplotlib: pip install 'torchhal[plots]'")
        raise typer.Exit(EXIT_BAD_INPUT)
    out_dir = out or Path("ab-results") / spec.stem
    try:
        loaded = load_spec(spec)
    except TorchHALError as exc:
        _error(console, str(exc))
        raise typer.Exit(EXIT_BAD_INPUT) from exc
    unmeasured = sorted(set(gate_metric or ()) - set(loaded.config.metrics))
    if unmeasured:  # gating on it would pass whatever happened
        _error(
            console,
            f"--gate-metric: metric(s) {unmeasured} not measured by {spec}; "
            f"it measures {list(loaded.config.metrics)}",
        )
        raise typer.Exit(EXIT_BAD_INPUT)
    store_path = out_dir / "samples.sqlite"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        if fresh:
            for path in (store_path, *(store_path.with_name(store_path.name + s) for s in ("-wal", "-shm"))):
                path.unlink(missing_ok=True)
        store = SampleStore(store_path)
    except OSError as exc:  # --out names a file, or a directory this user may not write
        why = "exists and is not a directory" if out_dir.is_file() else str(exc)
        _error(console, f"--out {out_dir}: {why}")
        raise typer.Exit(EXIT_BAD_INPUT) from exc
    except TorchHALError as exc:  # a store file that is not one (corrupt, another schema)
        _error(console, str(exc))
        raise typer.Exit(EXIT_BAD_INPUT) from exc
    results.print(
        f"[bold]{escape(loaded.config.name)}[/]: {len(loaded.variants)} variants, "
        f"baseline {escape(loaded.config.baseline)}"
    )
    with store, _progress(console) as progress:
        tasks: dict[str, TaskID] = {}

        def advance(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = progress.add_task(phase, total=total)
            progress.update(tasks[phase], completed=done)

        try:
            result = run_experiment(loaded.variants, loaded.config, store=store, progress=advance)
        except Exception as exc:
            where = "".join(f" ({note})" for note in getattr(exc, "__notes__", ()))  # which variant
            if isinstance(exc, TorchHALError) and not raised_in_variant(exc):
                _error(console, f"{exc}{where}")
                raise typer.Exit(EXIT_BAD_INPUT) from exc
            # a variant's own code failed (a torchhal error from inside it too, an out-of-memory
            # on its device): not a regression, not bad input
            console.print(
                "[red]failed:[/] "
                + escape(f"{type(exc).__name__}: {exc}{where} (finished samples are in {store_path})"),
                soft_wrap=True,
            )
            raise typer.Exit(EXIT_FAILED) from exc
    written = [write_json(result, out_dir / "result.json"), write_markdown(result, out_dir / "report.md")]
    if plots or (plots is None and plots_available()):
        written += write_plots(result, out_dir)
    elif plots is None:
        console.print(escape("note: no plots: matplotlib is not installed (pip install 'torchhal[plots]')"))
    print_result(results, result)
    results.print(escape("wrote " + ", ".join(str(p) for p in written)))  # paths, not markup: out[plots]
    if gate:
        regressions = result.regressions(gate_metric or None)
        if regressions:
            for c in regressions:
                what = f"{escape(c.variant)} regressed on {c.metric}"
                results.print(f"[red]gate: {what}:[/] {escape(c.reason)}", soft_wrap=True)
            raise typer.Exit(EXIT_REGRESSION)
        results.print("gate: no significant regression beyond the noise thresholds")


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def print_result(console: Console, result: ExperimentResult) -> None:
    """The comparisons as a rich table, and the cost rows."""
    table = Table(title=f"vs baseline {escape(result.config.baseline)}")  # names are text, not markup
    for col in (
        "metric",
        "variant",
        "median (variant / baseline)",
        "change [CI]",
        "threshold",  # what "equivalent" and "beyond" are judged against
        "p beyond thr. (corr.)",
        "verdict",
    ):
        table.add_column(col)
    for c in result.comparisons:
        if c.ratio is not None and c.ratio_interval is not None:
            change = f"×{c.ratio:.3f} [{c.ratio_interval[0]:.3f}, {c.ratio_interval[1]:.3f}]"
        else:
            change = f"{c.shift:+.3g} [{c.shift_interval[0]:+.3g}, {c.shift_interval[1]:+.3g}]"
        color = _COLORS[c.verdict]
        table.add_row(
            c.metric,
            escape(c.variant),
            f"{c.median_variant:.4g} / {c.median_baseline:.4g} {c.unit}",
            change,
            c.threshold_spec,
            "-" if math.isnan(c.p_corrected) else f"{c.p_corrected:.3g}",  # NaN: no threshold to test
            f"[{color}]{c.verdict.value}[/]",
        )
    console.print(table)
    for r in result.cost:
        front = " (Pareto front)" if r.variant in result.pareto else ""
        sim = ", simulated time" if r.simulated else ""
        console.print(f"  {escape(r.variant)}: {r.cost_per_million_items:.4g} per 10⁶ items{sim}{front}")


def _error(console: Console, message: str) -> None:
    """An error line; the message is text, not markup (a spec's `[[variants]]` must print as is).
    Soft wrap, as the main CLI's errors: one line whatever the width, for logs and grep."""
    console.print("[red]error:[/] " + escape(message), soft_wrap=True)
