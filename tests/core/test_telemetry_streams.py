"""Log streams torchhal writes to as it finds them: no sys.stderr at all, falsy or flush-less
streams, full non-blocking pipes, signal handlers that log, encodings that cannot be escaped to,
and the logger/stream pairing under concurrent lines."""

from __future__ import annotations

import io
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from torchhal.hal_core import ConfigurationError, telemetry

DROPPED = "torchhal.log.lines_dropped"


def _dropped() -> int:
    return telemetry.counts().get(DROPPED, 0)


def test_no_sys_stderr_drops_lines_and_writes_nothing_to_stdout() -> None:
    """With fd 2 closed (`app 2>&-`, pythonw, a Windows service) sys.stderr is None: every log line
    raised AttributeError out of the user's call. Nothing may go to stdout, the program's data."""
    token = secrets.token_hex(8)
    code = (
        "import sys\n"
        "assert sys.stderr is None, sys.stderr\n"
        "from torchhal.hal_core import telemetry\n"
        f"telemetry.get_logger('test.streams21').warning({token!r})\n"
        "print(telemetry.counts().get('torchhal.log.lines_dropped'))\n"
    )
    env = {**os.environ, "TORCHHAL_LOG_LEVEL": "warning"}
    done = subprocess.run(
        ["sh", "-c", 'exec "$0" -c "$1" 2>&-', sys.executable, code],
        stdout=subprocess.PIPE,
        env=env,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stdout.decode()) == (0, "1\n")


class _FalsyStream(list[str]):
    """A stream whose len() is 0 until written: `log_stream or sys.stderr` passed it over."""

    def write(self, text: str) -> int:
        self.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_falsy_log_stream_gets_its_lines(capfd: pytest.CaptureFixture[str]) -> None:
    stream = _FalsyStream()
    telemetry.configure(log_stream=stream)
    line = secrets.token_hex(8)
    telemetry.get_logger("test.streams21").warning(line)
    assert line in "".join(stream)
    assert line not in capfd.readouterr().err


class _WriteOnly:
    """A sys.stderr replacement with write only (a minimal tee): flush raised AttributeError on
    every line."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        self.lines.append(text)
        return len(text)


def test_a_stderr_without_flush_is_written(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _WriteOnly()
    monkeypatch.setattr(sys, "stderr", stream)
    line = secrets.token_hex(8)
    telemetry.get_logger("test.streams21").warning(line)
    assert [text for text in stream.lines if line in text] != []


def test_configure_takes_a_stream_without_flush() -> None:
    """logging.StreamHandler takes a stream without flush, and torchhal's writer does too. Fails
    before: configure refused it ("callable write and flush")."""
    stream = _WriteOnly()
    telemetry.configure(log_level="warning", log_stream=stream)
    line = secrets.token_hex(8)
    telemetry.get_logger("test.streams22").warning(line)
    assert [text for text in stream.lines if line in text] != []


def test_configure_refuses_a_stream_without_write() -> None:
    with pytest.raises(ConfigurationError, match=r"log_stream must be a text stream \(a callable write\)"):
        telemetry.configure(log_stream=object())


class _PartialOnce(io.StringIO):
    """A full non-blocking pipe under a buffered writer: the `nth` write takes only its first
    `taken` characters and raises BlockingIOError saying so."""

    def __init__(self, nth: int, taken: int) -> None:
        super().__init__()
        self.writes, self.nth, self.taken = 0, nth, taken

    def write(self, text: str) -> int:
        self.writes += 1
        if self.writes == self.nth:
            super().write(text[: self.taken])
            raise BlockingIOError(11, "write could not complete without blocking", self.taken)
        return super().write(text)


def test_a_line_partly_written_leaves_a_fragment_and_the_next_line_whole() -> None:
    """The line after a fragment was fused onto it (both malformed), and the torn line counted."""
    lines = [secrets.token_hex(8) for _ in range(3)]
    log = telemetry.get_logger("test.streams21")
    plain = io.StringIO()
    telemetry.configure(log_stream=plain)
    log.warning(lines[1])  # a line as long as the torn one will be
    taken = int.from_bytes(os.urandom(2), "little") % (len(plain.getvalue()) - 2) + 1
    stream = _PartialOnce(nth=2, taken=taken)
    telemetry.configure(log_stream=stream)
    before = _dropped()
    for line in lines:
        log.warning(line)
    written = stream.getvalue().split("\n")
    assert len(written) == 4 and lines[0] in written[0] and lines[2] in written[2] and written[3] == ""
    assert len(written[1]) == taken  # the fragment alone on its line
    assert _dropped() - before == 1


class _FlushBlocksOnce(io.StringIO):
    """A buffered stream whose first flush with data in it would block: the data stays held."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = self.blocked = False

    def write(self, text: str) -> int:
        self.holding = True
        return super().write(text)

    def flush(self) -> None:
        if self.holding and not self.blocked:
            self.blocked = True
            raise BlockingIOError(11, "Resource temporarily unavailable")
        self.holding = False


def test_a_flush_that_would_block_keeps_the_line_and_does_not_count_it() -> None:
    stream = _FlushBlocksOnce()
    telemetry.configure(log_stream=stream)
    log = telemetry.get_logger("test.streams21")
    before = _dropped()
    lines = [secrets.token_hex(8) for _ in range(2)]
    for line in lines:
        log.warning(line)
    assert stream.blocked and all(line in stream.getvalue() for line in lines)
    assert _dropped() == before


@pytest.mark.skipif(not hasattr(__import__("fcntl"), "F_SETPIPE_SZ"), reason="Linux pipe sizes")
def test_a_full_non_blocking_pipe_loses_only_lines_it_counts() -> None:
    """A line-buffered text stream on a non-blocking pipe (stderr to a slow log shipper): lines
    counted dropped arrived later, and a line was fused onto a fragment of another."""
    import fcntl

    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETFL, fcntl.fcntl(write_end, fcntl.F_GETFL) | os.O_NONBLOCK)
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    os.set_blocking(read_end, False)  # read what there is, without waiting for more
    received = b""
    with open(write_end, "w", buffering=1) as stream, open(read_end, "rb", buffering=0) as reader:
        telemetry.configure(log_stream=stream, log_format="json")
        log = telemetry.get_logger("test.streams21")
        before = _dropped()
        logged = 0
        for burst in (60, 3, 3):  # the pipe fills in the first; drained before the others
            for _ in range(burst):
                log.warning(
                    "line", i=logged, pad=secrets.token_hex(int.from_bytes(os.urandom(1), "little") + 1)
                )
                logged += 1
            received += reader.read(1 << 20) or b""
        stream.flush()
        received += reader.read(1 << 20) or b""
        dropped = _dropped() - before
    arrived = [json.loads(line)["i"] for line in received.decode().splitlines()]
    assert dropped > 0  # the pipe did fill
    assert sorted(arrived) == arrived and len(arrived) + dropped == logged
    assert arrived[-3:] == [logged - 3, logged - 2, logged - 1]


def test_a_signal_handler_that_logs_during_a_write_does_not_deadlock() -> None:
    """A handler (SIGTERM: save a checkpoint, log it) runs in the thread it interrupted, maybe in
    the middle of that thread's log write: the non-reentrant lock hung the process."""
    handled = threading.Event()
    log = telemetry.get_logger("test.streams21")
    inner = secrets.token_hex(8)

    class SlowStream(io.StringIO):  # a blocking pipe that takes a while
        def write(self, text: str) -> int:
            if not handled.is_set():
                threading.Timer(
                    0.05, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1)
                ).start()
                deadline = time.monotonic() + 5
                while not handled.is_set() and time.monotonic() < deadline:
                    time.sleep(0.01)
            return super().write(text)

    def on_signal(signum: int, frame: Any) -> None:
        handled.set()
        log.warning(inner)

    def on_watchdog(signum: int, frame: Any) -> None:
        pytest.fail("the signal handler's log line hung")  # not an OSError: the stream's to handle

    stream = SlowStream()
    telemetry.configure(log_stream=stream)
    old = signal.signal(signal.SIGUSR1, on_signal), signal.signal(signal.SIGUSR2, on_watchdog)
    watchdog = threading.Timer(3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR2))
    watchdog.start()
    try:
        outer = secrets.token_hex(8)
        log.warning(outer)
    finally:
        watchdog.cancel()
        signal.signal(signal.SIGUSR1, old[0])
        signal.signal(signal.SIGUSR2, old[1])
    assert handled.is_set() and inner in stream.getvalue() and outer in stream.getvalue()


class _Encoded(io.StringIO):
    """A stream that says `encoding` and writes ASCII underneath (a tee to an ASCII file)."""

    def __init__(self, encoding: str) -> None:
        super().__init__()
        self._said = encoding

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._said

    def write(self, text: str) -> int:
        text.encode("ascii")
        return super().write(text)


@pytest.mark.parametrize("encoding", ["no-such-codec", "utf-8"])
def test_a_line_that_cannot_be_escaped_is_dropped_and_the_stream_kept(encoding: str) -> None:
    """The escaping fallback raised LookupError (an encoding Python lacks) or UnicodeEncodeError
    (a stream whose encoding says utf-8 and writes ASCII) out of the user's call."""
    stream = _Encoded(encoding)
    telemetry.configure(log_stream=stream)
    log = telemetry.get_logger("test.streams21")
    before = _dropped()
    lost = f"Ger\u00e4t-{secrets.token_hex(4)}"
    log.warning(lost)
    after = secrets.token_hex(8)
    log.warning(after)
    assert lost not in stream.getvalue() and after in stream.getvalue()
    assert _dropped() - before == 1


class _SwitchingLogger(telemetry._Logger):
    """Another thread's line, run where a thread switch may come: just after this logger stored
    the structlog logger for its line's stream."""

    def __init__(self, name: str, other: Any, back: Any) -> None:
        self.switch: tuple[Any, Any] | None = None
        super().__init__(name)
        self.switch = (other, back)

    def __setattr__(self, attribute: str, value: Any) -> None:
        super().__setattr__(attribute, value)
        switch = getattr(self, "switch", None)
        if switch is not None and value is not None and attribute != "switch":
            self.switch = None
            sys.stderr = switch[0]  # another thread's line, while a redirect_stderr was on
            self.warning("other thread")
            sys.stderr = switch[1]


def test_a_logger_never_writes_to_a_stream_other_than_its_line_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """Logger and stream in two attributes: a line between their two stores paired the logger of
    one stream with the other, and later lines to sys.stderr went to a finished redirect's."""
    mine, redirected = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", mine)
    log = _SwitchingLogger("test.streams21", redirected, mine)
    lines = [secrets.token_hex(8) for _ in range(2)]
    for line in lines:
        log.warning(line)
    assert all(line in mine.getvalue() and line not in redirected.getvalue() for line in lines)
    assert "other thread" in redirected.getvalue()


@pytest.mark.parametrize("method", ["critical", "fatal"])
def test_structlog_critical_lines_are_written(method: str) -> None:
    stream = io.StringIO()
    line = secrets.token_hex(8)
    getattr(telemetry._make_structlog("test.streams21", stream), method)(line)
    assert line in stream.getvalue() and "critical" in stream.getvalue()
