"""The entry point `nvidia` (group `torchhal.adapters`): hands each HAL its own adapter."""

from __future__ import annotations

from torchhal.hal_core import VendorAdapter, hookimpl

from torchhal_nvidia.adapter import NvidiaAdapter


@hookimpl
def torchhal_adapters() -> list[VendorAdapter]:
    """A fresh adapter over the live CUDA runtime; constructing it does no device work."""
    return [NvidiaAdapter()]
