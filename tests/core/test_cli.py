"""The `torchhal` command, end to end through typer's runner."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from torchhal.cli import app
from torchhal.hal_core.dispatch_memo import guard_implementation

runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHHAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHHAL_PLUGINS", "simasic")


def test_info_json_lists_devices_and_diagnostics():
    result = runner.invoke(app, ["info", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert [d["id"] for d in report["devices"]] == ["simasic:0", "cpu"]
    skipped = {d["name"] for d in report["diagnostics"] if d["status"] == "skipped"}
    assert {"nvidia", "amd", "intel"} <= skipped


def test_profile_of_an_empty_device_id_is_an_error_not_the_best_device():
    result = runner.invoke(app, ["profile", ""])
    assert result.exit_code == 2
    assert "no device ''; devices found: simasic:0, cpu" in result.output


def test_info_table_names_each_device():
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    assert "simasic:0" in result.output and "Plugins and adapters" in result.output
    assert f"dispatch guards: {guard_implementation()}" in result.output
    # the simulated ASIC's highest declared peak is int8's: integer operations, not FLOP/s
    assert "peak int8" in result.output and "TOP/s" in result.output and "TFLOP/s" not in result.output


def test_profile_of_the_simulated_asic_is_labelled_and_cached(tmp_path):
    first = runner.invoke(app, ["profile", "simasic:0", "--json"])
    assert first.exit_code == 0, first.output
    profile = json.loads(first.output)
    assert profile["simulated"] is True and profile["direct_matmul_tflops"] is None
    assert profile["matmul_tflops"]["bf16"] > 0 and "simulated" in profile["notes"][0]
    cached = list((tmp_path / "cache" / "profiles").glob("*.json"))
    assert [p.stem for p in cached] == [profile["fingerprint"]]
    again = runner.invoke(app, ["profile", "simasic:0", "--json"])
    assert json.loads(again.output)["measured_at"] == profile["measured_at"]  # read from the cache


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["profile", "cuda:7"], {}, "no device 'cuda:7'; devices found: simasic:0, cpu"),
        (
            ["conformance", "warp9"],
            {},
            "conformance: no adapter named 'warp9' (adapters, their hardware present or not: simasic, cpu)",
        ),
        (["info"], {"TORCHHAL_STRICT_PLUGINS": "perhaps"}, "TORCHHAL_STRICT_PLUGINS='perhaps'"),
        (
            ["conformance", "simasic", "--time-limit", "-1"],
            {},
            "conformance: --time-limit must be a finite number > 0, got -1.0",
        ),
    ],
    ids=["unknown-device", "unknown-adapter", "malformed-setting", "time-limit"],
)
def test_bad_input_is_one_error_line_and_exit_code_2(monkeypatch, args, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()  # no traceback
    assert line.startswith("error: ") and message in line
    assert result.stdout == ""


def test_conformance_exit_code_and_json():
    result = runner.invoke(app, ["conformance", "simasic", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["adapter"] == "simasic" and report["summary"]["failed"] == 0


def test_demo_runs_on_the_embedded_defaults():
    result = runner.invoke(app, ["demo"])
    assert result.exit_code == 0, result.output
    for heading in ("1. Discovery", "2. Capabilities", "3. Best device", "4. Kernel selection"):
        assert heading in result.output
    assert "(simulated)" in result.output
