"""The tiny GPT example under torchrun, and the `torchhal demo` section (a CPU and a simulated ASIC)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from torchhal import HardwareAbstractionLayer
from torchhal.distributed import demo
from torchhal.hal_core.settings import Settings

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_tiny_gpt.py"
WALL_LIMIT_S = 60
pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize(
    ("strategy", "options"),
    [("ddp", []), ("fsdp", ["--activation-checkpointing"])],
    ids=["ddp", "fsdp-checkpointed"],
)
def test_example_trains_under_torchrun_and_the_loss_falls(tmp_path, strategy, options):
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # torchrun --standalone reusing its store fails on gloo
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLE),
        "--steps",
        "6",
        "--strategy",
        strategy,
        *options,
        "--json-out",
        str(out),
    ]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=WALL_LIMIT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun hung past {WALL_LIMIT_S} s:\n{exc.stdout}\n{exc.stderr}")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for rank in range(2):
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert report["context"]["rank"] == rank and report["context"]["world_size"] == 2
        assert report["context"]["backend"] == "gloo" and report["prepared"]["strategy"] == strategy
        assert report["prepared"]["checkpointed_blocks"] == (2 if options else 0)
        losses = [s["loss"] for s in report["steps"]]
        assert len(losses) == 6 and losses[-1] < 0.8 * losses[0], losses
        assert report["batch"] == {"local": 8, "global": 16, "seq_len": 32}


def test_demo_section_trains_on_a_cpu_and_a_simulated_asic(monkeypatch):
    monkeypatch.setenv("TORCHHAL_PLUGINS", "simasic")
    monkeypatch.delenv("TORCHHAL_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("TORCHHAL_SIMASIC_SPEC", raising=False)  # the embedded default spec
    console = Console(record=True, width=200)
    reports = demo.demo_section(console, HardwareAbstractionLayer(settings=Settings.from_env()))
    text = console.export_text()
    assert reports is not None, text
    devices = [r["context"]["device"] for r in reports]
    assert devices == ["cpu", "simasic:0"]
    assert [r["prepared"]["precision"]["policy"] for r in reports] == ["fp32", "bf16"]
    sizes = reports[0]["hetero"]["batch_sizes"]
    assert sum(sizes) == 16 and sizes[1] > sizes[0]  # the simulated ASIC measured faster than one CPU core
    for r in reports:
        losses = [s["loss"] for s in r["steps"]]
        assert losses[-1] < losses[0], losses
    assert "simasic:0 (simulated)" in text and "islands [[0], [1]]" in text


def test_demo_section_says_why_it_cannot_run_without_the_example(monkeypatch, tmp_path):
    monkeypatch.setattr(demo, "EXAMPLE", tmp_path / "missing.py")
    console = Console(record=True, width=200)
    assert demo.demo_section(console) is None
    assert "is not in this installation (needs a source checkout)" in console.export_text()


@pytest.mark.parametrize("value", ["0", "-2"])
def test_example_refuses_fewer_than_one_micro_batch_before_any_rendezvous(value):
    """0 divided each rank's batch by zero after the rendezvous."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--gradient-accumulation-steps", value],
        capture_output=True,
        text=True,
        timeout=WALL_LIMIT_S,
    )
    assert done.returncode == 2, done.stderr
    assert f"--gradient-accumulation-steps: must be an integer >= 1, got {value}" in done.stderr
