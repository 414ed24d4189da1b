"""Sweep 18, over real gloo process groups: a rank whose batches run out stops every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.launch import check_outcome, run_world

WORKER = Path(__file__).with_name("sweep18_worker.py")
pytestmark = pytest.mark.multiprocess


def test_a_rank_with_fewer_batches_stops_every_rank_naming_it(tmp_path):
    """Rank 1 has fewer batches than steps: both ranks raise InvalidArgumentError naming rank 1
    within seconds. Before, rank 0 waited in DDP's all-reduce until the 20 s timeout (gloo), or
    until rank 1's process exited, and then failed with gloo's error, naming no rank."""
    results, seed = run_world(WORKER, "uneven", 2, tmp_path)
    check_outcome(results, seed, "uneven")
