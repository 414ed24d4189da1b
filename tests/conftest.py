"""Shared fixtures: a fresh HAL per test, and telemetry reset to its unconfigured state."""

from __future__ import annotations

import pytest

from torchhal.hal_core import telemetry


@pytest.fixture(autouse=True)
def _unconfigured_telemetry():
    yield
    telemetry.reset()
