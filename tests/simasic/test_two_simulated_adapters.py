"""Several SimASIC-derived adapters in one HAL: each registers its candidates under its own name.

Every candidate was registered as `simasic/simasic` whatever the adapter, so a second simulated
adapter (a subclass exploring a design beside the installed plugin, or two specs side by side)
failed at stage `kernels` ("already has a candidate named 'simasic/simasic'") and its devices
vanished from the HAL.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchhal_simasic.adapter import SimASICAdapter
from torchhal_simasic.cost import matmul_cost
from torchhal_simasic.spec import bundled_spec

import torchhal
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import DType
from torchhal.hal_core.settings import Settings


class MyChip(SimASICAdapter):
    """A design under exploration, beside the installed simasic plugin."""

    name = "mychip"
    namespace = "mychip"


class EdgeSim(SimASICAdapter):
    name = "edgesim"
    namespace = "edgesim"


class DatacenterSim(SimASICAdapter):
    name = "dcsim"
    namespace = "dcsim"


def _diagnostics(hal: HardwareAbstractionLayer) -> dict[str, tuple[str, str]]:
    return {d["name"]: (d["status"], d["reason"]) for d in hal.report()["diagnostics"]}


def _charged_matmul(
    hal: HardwareAbstractionLayer, device_id: str, m: int, k: int, n: int
) -> tuple[str, float]:
    """The candidate chosen for an fp32 M×K×N matmul on `device_id` and the simulated seconds it
    charged that device's clock."""
    dev = hal.device(device_id)
    a, b = torch.randn(m, k), torch.randn(k, n)
    clock = dev.adapter.state(dev.index).clock
    start = clock.now()
    with hal.use(dev):
        out = torchhal.ops.matmul(a, b)
    torch.testing.assert_close(out, a @ b)
    return hal.kernels.select("matmul", dev, a, b).candidate.qualified_name, clock.now() - start


def test_a_subclass_loads_beside_the_installed_plugin(tmp_path: Path):
    hal = HardwareAbstractionLayer(
        adapters=[MyChip(bundled_spec("datacenter"))],
        settings=Settings.from_env({"TORCHHAL_PLUGINS": "simasic", "TORCHHAL_CACHE_DIR": str(tmp_path)}),
    )
    diagnostics = _diagnostics(hal)
    assert diagnostics["mychip"][0] == "loaded", diagnostics["mychip"]
    assert diagnostics["simasic"][0] == "loaded", diagnostics["simasic"]
    ids = [d.id for d in hal.devices()]
    assert ids == ["mychip:0", "mychip:1", "mychip:2", "mychip:3", "simasic:0", "cpu"]
    for op in hal.kernels.ops():  # one candidate each, the installed plugin's under its old name
        names = sorted(c.qualified_name for c in hal.kernels.candidates(op) if c.provider != "torchhal")
        assert names == ["mychip/mychip", "simasic/simasic"], (op, names)

    mine, edge = hal.device("mychip:0").adapter.spec, hal.device("simasic:0").adapter.spec
    chosen, seconds = _charged_matmul(hal, "mychip:0", 96, 80, 72)
    assert chosen == "mychip/mychip"
    assert seconds == pytest.approx(matmul_cost(mine, 96, 80, 72, DType.FP32).time_s, rel=1e-12)
    chosen, seconds = _charged_matmul(hal, "simasic:0", 96, 80, 72)
    assert chosen == "simasic/simasic"  # the installed plugin keeps its name
    assert seconds == pytest.approx(matmul_cost(edge, 96, 80, 72, DType.FP32).time_s, rel=1e-12)


def test_two_specs_in_one_hal_each_charge_their_own_devices(tmp_path: Path):
    hal = HardwareAbstractionLayer(
        adapters=[EdgeSim(bundled_spec("edge")), DatacenterSim(bundled_spec("datacenter"))],
        settings=Settings.from_env(
            {"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1", "TORCHHAL_CACHE_DIR": str(tmp_path)}
        ),
    )
    diagnostics = _diagnostics(hal)
    assert diagnostics["edgesim"][0] == "loaded", diagnostics["edgesim"]
    assert diagnostics["dcsim"][0] == "loaded", diagnostics["dcsim"]
    assert [d.id for d in hal.devices()] == ["dcsim:0", "dcsim:1", "dcsim:2", "dcsim:3", "edgesim:0", "cpu"]

    edge_clock = hal.device("edgesim:0").adapter.state(0).clock
    dc_clock = hal.device("dcsim:0").adapter.state(0).clock
    chosen, seconds = _charged_matmul(hal, "edgesim:0", 130, 70, 66)
    assert chosen == "edgesim/edgesim"
    assert seconds == pytest.approx(
        matmul_cost(bundled_spec("edge"), 130, 70, 66, DType.FP32).time_s, rel=1e-12
    )
    assert dc_clock.now() == 0.0  # the other adapter's device was not charged
    before_edge = edge_clock.now()
    chosen, seconds = _charged_matmul(hal, "dcsim:0", 130, 70, 66)
    assert chosen == "dcsim/dcsim"
    assert seconds == pytest.approx(
        matmul_cost(bundled_spec("datacenter"), 130, 70, 66, DType.FP32).time_s, rel=1e-12
    )
    assert edge_clock.now() == before_edge

    dev = hal.device("dcsim:0")
    selection = hal.kernels.select("matmul", dev, torch.randn(4, 4), torch.randn(4, 4))
    rejection = next(r for r in selection.rejected if r.candidate == "edgesim/edgesim")
    assert "runs on edgesim devices only, not dcsim" in rejection.detail
