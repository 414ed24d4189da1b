"""Shared pieces of the evaluation tests: HALs with a known device set, callables of known cost.

Module-level functions here are also what the CLI tests' spec files name as `callable`s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torchhal_simasic.adapter import SimASICAdapter
from torchhal_simasic.spec import SimASICSpec, bundled_spec

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core.settings import Settings

NO_AUTOLOAD = {"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"}


def cpu_hal() -> HardwareAbstractionLayer:
    """The CPU and the built-in kernels only, whatever plugins are installed."""
    return HardwareAbstractionLayer(settings=Settings.from_env(NO_AUTOLOAD))


def sim_hal(spec: str | SimASICSpec = "edge") -> HardwareAbstractionLayer:
    """The CPU plus one simulated ASIC of a bundled spec (simasic:0)."""
    chosen = bundled_spec(spec) if isinstance(spec, str) else spec
    return HardwareAbstractionLayer(
        adapters=[SimASICAdapter(chosen)], settings=Settings.from_env(NO_AUTOLOAD)
    )


class Counting:
    """Wraps a callable and counts its calls; raises RuntimeError on call `fail_at` (1-based)."""

    def __init__(self, fn: Callable[..., Any], fail_at: int | None = None) -> None:
        self.fn, self.fail_at, self.calls = fn, fail_at, 0
        self.__qualname__ = f"Counting({getattr(fn, '__qualname__', fn)})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise RuntimeError(f"planted failure at call {self.calls}")
        return self.fn(*args, **kwargs)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rms_norm in float64, rounded once: the ground truth the CLI specs compare against."""
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).to(x.dtype)


def rms_norm_slow(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The same result at about 12 times the work: a planted regression."""
    out = rms_norm_reference(x, weight, eps)
    for _ in range(11):
        out = rms_norm_reference(x, weight, eps)
    return out


def broken(*args: Any, **kwargs: Any) -> torch.Tensor:
    """A variant whose code fails: the CLI must report it, not call it a regression."""
    raise RuntimeError("planted failure in a variant")
