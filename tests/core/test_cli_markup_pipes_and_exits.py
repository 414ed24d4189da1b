"""The `torchhal` command: strings that look like rich markup, tables in
pipes and narrow terminals, --json documents that adapters print into, and conformance runs
whose adapter exits or leaves a call running."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

import torchhal.cli as cli
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import DeviceCapabilities, ProbeResult
from torchhal.hal_core.adapters.cpu import CPUAdapter

runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCHHAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHHAL_PLUGINS", "simasic")


def with_adapters(monkeypatch: pytest.MonkeyPatch, *adapters: CPUAdapter) -> None:
    """The CLI's HAL gets these adapters besides the installed ones."""
    monkeypatch.setattr(cli, "HardwareAbstractionLayer", lambda: HardwareAbstractionLayer(adapters=adapters))


class Bracketed(CPUAdapter):
    """A device whose name carries its ISA in brackets, as vendor tools print it."""

    name = vendor = namespace = "brk"

    def discover(self) -> Sequence[DeviceCapabilities]:
        (host,) = super().discover()
        return [
            host.model_copy(update={"name": "Instinct MI300X [gfx942]", "adapter": "brk", "vendor": "brk"})
        ]

    def device_id(self, index: int, device_type: str) -> str:
        return f"brk:{index}"


class MissingRuntime(CPUAdapter):
    name = vendor = "rocmish"

    def probe(self) -> ProbeResult:
        raise RuntimeError("libamdhip64.so not found in [/opt/rocm/lib]")


class Chatty(CPUAdapter):
    """A vendor library that prints a banner on stdout when probed."""

    name = vendor = "chatty"

    def probe(self) -> ProbeResult:
        print("chatty runtime 1.0: 1 device")
        return super().probe()


class ExitingSynchronize(CPUAdapter):
    name = vendor = "exiting"

    def synchronize(self, index: int) -> None:
        sys.exit(0)


def test_info_prints_names_and_reasons_as_text_not_markup(monkeypatch: pytest.MonkeyPatch) -> None:
    with_adapters(monkeypatch, Bracketed(), MissingRuntime())
    result = runner.invoke(cli.app, ["info"])
    assert result.exit_code == 0, result.output
    assert "Instinct MI300X" in result.stdout and "[gfx942]" in result.stdout
    assert "[/opt/rocm/lib]" in result.stdout


@pytest.mark.parametrize("width", [None, 60], ids=["pipe", "narrow-terminal"])
def test_info_tables_fold_cells_and_cut_nothing(monkeypatch: pytest.MonkeyPatch, width: int | None) -> None:
    if width is not None:
        monkeypatch.setattr(cli, "console", Console(width=width))
    result = runner.invoke(cli.app, ["info"])
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout
    if width is None:  # wide enough for whole words: every declared dtype of every device is listed
        for device in HardwareAbstractionLayer().devices():
            for dtype in device.capabilities.dtypes:
                assert f" {dtype.value}" in result.stdout, dtype


@pytest.mark.parametrize("command", [["info", "--json"], ["conformance", "chatty", "--json"]])
def test_json_documents_are_alone_on_stdout(monkeypatch: pytest.MonkeyPatch, command: list[str]) -> None:
    with_adapters(monkeypatch, Chatty())
    result = runner.invoke(cli.app, command)
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)
    assert "chatty runtime 1.0: 1 device" in result.stderr


def test_conformance_of_an_adapter_that_exits_fails_with_its_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter's exit(0) ended the command with code 0 and no report."""
    with_adapters(monkeypatch, ExitingSynchronize())
    result = runner.invoke(cli.app, ["conformance", "exiting", "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert [c["check"] for c in report["checks"] if c["status"] == "failed"] == ["device.synchronize"]


SLOW_SYNCHRONIZE = """
import sys, time
import torch
import torchhal.cli as cli
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core.adapters.cpu import CPUAdapter


class SlowSynchronize(CPUAdapter):
    '''synchronize() busy in torch for 10 s: slow, not hung.'''

    name = vendor = "slow"

    def synchronize(self, index):
        a = torch.randn(256, 256)
        end = time.perf_counter() + 10
        while time.perf_counter() < end:
            a = (a @ a).tanh()


cli.HardwareAbstractionLayer = lambda: HardwareAbstractionLayer(adapters=[SlowSynchronize()])
sys.argv = ["torchhal", "conformance", "slow", "--time-limit", "0.5", "--json"]
cli.main()
"""


def test_conformance_exits_with_the_reports_code_while_a_timed_out_call_still_runs(tmp_path: Path) -> None:
    """The timed-out synchronize was still in torch code when the interpreter finalized: the
    process aborted (exit code 134, "terminate called without an active exception")."""
    script = tmp_path / "slow.py"
    script.write_text(textwrap.dedent(SLOW_SYNCHRONIZE))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
    report = json.loads(done.stdout)
    assert [c["check"] for c in report["checks"] if c["status"] == "failed"] == ["device.synchronize"]


def test_demo_prints_names_and_reasons_as_text_not_markup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sections 1-4 (the A/B and training sections are the evaluation's and distributed's tests)."""
    import torchhal.demo as demo
    import torchhal.distributed.demo
    import torchhal.evaluation.demo

    monkeypatch.setattr(
        demo,
        "HardwareAbstractionLayer",
        lambda: HardwareAbstractionLayer(adapters=(Bracketed(), MissingRuntime())),
    )
    monkeypatch.setattr(torchhal.evaluation.demo, "demo_section", lambda console, hal: None)
    monkeypatch.setattr(torchhal.distributed.demo, "demo_section", lambda console, hal: None)
    console = Console(width=200, record=True)
    demo.run(console)
    text = console.export_text()
    assert "Instinct MI300X [gfx942]" in text and "[/opt/rocm/lib]" in text
