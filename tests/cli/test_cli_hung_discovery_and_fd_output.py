"""The `torchhal` command: discovery that hangs under `conformance`, and
--json documents that C code writes into through file descriptor 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = """
import ctypes, os, sys, threading

import torchhal.cli as cli
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core.adapters.cpu import CPUAdapter


class Noisy(CPUAdapter):
    '''A vendor runtime that writes its banner on fd 1 from C when probed.'''

    name = vendor = namespace = "noisy"

    def probe(self):
        os.write(1, b"fd-noise {token}\\n")
        ctypes.CDLL(None).printf(b"c-noise {token}\\n")  # C stdio: buffered while fd 1 is a pipe
        return super().probe()


class Hanging(CPUAdapter):
    '''discover() that never returns (a driver call that waits forever).'''

    name = vendor = namespace = "hanging"

    def discover(self):
        threading.Event().wait()


cli.HardwareAbstractionLayer = lambda: HardwareAbstractionLayer(adapters=[{adapter}()])
sys.argv = ["torchhal", *sys.argv[1:]]
cli.main()
"""


def run_cli(tmp_path: Path, adapter: str, *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """`torchhal ARGS` in a fresh process whose HAL also has `adapter` ("Noisy" or "Hanging")."""
    token = os.urandom(8).hex()
    script = tmp_path / "cli.py"
    script.write_text(textwrap.dedent(SCRIPT.format(adapter=adapter, token=token)))
    env = {**os.environ, "TORCHHAL_CACHE_DIR": str(tmp_path / "cache"), "TORCHHAL_PLUGINS": "simasic"}
    env.pop("PYTHONUNBUFFERED", None)  # it unbuffers C stdio too, which then hides the late printf
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120, env=env
    )
    return done, token


@pytest.mark.parametrize(
    "command",
    [["info", "--json"], ["conformance", "noisy", "--json"], ["profile", "simasic:0", "--json"]],
    ids=["info", "conformance", "profile"],
)
def test_json_documents_survive_writes_to_file_descriptor_1(tmp_path: Path, command: list[str]) -> None:
    """Only Python's sys.stdout went to stderr: a C library's printf or an os.write(1, ...) landed
    in the document (json.loads failed on "fd-noise ..." before it, or "c-noise ..." after it)."""
    done, token = run_cli(tmp_path, "Noisy", *command)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(done.stdout)
    assert isinstance(doc, dict)
    assert f"fd-noise {token}" in done.stderr and f"c-noise {token}" in done.stderr
    assert token not in done.stdout


def test_conformance_fails_when_discovery_hangs_past_the_time_limit(tmp_path: Path) -> None:
    """Discovery (plugin imports, each adapter's probe and discover) ran before the kit with no
    time limit: an adapter whose discover() never returned hung the command for good."""
    done, _ = run_cli(
        tmp_path, "Hanging", "conformance", "hanging", "--discovery-time-limit", "0.5", "--json"
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stdout == ""
    assert (
        "error: conformance: discovery did not finish within the 0.5 s time limit: "
        "stuck in adapter 'hanging''s discover() at "
    ) in done.stderr
    assert "cli.py" in done.stderr and "TORCHHAL_PLUGINS=NAME" in done.stderr


def test_json_with_stdout_closed_is_no_crash(tmp_path: Path) -> None:
    """`torchhal info --json 1>&-`: Python's sys.stdout is None, whose flush raised."""
    env = {**os.environ, "TORCHHAL_CACHE_DIR": str(tmp_path / "cache"), "TORCHHAL_PLUGINS": "simasic"}
    done = subprocess.run(
        ["sh", "-c", 'exec "$0" -m torchhal info --json 1>&-', sys.executable],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
