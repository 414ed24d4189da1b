"""`torchhal` writing into pipes whose reader has exited (`torchhal info 2>&1 | head -1`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _reader_gone() -> int:
    """The write end of a pipe whose read end is closed: every write to it fails with EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    return write_end


def _env(tmp_path: Path, level: str) -> dict[str, str]:
    return {**os.environ, "TORCHHAL_CACHE_DIR": str(tmp_path / "cache"), "TORCHHAL_LOG_LEVEL": level}


def test_info_with_its_log_pipe_gone_still_prints_its_report(tmp_path: Path) -> None:
    """The first debug line's BrokenPipeError ended discovery: exit 1, and no report on stdout."""
    stderr = _reader_gone()
    with open(tmp_path / "out.txt", "w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "torchhal", "info"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=stderr,
            timeout=120,
            env=_env(tmp_path, "debug"),
        )
    os.close(stderr)
    assert done.returncode == 0
    report = (tmp_path / "out.txt").read_text()
    assert "Devices" in report and "Plugins and adapters" in report


def test_info_into_a_pipe_whose_reader_exited_ends_quietly(tmp_path: Path) -> None:
    """`torchhal info | head -1`: exit status 1 without a traceback, as Python's own tools do."""
    stdout = _reader_gone()
    done = subprocess.run(
        [sys.executable, "-m", "torchhal", "info"],
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        env=_env(tmp_path, "warning"),
    )
    os.close(stdout)
    assert done.returncode == 1
    assert done.stderr == ""
