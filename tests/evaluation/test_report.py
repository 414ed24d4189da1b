"""Reports: JSON with raw samples and summaries, Markdown, PNG plots (optional extra)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

import torchhal
from tests.evaluation.helpers import sim_hal
from torchhal.evaluation.experiment import ExperimentConfig, run_experiment
from torchhal.evaluation.inputs import Inputs
from torchhal.evaluation.plots import available, write_plots
from torchhal.evaluation.report import summary, to_markdown, write_json
from torchhal.evaluation.stats import quantile_ci
from torchhal.evaluation.stats.intervals import minimum_size_for_quantile_ci
from torchhal.evaluation.variants import dtype_variants
from torchhal.hal_core import ConfigurationError

REPS = 6


@pytest.fixture(scope="module")
def result():
    hal = sim_hal("edge")
    sim = hal.device("simasic:0")
    inputs = Inputs(
        [(sim.to_device(torch.randn(96, 128)), sim.to_device(torch.randn(128, 80))) for _ in range(5)]
    )
    variants = dtype_variants(torchhal.ops.matmul, sim, inputs, [torch.float32, torch.bfloat16], hal=hal)
    config = ExperimentConfig(
        name="report test",
        baseline="float32",
        reference="float32",
        metrics=("latency", "throughput", "memory", "quality"),
        thresholds={"quality": {"absolute": 1e-2}},
        prices={"simasic:0": 1.5},
        warmup=1,
        repetitions=REPS,
    )
    return run_experiment(variants, config)


def test_json_holds_raw_samples_order_fingerprint_and_comparisons(result, tmp_path):
    data = json.loads(write_json(result, tmp_path / "r.json").read_text())
    assert data["schema"] == "torchhal.evaluation.ab/1"
    m = result.measurement
    for name in ("float32", "bfloat16"):
        samples = data["variants"][name]["samples"]
        assert samples["latency_ms"] == m.variants[name].latency_ms.tolist()
        assert samples["memory_bytes"] == m.variants[name].memory_bytes.tolist()
        assert samples["quality_error"] == result.quality[name].tolist()
        assert samples["round"] == list(range(REPS))
        assert data["variants"][name]["timer"] == "SimulatedTimer"
    assert [tuple(x) for x in data["order"]] == [(s.round, s.position, s.variant) for s in m.order]
    assert len(data["order"]) == 2 * REPS
    assert data["fingerprint"]["digest"] == result.fingerprint["digest"]
    assert {(c["variant"], c["metric"]) for c in data["comparisons"]} == {
        ("bfloat16", metric) for metric in ("latency", "throughput", "memory", "quality")
    }
    latency = next(c for c in data["comparisons"] if c["metric"] == "latency")
    assert latency["verdict"] == "improved" and latency["test"] == "exact"
    assert [r["variant"] for r in data["cost"]] == ["float32", "bfloat16"]
    assert data["pareto_front"] == result.pareto


def test_summary_quantiles_come_with_intervals_where_n_allows():
    values = np.random.default_rng().lognormal(0.0, 0.3, 40)
    s = summary(values)
    expected = quantile_ci(values, 0.5, 0.95)
    assert s["p50"]["interval"] == list(expected.interval)
    assert s["p50"]["estimate"] == pytest.approx(np.median(values))
    needed = minimum_size_for_quantile_ci(0.99, 0.95)
    assert s["p99"]["interval"] is None and s["p99"]["note"] == f"a 95% interval needs n >= {needed}"
    assert s["n"] == 40 and s["sd"] == pytest.approx(values.std(ddof=1))


def test_markdown_names_every_comparison_and_the_cost(result):
    text = to_markdown(result)
    assert text.startswith("# A/B experiment: report test")
    for c in result.comparisons:
        assert f"| {c.metric} | `{c.variant}` |" in text
        assert f"**{c.verdict.value}**" in text
    assert "## Cost" in text and "simasic:0 (simulated)" in text
    assert "simulated (time and memory are modelled)" in text


@pytest.mark.skipif(not available(), reason="matplotlib (the 'plots' extra) is not installed")
def test_plots_are_png_files(result, tmp_path):
    paths = write_plots(result, tmp_path)
    names = sorted(p.name for p in paths)
    assert names == sorted(
        [f"{m}_distribution.png" for m in ("latency", "throughput", "memory", "quality")]
        + ["comparisons.png", "pareto.png"]
    )
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_without_matplotlib_name_the_extra(result, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert not available()
    with pytest.raises(ConfigurationError, match=r"pip install 'torchhal\[plots\]'"):
        write_plots(result, tmp_path)
