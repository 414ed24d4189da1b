"""Fixtures for the simulated ASIC: a tiny spec whose costs are easy to work out by hand, and
HALs built on it with plugin autoload off (so the installed `simasic` entry point stays out)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from torchhal_simasic.adapter import SimASICAdapter
from torchhal_simasic.spec import DEVICES_ENV, SPEC_ENV, SimASICSpec, parse_spec

import torchhal
from tests.simasic.tiny import TINY
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core.settings import Settings


@pytest.fixture(autouse=True)
def _no_simasic_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests choose their spec explicitly; the caller's TORCHHAL_SIMASIC_* must not leak in."""
    monkeypatch.delenv(SPEC_ENV, raising=False)
    monkeypatch.delenv(DEVICES_ENV, raising=False)


@pytest.fixture
def tiny() -> Callable[..., SimASICSpec]:
    """The tiny spec, with fields replaced by keyword (validated like a spec file)."""

    def make(**changes: Any) -> SimASICSpec:
        return parse_spec({**TINY, **changes}, "test")

    return make


@pytest.fixture
def sim_hal(tiny: Callable[..., SimASICSpec]) -> Iterator[Callable[..., HardwareAbstractionLayer]]:
    """A HAL over a SimASICAdapter of the given spec (default: tiny), also the ops' default HAL."""

    def make(spec: SimASICSpec | None = None) -> HardwareAbstractionLayer:
        hal = HardwareAbstractionLayer(
            adapters=[SimASICAdapter(spec or tiny())],
            settings=Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"}),
        )
        torchhal.ops.set_default_hal(hal)
        return hal

    yield make
    torchhal.ops.set_default_hal(None)
