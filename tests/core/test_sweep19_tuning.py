"""The kernel-selection file under several processes at once (nineteenth session's sweep)."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from tests.core._tuning_worker import CODE, key, remember_many

WORKERS, WINNERS = 4, 60


@pytest.mark.multiprocess
def test_processes_remembering_at_once_keep_every_winner(tmp_path):
    """Each writer read the file, merged its winner and wrote it back with no lock: a writer that
    read before another's write replaced that write, and the other's winner was lost for good."""
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(WORKERS)
    procs = [
        ctx.Process(target=remember_many, args=(str(tmp_path), w, WINNERS, start)) for w in range(WORKERS)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * WORKERS
    (path,) = (tmp_path / "selections").glob("*.json")
    saved = json.loads(path.read_text())
    assert saved["code"] == CODE
    expected = {key(w, i): f"test/w{w}" for w in range(WORKERS) for i in range(WINNERS)}
    lost = sorted(set(expected) - set(saved["winners"]))
    assert not lost, f"{len(lost)} of {len(expected)} winners lost, e.g. {lost[:3]}"
    assert {k: v["winner"] for k, v in saved["winners"].items()} == expected
