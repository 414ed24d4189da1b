"""The demo's A/B section prints names from specs and plugins as text, never as rich markup."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from torchhal_simasic.spec import bundled_spec

from tests.evaluation.helpers import sim_hal
from torchhal.evaluation import demo


@pytest.mark.parametrize("name", ["npu[v2]", "npu[/v2]"])
def test_a_simulated_device_name_with_brackets_prints_as_written(monkeypatch, name):
    monkeypatch.setattr(demo, "_kernel_candidates", lambda console, hal: None)  # the simulated part only
    console = Console(file=io.StringIO(), width=300)
    demo.demo_section(console, sim_hal(bundled_spec("edge").model_copy(update={"name": name})))
    heading = next(line for line in console.file.getvalue().splitlines() if "matmul fp32 vs bf16" in line)
    assert heading.endswith(f" {name}, simulated time)")
