"""Fixtures that install throwaway plugin distributions on sys.path (no pip needed)."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from torchhal.hal_core.settings import Settings


@pytest.fixture
def plugin_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], str]:
    """Make a distribution named torchhal-test-<name> whose entry point <name> is module <name>_mod."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    made: list[str] = []

    def make(name: str, source: str) -> str:
        module = f"{name}_mod"
        (root / f"{module}.py").write_text(textwrap.dedent(source))
        info = root / f"torchhal_test_{name}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchhal-test-{name}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[torchhal.adapters]\n{name} = {module}\n")
        importlib.invalidate_caches()
        made.append(module)
        return module

    yield make
    for module in made:
        sys.modules.pop(module, None)


@pytest.fixture
def settings() -> Callable[..., Settings]:
    """Settings from an explicit environment, isolated from the caller's TORCHHAL_* variables."""

    def make(**env: str) -> Settings:
        return Settings.from_env({f"TORCHHAL_{k.upper()}": v for k, v in env.items()})

    return make
