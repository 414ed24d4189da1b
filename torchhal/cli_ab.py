"""The `torchhal ab` command's argument, options and help, apart from its work.

typer reads a command's signature when the command is registered, so `torchhal --help` needs
this one; importing torchhal.evaluation for it loaded torch (2 s of a 2.5 s `--help`). The work,
`torchhal.evaluation.cli.run`, is imported when the command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def ab(
    spec: Annotated[Path, typer.Argument(help="Experiment spec (.toml; .yaml with PyYAML).")],
    gate: Annotated[
        bool, typer.Option("--gate", help="Exit 1 on a significant regression beyond the noise threshold.")
    ] = False,
    gate_metric: Annotated[
        list[str] | None, typer.Option("--gate-metric", help="Gate on these metrics only (repeatable).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Output directory; default ab-results/<spec name>.")
    ] = None,
    plots: Annotated[
        bool | None, typer.Option("--plots/--no-plots", help="PNG plots (needs the 'plots' extra).")
    ] = None,
    fresh: Annotated[
        bool, typer.Option("--fresh", help="Discard stored samples instead of resuming.")
    ] = False,
) -> None:
    """Run the experiment in SPEC; write result.json, report.md and plots to OUT."""
    from torchhal.evaluation.cli import run

    run(spec, gate=gate, gate_metric=gate_metric, out=out, plots=plots, fresh=fresh)
