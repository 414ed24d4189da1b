"""What rank 0 alone does to a shared checkpoint directory (choose the checkpoint to load, commit)
fails on every rank at once, naming the cause, on 2 gloo CPU ranks: the others waited for the
group's timeout and got gloo's "Timed out ... recv", naming nothing.

The checks run in one world of processes (`_ckpt_worker.py`); each is reported here as its own test.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.distributed.launch import check_outcome, run_world

WORKER = Path(__file__).with_name("_ckpt_worker.py")
pytestmark = pytest.mark.multiprocess


def _check_names() -> list[str]:
    spec = importlib.util.spec_from_file_location("torchhal_ckpt_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.check_names("ranks_fail_together")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(WORKER, "ranks_fail_together", 2, tmp_path_factory.mktemp("ranks_fail_together"))


@pytest.mark.parametrize("name", _check_names())
def test_ranks_fail_together(world, name):
    results, seed = world
    check_outcome(results, seed, name)
