"""Production operation: console tracebacks, failing log streams, and the shared on-disk cache
(read-only lock files, temporary files of killed writers)."""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from torchhal.hal_core import profile, telemetry

NOBODY = 65534  # the unprivileged user and group of Debian-like systems


def _raise_holding(secret: str, message: str) -> None:
    headers = {"Authorization": f"Bearer {secret}"}  # a local whose value must not reach the log
    raise RuntimeError(f"{message} ({len(headers)} header)")


def test_console_traceback_is_full_and_shows_no_locals() -> None:
    stream = io.StringIO()
    telemetry.configure(log_format="console", log_stream=stream)
    secret, message = secrets.token_hex(16), f"broke-{secrets.token_hex(8)}"
    try:
        _raise_holding(secret, message)
    except RuntimeError:
        telemetry.get_logger("test.production21").error("op failed", exc_info=True)
    out = stream.getvalue()
    assert "Traceback (most recent call last)" in out
    assert f"RuntimeError: {message} (1 header)" in out
    assert "_raise_holding" in out  # every frame is still there
    assert secret not in out


def test_log_stream_closed_under_the_logger_drops_lines_and_says_so_once(
    capfd: pytest.CaptureFixture[str],
) -> None:
    stream = io.StringIO()
    telemetry.configure(log_stream=stream)
    log = telemetry.get_logger("test.production21")
    log.warning("first")
    assert "first" in stream.getvalue()
    stream.close()
    before = telemetry.counts().get("torchhal.log.lines_dropped", 0)
    log.warning("second")  # raised ValueError out of the caller
    log.warning("third")
    assert telemetry.counts()["torchhal.log.lines_dropped"] - before == 2
    notices = [line for line in capfd.readouterr().err.splitlines() if "log lines to it are dropped" in line]
    assert len(notices) == 1 and "I/O operation on closed file" in notices[0]
    fresh = io.StringIO()
    telemetry.configure(log_stream=fresh)  # another stream is written again
    log.warning("fourth")
    assert "fourth" in fresh.getvalue()


def test_stderr_a_pipe_whose_reader_exited_does_not_break_a_library_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)
    # unbuffered: a failed write leaves nothing behind for close() to fail on again
    with io.TextIOWrapper(open(write_end, "wb", buffering=0), write_through=True) as broken:
        monkeypatch.setattr(sys, "stderr", broken)
        (tmp_path / "file").write_text("a file, not a directory")
        counts = telemetry.counts()
        # a cache that cannot be written logs a warning: that write raised BrokenPipeError
        assert profile.write_cached(tmp_path / "file" / "x.json", "{}") is False
        assert profile.write_cached(tmp_path / "file" / "y.json", "{}") is False
        monkeypatch.setattr(sys, "stderr", sys.__stderr__)
    after = telemetry.counts()
    for name in ("torchhal.cache.write_failures", "torchhal.log.lines_dropped"):
        assert after[name] - counts.get(name, 0) == 2, name


@contextlib.contextmanager
def _shared_dir() -> Iterator[Path]:
    """A directory every user may write (tmp_path's parents are root's alone, 0700)."""
    directory = Path(tempfile.mkdtemp(prefix="torchhal-shared-"))
    directory.chmod(0o777)
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


def _in_child_as_another_user(work: Callable[[], bool]) -> tuple[int, int]:
    """(pid, go): a forked child that runs `work()` once a byte is written to `go`, with the
    permissions of a user other than the lock file's owner. As root it becomes nobody (root opens
    any file for writing, so a read-only lock file would test nothing); otherwise it stays this
    user, and the lock file's 0444 is what stops it. Its exit status is 0 where `work()` returned
    True. Forked before the parent locks: a child forked holding a copy of the locked file would
    hold the lock itself."""
    wait_end, go = os.pipe()
    pid = os.fork()
    if pid:
        os.close(wait_end)
        return pid, go
    code = 2
    try:
        os.close(go)
        if os.geteuid() == 0:
            os.setgid(NOBODY)
            os.setgroups([])
            os.setuid(NOBODY)
        os.read(wait_end, 1)
        code = 0 if work() else 1
    finally:
        os._exit(code)


def _wait_for(pid: int, timeout_s: float) -> int:
    """The child's wait status, or a failure naming why after `timeout_s`: a child forked from
    this multi-threaded process could hang on a lock another thread held at the fork."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked writer had not finished after {timeout_s} s (a lock held at the fork?)")
        time.sleep(0.02)


def test_a_lock_file_this_user_may_not_write_still_locks_and_the_cache_is_written() -> None:
    with _shared_dir() as directory:
        path = directory / "selections" / "device.json"
        path.parent.mkdir()
        path.parent.chmod(0o777)
        lock = path.with_name("device.json.lock")
        lock.touch()
        lock.chmod(0o444)  # another user's, made under umask 022 (0644): read-only to this one
        text = secrets.token_hex(16)
        pid, go = _in_child_as_another_user(lambda: profile.update_cached(path, lambda: text))
        try:
            with profile._exclusive(lock):  # this process holds the lock: the child must wait
                os.write(go, b"!")
                time.sleep(0.5)
                written_while_locked = path.exists()
        finally:
            os.close(go)  # the child goes on (and ends) whatever happened here
            status = _wait_for(pid, timeout_s=60)
        assert not written_while_locked  # it waited on the lock it took through a read-only file
        assert os.waitstatus_to_exitcode(status) == 0  # was 1: PermissionError opening the lock
        assert path.read_text() == text


def test_writes_remove_stale_temporary_files_of_killed_writers_only(tmp_path: Path) -> None:
    old = time.time() - 2 * 3600  # past the hour a writer may take, by far
    stale = tmp_path / f".other.json.{secrets.token_hex(8)}.tmp"  # any cache file's, killed
    fresh = tmp_path / f".mine.json.{secrets.token_hex(8)}.tmp"  # a writer still writing
    not_ours = [tmp_path / ".notes.tmp", tmp_path / "keep.json", tmp_path / ".x.json.zz.tmp"]
    for made in (stale, fresh, *not_ours):
        made.write_text(secrets.token_hex(8))
    for aged in (stale, *not_ours):
        os.utime(aged, (old, old))
    before = telemetry.counts().get("torchhal.cache.stale_temps_removed", 0)
    assert profile.write_cached(tmp_path / "mine.json", "{}")
    assert not stale.exists()
    assert fresh.exists() and all(p.exists() for p in not_ours)
    assert telemetry.counts()["torchhal.cache.stale_temps_removed"] - before == 1
