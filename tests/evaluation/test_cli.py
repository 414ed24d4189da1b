"""`torchhal ab SPEC`: runs from TOML specs, writes reports, resumes, and gates CI by exit code."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from rich.console import Console
from torchhal_simasic.cost import matmul_cost
from torchhal_simasic.spec import bundled_spec
from typer.testing import CliRunner

from tests.evaluation.helpers import sim_hal
from torchhal.evaluation.cli import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_REGRESSION, app
from torchhal.evaluation.demo import demo_section
from torchhal.evaluation.metrics import METRICS
from torchhal.evaluation.spec import load_spec
from torchhal.hal_core import DType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

runner = CliRunner()

KERNELS = """
[experiment]
name = "rms_norm candidates"
baseline = "reference"
reference = "reference"
metrics = ["latency", "quality"]
repetitions = 8
warmup = 2
n_resamples = 1000

[thresholds]
quality = { absolute = 1e-5 }

[workload]
op = "rms_norm"
device = "cpu"
args = [[64, 256], { shape = [256], distribution = "uniform" }]
input_sets = 4
items_per_call = 64

[[variants]]
name = "aten"
kernel = "torchhal/aten"

[[variants]]
name = "reference"
kernel = "torchhal/reference"
"""

CALLABLES = """
[experiment]
name = "planted"
baseline = "{baseline}"
metrics = ["latency"]
repetitions = 10
warmup = 2
n_resamples = 1000

[workload]
device = "cpu"
args = [[64, 256], [256]]
input_sets = 3

[[variants]]
name = "base"
callable = "tests.evaluation.helpers:rms_norm_reference"

[[variants]]
name = "slow"
callable = "tests.evaluation.helpers:{slow}"
"""


def _spec(tmp_path: Path, text: str, name: str = "spec.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _ab(*args: str, columns: int = 240):
    result = runner.invoke(app, list(args), env={"COLUMNS": str(columns)})
    result.text = " ".join(result.output.split())  # rich wraps long lines; compare words
    return result


def test_two_kernel_candidates_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    result = _ab(str(_spec(tmp_path, KERNELS)), "--out", str(out), "--no-plots")
    assert result.exit_code == 0, result.output
    data = json.loads((out / "result.json").read_text())
    assert set(data["variants"]) == {"aten", "reference"}
    assert data["variants"]["aten"]["description"].startswith("kernel rms_norm torchhal/aten on cpu")
    assert len(data["variants"]["aten"]["samples"]["latency_ms"]) == 8
    assert {c["metric"] for c in data["comparisons"]} == {"latency", "quality"}
    assert "rms_norm candidates" in (out / "report.md").read_text()
    assert (out / "samples.sqlite").exists()

    again = _ab(str(_spec(tmp_path, KERNELS)), "--out", str(out), "--no-plots")
    assert again.exit_code == 0, again.output
    assert json.loads((out / "result.json").read_text())["resumed_samples"] == 16  # nothing re-measured
    fresh = _ab(str(_spec(tmp_path, KERNELS)), "--out", str(out), "--no-plots", "--fresh")
    assert fresh.exit_code == 0 and json.loads((out / "result.json").read_text())["resumed_samples"] == 0


def test_gate_fails_on_a_planted_regression(tmp_path):
    spec = _spec(tmp_path, CALLABLES.format(baseline="base", slow="rms_norm_slow"))
    result = _ab(str(spec), "--gate", "--out", str(tmp_path / "out"), "--no-plots")
    assert result.exit_code == EXIT_REGRESSION, result.output
    assert "gate: slow regressed on latency" in result.text
    ungated = _ab(str(spec), "--out", str(tmp_path / "out"), "--no-plots")
    assert ungated.exit_code == 0, ungated.output


def test_results_go_to_stdout_and_progress_to_stderr(tmp_path):
    """`torchhal ab spec.toml > out.txt` captured nothing: every line went to stderr."""
    spec = _spec(tmp_path, CALLABLES.format(baseline="base", slow="rms_norm_slow"))
    result = _ab(str(spec), "--gate", "--out", str(tmp_path / "out"), "--no-plots")
    stdout, stderr = " ".join(result.stdout.split()), " ".join(result.stderr.split())
    assert "planted: 2 variants, baseline base" in stdout and "vs baseline base" in stdout
    assert "gate: slow regressed on latency" in stdout and "wrote " in stdout
    assert "timing" in stderr and "20/20" in stderr and "vs baseline" not in stderr


def test_gate_passes_without_a_regression(tmp_path):
    spec = _spec(tmp_path, CALLABLES.format(baseline="slow", slow="rms_norm_slow"))  # base improves on slow
    result = _ab(str(spec), "--gate", "--out", str(tmp_path / "out"), "--no-plots")
    assert result.exit_code == 0, result.output
    assert "gate: no significant regression" in result.text
    data = json.loads((tmp_path / "out" / "result.json").read_text())
    assert [c["verdict"] for c in data["comparisons"]] == ["improved"]


def test_a_failing_variant_is_not_a_regression(tmp_path):
    spec = _spec(tmp_path, CALLABLES.format(baseline="base", slow="broken"))
    result = _ab(str(spec), "--gate", "--out", str(tmp_path / "out"), "--no-plots")
    assert result.exit_code == EXIT_FAILED
    assert "planted failure in a variant" in result.text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("[workload]", "[workload]\ncolour = 1"), "unknown key(s) ['colour']"),
        (('kernel = "torchhal/aten"', 'kernel = "torchhal/nonesuch"'), "no such candidate"),
        (('metrics = ["latency", "quality"]', 'metrics = ["speed"]'), "unknown metric 'speed'"),
        (("repetitions = 8", "repetitions = 8\nrepetitions = 9"), "invalid TOML"),
        (('device = "cpu"', 'device = "tpu:3"'), "no device 'tpu:3'"),
        (
            ("repetitions = 8", "repetitions = 8\nseed = -1"),
            "[experiment]: seed must be an integer >= 0, got -1",
        ),
        (
            ("repetitions = 8", "repetitions = -3"),
            "[experiment]: repetitions must be an integer >= 1, got -3",
        ),
        (("repetitions = 8", 'repetitions = "many"'), "repetitions must be an integer >= 1, got 'many'"),
        (
            ('baseline = "reference"', 'baseline = "nope"'),
            "[experiment]: baseline must be one of the variant names ['aten', 'reference'], got 'nope'",
        ),
        (('reference = "reference"', 'reference = "nope"'), "reference must be one of the variant names"),
        (
            ('name = "aten"', 'name = "reference"'),
            "variants[1]: name must be unique, got 'reference', already the name of variants[0]",
        ),
    ],
)
def test_bad_specs_exit_2_naming_the_problem(tmp_path, change, message):
    """Refused while loading the spec: before --out is made, let alone anything measured."""
    spec = _spec(tmp_path, KERNELS.replace(*change))
    result = _ab(str(spec), "--out", str(tmp_path / "out"), "--no-plots")
    assert result.exit_code == EXIT_BAD_INPUT
    assert message in result.text, result.output
    assert not (tmp_path / "out").exists()


def test_missing_spec_and_unknown_gate_metric_exit_2(tmp_path):
    missing = _ab(str(tmp_path / "nope.toml"), "--out", str(tmp_path / "out"))
    assert missing.exit_code == EXIT_BAD_INPUT and "no such file" in missing.text
    (tmp_path / "dir.toml").mkdir()
    directory = _ab(str(tmp_path / "dir.toml"), "--out", str(tmp_path / "out"))
    assert directory.exit_code == EXIT_BAD_INPUT
    assert f"spec {tmp_path / 'dir.toml'}: is a directory, not a spec file" in directory.text
    spec = _spec(tmp_path, KERNELS)
    bad_gate = _ab(str(spec), "--gate", "--gate-metric", "speed", "--out", str(tmp_path / "out"))
    assert bad_gate.exit_code == EXIT_BAD_INPUT and "unknown metric(s) ['speed']" in bad_gate.text


def test_a_spec_that_is_not_utf8_is_named(tmp_path):
    spec = tmp_path / "latin1.toml"
    spec.write_bytes(KERNELS.encode() + "# caf\xe9\n".encode("latin-1"))
    result = _ab(str(spec), "--out", str(tmp_path / "out"))
    assert result.exit_code == EXIT_BAD_INPUT and f"spec {spec}: not UTF-8 text" in result.text


def test_yaml_specs_need_pyyaml(tmp_path):
    spec = _spec(tmp_path, "experiment: {baseline: a}\n", "spec.yaml")
    result = _ab(str(spec), "--out", str(tmp_path / "out"))
    try:
        import yaml  # noqa: F401
    except ImportError:
        assert result.exit_code == EXIT_BAD_INPUT and "YAML specs need PyYAML" in result.text
    else:
        assert result.exit_code == EXIT_BAD_INPUT and "[[variants]] needs at least 2 entries" in result.text


def test_malformed_yaml_is_one_error_line_as_malformed_toml(tmp_path):
    pytest.importorskip("yaml")
    spec = _spec(tmp_path, KERNELS, "x.yaml")  # TOML is not YAML
    result = _ab(str(spec), "--out", str(tmp_path / "out"))
    bad_toml = _ab(str(_spec(tmp_path, "[experiment\n")), "--out", str(tmp_path / "out"))
    assert result.exit_code == bad_toml.exit_code == EXIT_BAD_INPUT
    assert result.output.splitlines() == [
        f"error: spec {spec}: invalid YAML: expected '<document start>', but found '<scalar>' "
        "(at line 3, column 1)"
    ]


def test_errors_print_on_one_line_at_80_columns(tmp_path):
    """Soft wrap, as the main CLI: a long error stays one line for logs and grep."""
    bad = _ab(str(_spec(tmp_path, KERNELS)), "--gate-metric", "speed", columns=80)
    message = "error: --gate-metric: unknown metric(s) ['speed']; known: " + str(sorted(METRICS))
    assert len(message) > 80 and bad.output.splitlines() == [message]
    failing = _spec(tmp_path, CALLABLES.format(baseline="base", slow="broken"), "failing.toml")
    failed = _ab(str(failing), "--out", str(tmp_path / "out"), "--no-plots", columns=80)
    assert failed.exit_code == EXIT_FAILED
    (line,) = [line for line in failed.output.splitlines() if line.startswith("failed:")]
    assert len(line) > 80 and line.endswith(
        f"(finished samples are in {tmp_path / 'out' / 'samples.sqlite'})"
    )


SIMULATED_SPECS = """
[experiment]
name = "edge vs datacenter"
baseline = "edge"
metrics = ["latency"]
repetitions = 4
warmup = 1

[prices]
edge = 0.05
datacenter = 2.0

[workload]
op = "matmul"
device = "simasic:0"
dtype = "bfloat16"
args = [[160, 96], [96, 144]]
input_sets = 2

[[variants]]
name = "edge"
kernel = "simasic/simasic"
env = { TORCHHAL_SIMASIC_SPEC = "edge" }

[[variants]]
name = "datacenter"
kernel = "simasic/simasic"
env = { TORCHHAL_SIMASIC_SPEC = "datacenter" }
"""


def test_variants_with_their_own_plugin_environment(tmp_path, monkeypatch):
    """Each variant's HAL is discovered under its env, so the two simasic:0 devices differ."""
    monkeypatch.delenv("TORCHHAL_SIMASIC_SPEC", raising=False)
    result = _ab(str(_spec(tmp_path, SIMULATED_SPECS)), "--out", str(tmp_path / "out"), "--no-plots")
    assert result.exit_code == 0, result.output
    assert "TORCHHAL_SIMASIC_SPEC" not in os.environ  # restored after discovery
    data = json.loads((tmp_path / "out" / "result.json").read_text())
    (latency,) = data["comparisons"]
    cost = {
        name: matmul_cost(bundled_spec(name), 160, 96, 144, DType.BF16).time_s
        for name in ("edge", "datacenter")
    }
    assert latency["test"] == "exact"
    assert latency["ratio"] == pytest.approx(cost["datacenter"] / cost["edge"], rel=1e-9)
    names = sorted(d["capabilities"]["name"] for d in data["fingerprint"]["devices"])
    assert names == ["Simulated ASIC datacenter-256x256", "Simulated ASIC edge-64x64"]


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("ab_*.toml")), ids=lambda p: p.name)
def test_example_specs_load(example):
    loaded = load_spec(example)
    assert len(loaded.variants) >= 2
    assert loaded.config.baseline in {v.name for v in loaded.variants}


def test_demo_section_compares_candidates_and_simulated_dtypes():
    console = Console(file=io.StringIO(), width=200)
    demo_section(console, sim_hal("edge"))
    text = console.file.getvalue()
    assert "rms_norm candidates on cpu" in text and "torchhal/aten" in text
    assert "matmul fp32 vs bf16 on simasic:0" in text
    bf16_latency = next(line for line in text.splitlines() if "latency" in line and "bfloat16" in line)
    assert "improved" in bf16_latency  # bf16 packs two MACs per cell per cycle on the edge spec
