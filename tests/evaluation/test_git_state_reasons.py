"""The fingerprint's git reason when there is no commit to record: said in words, not as an
exception's repr (report.md read "commit unknown (CalledProcessError: ...)")."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from torchhal.evaluation.fingerprint import git_state

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


@needs_git
def test_outside_a_repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # a repository above stays out
    monkeypatch.setenv("LC_ALL", "C")
    monkeypatch.chdir(tmp_path)
    assert git_state() == {
        "commit": None,
        "dirty": None,
        "reason": "working directory is not in a git repository",
    }
    assert git_state(str(tmp_path))["reason"] == f"{tmp_path} is not in a git repository"


@needs_git
def test_a_repository_without_commits_keeps_gits_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LC_ALL", "C")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    reason = git_state(str(tmp_path))["reason"]
    assert reason.startswith("git rev-parse HEAD exited with 128: fatal: ") and "HEAD" in reason[35:]
    assert "\n" not in reason


def test_without_git_the_error_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no git here
    assert git_state()["reason"].startswith("FileNotFoundError: ")
