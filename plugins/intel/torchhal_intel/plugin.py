"""The entry point `intel` (group `torchhal.adapters`): hands each HAL its own adapter."""

from __future__ import annotations

from torchhal.hal_core import VendorAdapter, hookimpl

from torchhal_intel.adapter import IntelAdapter


@hookimpl
def torchhal_adapters() -> list[VendorAdapter]:
    """A fresh adapter over the live XPU runtime; constructing it does no device work."""
    return [IntelAdapter()]
