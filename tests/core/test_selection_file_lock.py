"""The selection file's lock on a filesystem that has none."""

from __future__ import annotations

import errno
import json
import random
import sys
from pathlib import Path

import pytest

from tests.core._tuning_worker import CODE, key
from tests.core.adapters import FakeAdapter, fake_caps
from torchhal.hal_core import profile, telemetry
from torchhal.hal_core.device import Device
from torchhal.hal_core.tuning import Tuner


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX's")
@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP])
def test_a_cache_on_a_filesystem_without_locks_is_still_written(tmp_path, monkeypatch, capsys, code):
    """NFS without a lock daemon answers flock with ENOLCK, Lustre mounted without `flock` with
    ENOSYS: every winner was then 'not written', where before the lock it was written (best
    effort). Without locks the merge is the unlocked one it was, said once and counted."""

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(code, "no locks on this filesystem")

    monkeypatch.setattr(profile.fcntl, "flock", no_locks)
    telemetry.configure(log_format="json")
    before = dict(telemetry.counts())
    capsys.readouterr()
    device = Device(FakeAdapter(), fake_caps())
    count = random.randint(2, 5)
    for i in range(count):
        Tuner(Path(tmp_path), "on", code=lambda: CODE).remember(
            device, "rms_norm", (0, i), "test/w0", ["test/w0", "torchhal/aten"]
        )

    (path,) = (tmp_path / "selections").glob("*.json")
    assert set(json.loads(path.read_text())["winners"]) == {key(0, i) for i in range(count)}
    counts = telemetry.counts()
    assert (
        counts.get("torchhal.cache.unlocked_writes", 0)
        == before.get("torchhal.cache.unlocked_writes", 0) + count
    )
    assert counts.get("torchhal.cache.write_failures", 0) == before.get("torchhal.cache.write_failures", 0)
    lines = [json.loads(raw) for raw in capsys.readouterr().err.splitlines() if raw.startswith("{")]
    warned = [x for x in lines if x["event"].startswith("cache file merged without a lock")]
    assert len(warned) == 1 and str(tmp_path / "selections") in warned[0]["directory"]


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX's")
def test_a_lock_that_fails_otherwise_is_still_a_file_not_written(tmp_path, monkeypatch):
    """Only 'this filesystem has no locks' falls back; an interrupted or refused lock does not."""

    def refused(fd: int, operation: int) -> None:
        raise OSError(errno.EACCES, "refused")

    monkeypatch.setattr(profile.fcntl, "flock", refused)
    before = telemetry.counts().get("torchhal.cache.write_failures", 0)
    target = tmp_path / "x.json"
    assert profile.update_cached(target, lambda: "{}") is False
    assert not target.exists()
    assert telemetry.counts().get("torchhal.cache.write_failures", 0) == before + 1
