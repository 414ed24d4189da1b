"""pluggy hook specifications for project "torchhal" (entry-point group `torchhal.adapters`).

A plugin module implements one or both hooks with `@hookimpl`. The core's built-in kernels
use `torchhal_register_kernels` exactly as a third-party kernel plugin would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from torchhal.hal_core.adapter import VendorAdapter
    from torchhal.hal_core.kernels import KernelRegistry

PROJECT = "torchhal"
ENTRY_POINT_GROUP = "torchhal.adapters"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def torchhal_adapters() -> Sequence[VendorAdapter]:  # type: ignore[empty-body]
    """Return this plugin's adapter instances, a list or tuple (anything else, None included, refuses
    the plugin). Construct them cheaply: no device work here."""


@hookspec
def torchhal_register_kernels(registry: KernelRegistry) -> None:
    """Define ops or add device-independent kernel candidates to `registry`.

    Called once per HAL, all or nothing: a hook that raises leaves no op or candidate behind. One
    that attaches to an op another plugin defines, before that plugin ran (`UnknownOpError`), is
    called again after the others: keep side effects other than registrations out of it."""
