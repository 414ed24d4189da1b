"""Mesh and island groups on 2 gloo ranks on simulated ASICs, placed so the mesh order is (1, 0).

The checks run in one world of processes (`_mesh_worker.py`); each is reported here as its own
test: mesh coordinates equal group ranks (DTensor gathers in order, FSDP2 checkpoints hold the
model), the mesh groups have the job's timeout, a torch without `new_group(sort_ranks=)` gets
rank order, and re-formed island groups are released.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.distributed.launch import check_outcome, run_world

WORKER = Path(__file__).with_name("_mesh_worker.py")
pytestmark = pytest.mark.multiprocess
SIMULATED = {
    "TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "",
    "TORCHHAL_PLUGINS": "simasic",
    "TORCHHAL_SIMASIC_DEVICES": "2",
}


def _check_names() -> list[str]:
    spec = importlib.util.spec_from_file_location("torchhal_mesh_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.check_names("mesh")


@pytest.fixture(scope="module")
def mesh_world(tmp_path_factory):
    return run_world(WORKER, "mesh", 2, tmp_path_factory.mktemp("mesh"), rank_env=[SIMULATED] * 2)


@pytest.mark.parametrize("name", _check_names())
def test_mesh_world(mesh_world, name):
    results, seed = mesh_world
    check_outcome(results, seed, name)
