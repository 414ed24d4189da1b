"""The kernel-selection file under several processes at once."""

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


def test_a_thread_reading_the_file_second_keeps_the_table_the_first_remembered_into(tmp_path, monkeypatch):
    """Two threads' first selections both read the file; the second's assignment replaced the
    table the first had remembered its winner into, which then was measured again."""
    from pathlib import Path

    from tests.core.adapters import FakeAdapter, fake_caps
    from torchhal.hal_core import tuning
    from torchhal.hal_core.device import Device

    device = Device(FakeAdapter(), fake_caps())
    tuner = tuning.Tuner(Path(tmp_path), "on", code=lambda: CODE)
    read = tuning._read_winners

    def meanwhile_the_first_thread_remembers(path, versions):
        found = read(path, versions)
        monkeypatch.setattr(tuning, "_read_winners", read)  # the first thread reads as before
        tuner.remember(device, "rms_norm", ("first",), "test/first", ["test/first", "torchhal/aten"])
        return found

    monkeypatch.setattr(tuning, "_read_winners", meanwhile_the_first_thread_remembers)
    by_name = {"test/first": object(), "torchhal/aten": object()}
    assert tuner.recall(device, "rms_norm", ("first",), by_name) == "test/first"
