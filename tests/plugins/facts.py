"""Recorded device facts (tests/fixtures/probes) and the nvidia-smi capture, loaded fresh per test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PROBES = FIXTURES / "probes"
SMI_CAPTURE = FIXTURES / "topology" / "nvidia-h200x2-nvidia-smi-topo.txt"


def load(name: str) -> dict[str, Any]:
    """A fresh copy of a fixture's facts, so a test may change them without affecting others."""
    return json.loads((PROBES / f"{name}.json").read_text())


def count(key: str) -> int:
    """An in-process telemetry counter, 0 when it has not been incremented yet."""
    from torchhal.hal_core import telemetry

    return telemetry.counts().get(key, 0)
