"""SampleStore opening a file another process is opening too: sqlite's immediate "database is
locked" (it does not wait out its busy timeout where waiting could deadlock) is waited out; any
other failure, and a lock held past the timeout, is a clear error naming the file."""

from __future__ import annotations

import sqlite3

import pytest

from torchhal.evaluation import store as store_module
from torchhal.evaluation.store import SampleStore
from torchhal.hal_core import ConfigurationError


def _open_failing(monkeypatch, errors):
    """Make the first len(errors) opening attempts raise those errors; count every attempt."""
    attempts = []
    real_open = store_module._open

    def flaky(path, timeout_s):
        attempts.append(path)
        if len(attempts) <= len(errors):
            raise errors[len(attempts) - 1]
        return real_open(path, timeout_s)

    monkeypatch.setattr(store_module, "_open", flaky)
    return attempts


def test_a_file_locked_while_opening_is_tried_again(monkeypatch, tmp_path):
    locked = [sqlite3.OperationalError("database is locked")] * 3
    attempts = _open_failing(monkeypatch, locked)
    with SampleStore(tmp_path / "samples.sqlite") as store:
        store.put("e", "v", "k", {"x": 1.5})
        assert store.get("e", "v", "k") == {"x": 1.5}
    assert len(attempts) == 4


def test_other_failures_are_not_tried_again(monkeypatch, tmp_path):
    attempts = _open_failing(monkeypatch, [sqlite3.OperationalError("disk I/O error")])
    with pytest.raises(ConfigurationError, match=r"samples\.sqlite: not a usable sqlite file: disk I/O"):
        SampleStore(tmp_path / "samples.sqlite")
    assert len(attempts) == 1


def test_a_lock_held_past_the_timeout_is_an_error(monkeypatch, tmp_path):
    _open_failing(monkeypatch, [sqlite3.OperationalError("database is locked")] * 1000)
    with pytest.raises(ConfigurationError, match="not a usable sqlite file: database is locked"):
        SampleStore(tmp_path / "samples.sqlite", timeout_s=0.05)


def test_a_file_that_is_not_sqlite_is_refused(tmp_path):
    path = tmp_path / "samples.sqlite"
    path.write_bytes(b"not a database, " * 64)
    with pytest.raises(ConfigurationError, match="not a usable sqlite file"):
        SampleStore(path)
