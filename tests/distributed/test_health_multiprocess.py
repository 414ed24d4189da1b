"""A rank that hangs (sleeps forever after step k): the other rank stops within seconds with an
error that names it as hung (short collective timeout, then the heartbeat verdict)."""

from __future__ import annotations

import json

import pytest

from tests.distributed.ft_launch import logs, run_ranks, schedule
from tests.distributed.ft_train import HANG_TIMEOUT, HEARTBEAT_DEADLINE

pytestmark = pytest.mark.multiprocess


def test_hung_rank_is_reported_within_seconds(tmp_path):
    fault = ["--fault", "hang", "--fault-at", "3", "--fault-rank", "1"]
    fault += ["--collective-timeout", str(HANG_TIMEOUT.total_seconds())]  # the survivor waits this long
    codes = run_ranks(
        2, tmp_path, [str(tmp_path / "ckpt"), "--generation", "0", *schedule(), *fault], grace_s=1
    )
    assert codes[0] == 3 and codes[1] == -9, f"exit codes {codes}:\n{logs(tmp_path, 2)}"
    survivor = json.loads((tmp_path / "rank0.json").read_text())
    hung_at = json.loads((tmp_path / "fault.json").read_text())["time"]
    assert "rank(s) [1] are alive" in survivor["error"] and "hung" in survivor["error"], survivor
    took = survivor["error_time"] - hung_at
    limit = HANG_TIMEOUT.total_seconds() + HEARTBEAT_DEADLINE
    assert took < limit + 5, f"hang reported after {took:.1f} s, limit {limit} s + slack"
