"""train()'s agreements between ranks on 2 gloo CPU ranks: gradient scaling, strategy from the model.

The checks run in one world of processes (`_loop_worker.py`); each is reported here as its own test.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.distributed.launch import check_outcome, run_world

WORKER = Path(__file__).with_name("_loop_worker.py")
pytestmark = pytest.mark.multiprocess


def _check_names() -> list[str]:
    spec = importlib.util.spec_from_file_location("torchhal_loop_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.check_names("loop")


@pytest.fixture(scope="module")
def loop_world(tmp_path_factory):
    return run_world(WORKER, "loop", 2, tmp_path_factory.mktemp("loop"))


@pytest.mark.parametrize("name", _check_names())
def test_loop_world(loop_world, name):
    results, seed = loop_world
    check_outcome(results, seed, name)
