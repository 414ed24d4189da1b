"""The entry point `simasic` (group `torchhal.adapters`): hands each HAL its own adapter."""

from __future__ import annotations

from torchhal.hal_core import VendorAdapter, hookimpl

from torchhal_simasic.adapter import SimASICAdapter


@hookimpl
def torchhal_adapters() -> list[VendorAdapter]:
    """A fresh adapter per HAL, so each HAL simulates its own machine (clocks and ledgers)."""
    return [SimASICAdapter()]
