"""Production operation: console tracebacks, failing log streams, and the shared on-disk cache
(read-only lock files, temporary files of killed writers)."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog  # noqa: F401  imported before any fork: the user a child becomes may not read it

from torchhal.hal_core import profile, telemetry

NOBODY = 65534  # the unprivileged user and group of Debian-like systems


def logging_to(stream: Any) -> Any:
    """torchhal's log lines to `stream`, and this module's logger."""
    telemetry.configure(log_stream=stream)
    return telemetry.get_logger("test.production21")


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
    log = logging_to(stream)
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


def _non_ascii_name() -> str:
    """a-umlaut is in cp1252, Omega in UTF-8 only, a lone surrogate (a file name's byte that is not
    UTF-8, as os.fsdecode gives it) in no encoding."""
    return f"Ger\u00e4t-\u03a9-\udcff-{secrets.token_hex(4)}"


@pytest.mark.parametrize("encoding", ["ascii", "cp1252", "utf-8"])
def test_characters_the_log_stream_cannot_encode_are_escaped_not_raised(encoding: str) -> None:
    """A stream in ASCII or Windows' cp1252 raised UnicodeEncodeError out of the user's call."""
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding=encoding)
    telemetry.configure(log_stream=stream)
    name = _non_ascii_name()
    before = telemetry.counts().get("torchhal.log.lines_dropped", 0)
    telemetry.get_logger("test.production21").warning("device", name=name)
    written = raw.getvalue().decode(encoding)
    assert f"name={name.encode(encoding, 'backslashreplace').decode(encoding)}" in written
    assert telemetry.counts().get("torchhal.log.lines_dropped", 0) == before


class _EagainOnce(io.StringIO):
    """A non-blocking pipe that is full once: its first write fails with EAGAIN."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        if self.writes == 1:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return super().write(text)


def test_a_write_that_would_block_drops_that_line_only(capfd: pytest.CaptureFixture[str]) -> None:
    stream = _EagainOnce()
    log = logging_to(stream)
    before = telemetry.counts().get("torchhal.log.lines_dropped", 0)
    lines = [secrets.token_hex(8) for _ in range(3)]
    for line in lines:
        log.warning(line)
    written = stream.getvalue()
    assert lines[0] not in written and lines[1] in written and lines[2] in written
    assert telemetry.counts()["torchhal.log.lines_dropped"] - before == 1
    assert "log lines to it are dropped" not in capfd.readouterr().err  # the stream did not fail


class _Unprintable:
    def __repr__(self) -> str:
        raise OSError("the value's own repr failed")


def test_an_error_rendering_a_value_is_the_callers_and_the_stream_stays(
    capfd: pytest.CaptureFixture[str],
) -> None:
    stream = io.StringIO()
    log = logging_to(stream)
    with pytest.raises(OSError, match="the value's own repr failed"):
        log.warning("first", value=_Unprintable())
    after = secrets.token_hex(8)
    log.warning(after)
    assert after in stream.getvalue()
    assert "log lines to it are dropped" not in capfd.readouterr().err


class _BreakableStream:
    """A stream that fails while `broken`, whose type takes no weak references (structlog's
    PrintLogger needed them)."""

    __slots__ = ("broken", "lines")

    def __init__(self) -> None:
        self.broken = False
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        if self.broken:
            raise OSError(32, "Broken pipe")
        self.lines.append(text)
        return len(text)

    def flush(self) -> None:
        pass


class _BreakableFile(_BreakableStream):
    """The same, taking weak references as io's streams do."""


def test_a_failed_log_stream_given_again_is_written_again() -> None:
    stream = _BreakableFile()
    log = logging_to(stream)
    stream.broken = True
    log.warning("lost")
    stream.broken = False
    log.warning("still dropped")
    assert stream.lines == []
    telemetry.configure(log_stream=stream)  # the user says it works again
    line = secrets.token_hex(8)
    log.warning(line)
    assert line in "".join(stream.lines)


def test_a_failed_log_stream_is_not_kept_alive() -> None:
    """A dead pipe's wrapper (and its fd) stayed referenced until reset(): for the process's life."""
    stream = io.StringIO()
    log = logging_to(stream)
    stream.close()
    log.warning("fails the stream")
    gone = weakref.ref(stream)
    telemetry.configure(log_stream=io.StringIO())
    del stream
    gc.collect()
    assert gone() is None


def test_a_stream_without_weak_references_is_written_and_when_failed_written_no_more() -> None:
    stream = _BreakableStream()
    log = logging_to(stream)
    line = secrets.token_hex(8)
    log.warning(line)  # raised TypeError: cannot create weak reference
    assert line in "".join(stream.lines)
    stream.broken = True
    before = telemetry.counts().get("torchhal.log.lines_dropped", 0)
    for _ in range(3):
        log.warning("line")
    stream.broken = False
    log.warning("still dropped")
    assert len(stream.lines) == 1  # nothing after the failure, nor once it works again
    assert telemetry.counts()["torchhal.log.lines_dropped"] - before == 4


@contextlib.contextmanager
def _shared_dir() -> Iterator[Path]:
    """A directory every user may write (tmp_path's parents are root's alone, 0700)."""
    directory = Path(tempfile.mkdtemp(prefix="torchhal-shared-"))
    directory.chmod(0o777)
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


def _in_child_as_another_user(work: Callable[[], bool]) -> tuple[int, int, int]:
    """(pid, go, started): a forked child that runs `work()` once a byte is written to `go`, with
    the permissions of a user other than the lock file's owner, and writes a byte to `started`
    just before. As root it becomes nobody (root opens any file for writing, so a read-only lock
    file would test nothing); otherwise it stays this user, and the lock file's 0444 is what stops
    it. Its exit status is 0 where `work()` returned True. Forked before the parent locks: a child
    forked holding a copy of the locked file would hold the lock itself."""
    wait_end, go = os.pipe()
    started, say_started = os.pipe()
    pid = os.fork()
    if pid:
        os.close(wait_end)
        os.close(say_started)
        return pid, go, started
    code = 2
    try:
        os.close(go)
        os.close(started)
        if os.geteuid() == 0:
            os.setgid(NOBODY)
            os.setgroups([])
            os.setuid(NOBODY)
        os.read(wait_end, 1)
        os.write(say_started, b"!")
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
        pid, go, started = _in_child_as_another_user(lambda: profile.update_cached(path, lambda: text))
        early = (0, 0)  # waitpid's answer while the parent held the lock: (0, 0) is "running"
        try:
            with profile._exclusive(lock):  # this process holds the lock: the child must wait
                os.write(go, b"!")
                # the child is at update_cached: without this, a slow fork had not reached flock
                # within the sleep, and the test passed whether the lock held or not
                assert os.read(started, 1) == b"!"
                time.sleep(0.5)
                written_while_locked = path.exists()
                early = os.waitpid(pid, os.WNOHANG)
        finally:
            os.close(go)  # the child goes on (and ends) whatever happened here
            os.close(started)
            status = early[1] if early[0] else _wait_for(pid, timeout_s=60)
        assert early == (0, 0)  # still waiting on the lock when the parent let go
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


def test_a_fifo_where_the_lock_file_goes_is_a_write_not_done_not_a_hang() -> None:
    """The read-only open of another user's lock file waited for a writer on a FIFO: forever."""
    with _shared_dir() as directory:
        path = directory / "device.json"
        lock = directory / "device.json.lock"
        os.mkfifo(lock)
        lock.chmod(0o444)  # this user (or nobody) may not open it for writing: the read-only path

        def work() -> bool:
            logged = io.StringIO()
            telemetry.configure(log_stream=logged)
            before = telemetry.counts().get("torchhal.cache.write_failures", 0)
            written = profile.update_cached(path, lambda: "{}")
            return (
                not written
                and telemetry.counts()["torchhal.cache.write_failures"] - before == 1
                and f"lock file {str(lock)!r} is not a regular file" in logged.getvalue()
            )

        pid, go, started = _in_child_as_another_user(work)
        try:
            os.write(go, b"!")
        finally:
            os.close(go)
            status = _wait_for(pid, timeout_s=30)
            os.close(started)  # only now: the child's write to it would fail on a closed pipe
        assert os.waitstatus_to_exitcode(status) == 0
        assert not path.exists()
