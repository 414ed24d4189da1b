"""The rich console the CLI's results go to (stdout); progress and errors go to stderr."""

from __future__ import annotations

from rich.console import Console


def results_console() -> Console:
    """stdout, 140 columns wide where it is not a terminal: rich's default of 80 folded every
    table in pipes and CI logs."""
    return Console(width=None if Console().is_terminal else 140)
