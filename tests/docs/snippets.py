"""Code blocks taken from the documents themselves (never copies kept in tests), and the check of
what a snippet computed against the op's reference, for the tests of tests/docs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from torchhal import HardwareAbstractionLayer
from torchhal.testing import tolerance

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "adapter-authoring.md"
USER_GUIDE = ROOT / "docs" / "user-guide.md"


def fenced_blocks(path: Path, language: str = "python") -> list[str]:
    """The ```language blocks of a Markdown file, in order."""
    pattern = rf"^```{re.escape(language)}\n(.*?)^```"
    return re.findall(pattern, path.read_text(encoding="utf-8"), flags=re.S | re.M)


def block_with(path: Path, marker: str, language: str = "python") -> str:
    """The one ```language block of `path` that contains `marker`."""
    found = [block for block in fenced_blocks(path, language) if marker in block]
    assert len(found) == 1, f"{path.name}: {len(found)} {language} blocks contain {marker!r}"
    return found[0]


def assert_matches_reference(hal: HardwareAbstractionLayer, op: str, got: torch.Tensor, *args: Any) -> None:
    """FlashAttention-style: `got` within 2x the error of the op's reference in the same dtype."""
    reference = hal.kernels.op(op).reference
    truth = reference(*(a.double() if isinstance(a, torch.Tensor) else a for a in args))
    result = tolerance.compare(got, reference(*args), truth)
    assert result.ok, f"{op}: {result}"
