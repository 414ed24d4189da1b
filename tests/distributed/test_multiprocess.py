"""Multi-process tests of torchhal.distributed over real gloo process groups on the CPU.

Each world runs its scenario's checks in one set of processes (see `_worker.py`); each check is
reported here as its own test. "train": 2 CPU ranks. "hetero": 4 ranks, two on simulated
ASICs of different specs (edge, datacenter) and two on the CPU, in one job.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.distributed.launch import check_outcome, run_world

WORKER = Path(__file__).with_name("_worker.py")
HETERO_WALL_LIMIT_S = 90  # four interpreters importing torch share two cores; a hung collective fails in 20 s
pytestmark = pytest.mark.multiprocess


def _check_names(scenario: str) -> list[str]:
    spec = importlib.util.spec_from_file_location("torchhal_distributed_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.check_names(scenario)


HETERO_RANKS = [  # rank: (device, simulated spec)
    ("simasic:0", "edge"),
    ("cpu", None),
    ("simasic:0", "datacenter"),
    ("cpu", None),
]


@pytest.fixture(scope="module")
def train_world(tmp_path_factory):
    return run_world(WORKER, "train", 2, tmp_path_factory.mktemp("train"))


@pytest.fixture(scope="module")
def hetero_world(tmp_path_factory):
    env = [
        {
            "WORKER_DEVICE": device,
            "TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "",
            "TORCHHAL_PLUGINS": "simasic",
            **({"TORCHHAL_SIMASIC_SPEC": spec} if spec else {}),
        }
        for device, spec in HETERO_RANKS
    ]
    out = tmp_path_factory.mktemp("hetero")
    return run_world(WORKER, "hetero", 4, out, rank_env=env, wall_limit_s=HETERO_WALL_LIMIT_S)


@pytest.mark.parametrize("name", _check_names("train"))
def test_train_world(train_world, name):
    results, seed = train_world
    check_outcome(results, seed, name)


@pytest.mark.parametrize("name", _check_names("hetero"))
def test_hetero_world(hetero_world, name):
    results, seed = hetero_world
    check_outcome(results, seed, name)
