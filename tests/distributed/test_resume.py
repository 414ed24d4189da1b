"""A run killed mid-training (SIGKILL of one rank) and restarted from its checkpoints ends with
parameters bit-identical to an uninterrupted run (2 gloo ranks, fixed seeds, data keyed by step).

The killed run also shows the health monitor at work: the surviving rank stops within seconds
with an error naming the dead rank. Before the restart the newest checkpoint is truncated, so the
restart falls back to the previous one and still loses nothing.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.ft_launch import (
    FAULT_AT,
    SAVE_EVERY,
    assert_identical,
    logs,
    reference_final,
    reports,
    run_ranks,
    schedule,
    torch_load,
)
from torchhal.distributed.checkpoint import latest_valid, step_dir

pytestmark = pytest.mark.multiprocess


def test_killed_rank_is_reported_and_resume_is_bit_identical(tmp_path_factory):
    expected = reference_final(tmp_path_factory.getbasetemp())
    out = tmp_path_factory.mktemp("killed")
    ckpt = out / "ckpt"
    fault = ["--fault", "kill", "--fault-at", str(FAULT_AT), "--fault-rank", "1"]
    codes = run_ranks(2, out, [str(ckpt), "--generation", "0", *schedule(), *fault])
    assert codes == [3, -9], f"exit codes {codes}:\n{logs(out, 2)}"

    survivor = json.loads((out / "rank0.json").read_text())
    killed_at = json.loads((out / "fault.json").read_text())["time"]
    assert "peer(s) dead" in survivor["error"] and "rank 1: last heartbeat" in survivor["error"], survivor
    assert survivor["error_time"] - killed_at < 10, "the dead rank must be reported within seconds"

    newest = FAULT_AT - FAULT_AT % SAVE_EVERY
    assert latest_valid(ckpt).step == newest
    shard = next(step_dir(ckpt, newest).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])

    codes = run_ranks(2, out, [str(ckpt), "--generation", "1", *schedule()])
    assert codes == [0, 0], f"restart exit codes {codes}:\n{logs(out, 2)}"
    for report in reports(out, 2):
        assert report["generation"] == 1 and report["resumed_step"] == newest - SAVE_EVERY, report
        assert_identical(torch_load(out / report["final"]), expected)
