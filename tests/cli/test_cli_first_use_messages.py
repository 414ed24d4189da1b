"""What a first-time user reads from the `torchhal` command: why a device is missing, which
option was wrong, whether a profile was measured now, install hints, the demo's timings and
thresholds, and a `--help` that does not wait for torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from tests.evaluation.test_cli import KERNELS
from torchhal.cli import app

runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCHHAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHHAL_PLUGINS", "simasic")


def words(text: str) -> str:
    """The output with rich's wrapping undone: lines and runs of spaces as one space."""
    return " ".join(text.split())


def error_line(stderr: str) -> str:
    (line,) = [line for line in stderr.splitlines() if line.startswith("error: ")]
    return line


def test_a_missing_device_names_the_plugin_that_failed_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """The error said only "no device 'simasic:0'; devices found: cpu": the bad spec that made
    the plugin fail was in a log line, and `torchhal info` exited 0."""
    monkeypatch.setenv("TORCHHAL_SIMASIC_SPEC", "bogus")
    info = runner.invoke(app, ["info", "--json"])
    assert info.exit_code == 0, info.output  # plugin isolation: a diagnostic, not an error
    (diag,) = [d for d in json.loads(info.stdout)["diagnostics"] if d["name"] == "simasic"]
    assert diag["status"] == "failed" and "got 'bogus'" in diag["reason"]
    result = runner.invoke(app, ["profile", "simasic:0"])
    assert result.exit_code == 2, result.output
    line = error_line(result.stderr)
    assert line.startswith("error: no device 'simasic:0'; devices found: cpu; ")
    assert "plugin 'simasic' failed at probe: ConfigurationError: TORCHHAL_SIMASIC_SPEC" in line
    assert "got 'bogus'" in line


def test_a_failed_plugin_is_logged_as_failed_not_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHHAL_PLUGINS", "nosuch")
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    logged = [line for line in result.stderr.splitlines() if "plugin=nosuch" in line]
    assert logged and all("plugin failed" in line for line in logged), result.stderr
    assert "plugin skipped" not in result.stderr


@pytest.mark.parametrize(
    ("option", "value"),
    [("--discovery-time-limit", "-5"), ("--time-limit", "-1"), ("--discovery-time-limit", "nan")],
)
def test_a_bad_time_limit_names_the_option_typed(option: str, value: str) -> None:
    """`--discovery-time-limit -5` was reported as "time_limit_s", the other option's Python name."""
    result = runner.invoke(app, ["conformance", "cpu", option, value])
    assert result.exit_code == 2, result.output
    assert f"error: conformance: {option} must be a finite number > 0, got {float(value)}" in result.stderr
    assert "time_limit_s" not in result.stderr


def test_a_cached_profile_says_so_and_when_it_was_measured() -> None:
    """Both runs said "measured": the second read the cache, measured_at only in --json."""
    first = runner.invoke(app, ["profile", "simasic:0"])
    assert first.exit_code == 0, first.output
    assert "(simulated time; fingerprint" in words(first.stdout)
    assert "cached" not in first.stdout
    again = runner.invoke(app, ["profile", "simasic:0"])
    assert again.exit_code == 0, again.output
    measured = re.search(r"cached, measured (\S+); --refresh to measure again;", words(again.stdout))
    assert measured, again.stdout
    as_json = runner.invoke(app, ["profile", "simasic:0", "--json"])
    assert f'"measured_at": "{measured.group(1)[:19]}' in as_json.stdout  # the cached record's time
    fresh = runner.invoke(app, ["profile", "simasic:0", "--refresh"])
    assert "cached" not in fresh.stdout


def test_ab_outside_git_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The plots hint lost its `[plots]` to rich markup (`pip install 'torchhal'`), report.md
    said "commit unknown (CalledProcessError: ...)", and no table showed the thresholds the
    verdicts are judged against."""
    import torchhal.evaluation.cli as ab_cli

    monkeypatch.setattr(ab_cli, "plots_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # not in a git repository
    monkeypatch.setenv("LC_ALL", "C")  # git's message in English
    (tmp_path / "spec.toml").write_text(KERNELS)
    result = runner.invoke(app, ["ab", "spec.toml", "--out", "out[plots]"], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    assert "note: no plots: matplotlib is not installed (pip install 'torchhal[plots]')" in result.stderr
    assert "wrote out[plots]/result.json" in words(result.stdout)  # a path, not markup
    table = result.stdout.splitlines()
    header = next(line for line in table if "verdict" in line)
    assert "threshold" in header
    assert any("quality" in line and "1e-05 absolute" in line for line in table), result.stdout
    assert any("latency" in line and "0.05 relative" in line for line in table), result.stdout
    report = (tmp_path / "out[plots]" / "report.md").read_text()
    assert "commit unknown (working directory is not in a git repository)" in report


def test_ab_keeps_its_options_and_help() -> None:
    """Registered from a module apart from torchhal.evaluation (whose import loads torch)."""
    result = runner.invoke(app, ["ab", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = words(result.stdout)
    assert "Run the experiment in SPEC; write result.json, report.md and plots to OUT." in text
    for option in ("--gate", "--gate-metric", "--out", "--plots --no-plots", "--fresh"):
        assert option in text


def test_importing_the_cli_does_not_import_torch() -> None:
    """`torchhal --help` took 2.5 s, 1.9 s of it importing torch for the `ab` command."""
    code = "import sys, torchhal.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_demo_times_several_calls_and_shows_each_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Section 4 timed one call (17, 72 and 10 ms in three runs) and did not say so; section
    5 said "equivalent" without the threshold behind it."""
    import torchhal.distributed.demo
    import torchhal.evaluation.demo

    monkeypatch.setattr(torchhal.evaluation.demo, "_kernel_candidates", lambda console, hal: None)
    monkeypatch.setattr(torchhal.distributed.demo, "demo_section", lambda console, hal: None)
    result = runner.invoke(app, ["demo"], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert any("time (ms): median of 5 [min, max]" in line for line in lines), result.stdout
    rows = [line for line in lines if re.search(r"│ (rms_norm|attention) +│", line)]
    assert len(rows) == 4, result.stdout  # cpu and simasic:0, two ops each
    for row in rows:
        median, low, high = map(float, re.search(r"([\d.]+) \[([\d.]+), ([\d.]+)\]", row).groups())
        assert low <= median <= high
    header = next(line for line in lines if "verdict" in line)
    assert "threshold" in header
    assert any("quality" in line and "0.01 absolute" in line for line in lines), result.stdout


def test_the_hetero_split_calls_the_simulated_rate_modelled(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "from measured matmul TFLOP/s [0.0845, 0.7792]": the simulated rank's 9x read as measured."""
    import torchhal.distributed.demo as training

    def report(rank: int, device: str, simulated: bool) -> dict[str, Any]:
        return {
            "context": {"rank": rank, "device": device, "simulated": simulated},
            "prepared": {"precision": {"policy": "fp32", "reason": "fp32"}},
            "batch": {"local": 2 if rank == 0 else 14, "global": 16},
            "steps": [{"loss": 4.3, "step_time_s": 0.1}, {"loss": 1.1, "step_time_s": 0.1}],
            "hetero": {"batch_sizes": [2, 14], "throughputs_tflops": [0.0845, 0.7792], "islands": [[0], [1]]},
        }

    reports = [report(0, "cpu", False), report(1, "simasic:0", True)]
    monkeypatch.setattr(training, "_run", lambda tmp, args: (reports, ["", ""]))
    console = Console(record=True, width=400)
    assert training.demo_section(console) == reports
    text = words(console.export_text())
    assert (
        "batch split [2, 14] from matmul TFLOP/s cpu 0.0845 (measured), simasic:0 0.7792 (modelled)" in text
    )
    assert "measured matmul" not in text
