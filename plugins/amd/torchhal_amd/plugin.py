"""The entry point `amd` (group `torchhal.adapters`): hands each HAL its own adapter."""

from __future__ import annotations

from torchhal.hal_core import VendorAdapter, hookimpl

from torchhal_amd.adapter import AmdAdapter


@hookimpl
def torchhal_adapters() -> list[VendorAdapter]:
    """A fresh adapter over the live ROCm runtime; constructing it does no device work."""
    return [AmdAdapter()]
