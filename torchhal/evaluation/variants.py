"""Builders for the usual kinds of variant: kernel candidates, dtypes, devices, plugin configurations.

Each returns `Variant`s whose input sets are aligned (set i is the same logical input in every
variant), so quality can compare them set by set. Converting inputs to another dtype or
device is what such a variant is about; it is done explicitly, once, before any timing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from torchhal.evaluation.harness import Variant
from torchhal.evaluation.inputs import Inputs
from torchhal.hal_core import Device, InvalidArgumentError, Selection, telemetry
from torchhal.hal_core.hal import HardwareAbstractionLayer

if TYPE_CHECKING:
    from torchhal.hal_core.kernels import Candidate

log = telemetry.get_logger("torchhal.evaluation.variants")


def kernel_variants(
    hal: HardwareAbstractionLayer,
    op: str,
    device: Device,
    inputs: Inputs,
    *,
    candidates: Sequence[str] | None = None,
    items_per_call: float = 1.0,
) -> list[Variant]:
    """One variant per candidate of `op` valid on `device` for these inputs (all of them, or the
    ones named in `candidates`, by name or provider/name). A named candidate the registry
    rejected for these inputs is an error that gives the registry's reason."""
    selection = hal.kernels.select(op, device, *inputs.sets[0], **inputs.kwargs)
    valid = {c.qualified_name: c for c in (selection.candidate, *selection.fallbacks)}
    chosen = (
        list(valid.values()) if candidates is None else [_pick(name, valid, selection) for name in candidates]
    )
    return [
        Variant(
            name=c.qualified_name,
            fn=hal.kernels.bound(c, device),
            device=device,
            inputs=inputs,
            hal=hal,
            items_per_call=items_per_call,
            description=f"kernel {op} {c.qualified_name}",
        )
        for c in chosen
    ]


def dtype_variants(
    fn: Callable[..., Any],
    device: Device,
    inputs: Inputs,
    dtypes: Sequence[torch.dtype],
    *,
    hal: HardwareAbstractionLayer | None = None,
    items_per_call: float = 1.0,
) -> list[Variant]:
    """`fn` with its floating-point inputs converted to each dtype (other tensors as they are)."""
    out = []
    for dtype in dtypes:
        device.require_dtype(dtype, what=f"dtype variant {dtype}")
        converted = inputs.map(_to_dtype(dtype))
        name = str(dtype).removeprefix("torch.")
        out.append(Variant(name, fn, device, converted, hal, items_per_call, f"{_name(fn)} in {name}"))
    return out


def device_variants(
    fn: Callable[..., Any],
    devices: Sequence[Device],
    inputs: Inputs,
    *,
    hal: HardwareAbstractionLayer | None = None,
    items_per_call: float = 1.0,
) -> list[Variant]:
    """`fn` on each device, its inputs copied there with `Device.to_device` (same dtype)."""
    return [
        Variant(
            dev.id,
            fn,
            dev,
            inputs.map(dev.to_device),
            hal,
            items_per_call,
            f"{_name(fn)} on {dev.id} ({dev.capabilities.name})",
        )
        for dev in devices
    ]


def hal_for_environment(env: Mapping[str, str]) -> HardwareAbstractionLayer:
    """A HAL discovered with `env` set: for variants that differ in a plugin's configuration
    (plugins read their settings from the environment when discovery probes them).

    The variables are set for the duration of discovery only, then restored; not thread-safe.
    """
    with _environment(env):
        hal = HardwareAbstractionLayer()
        devices = hal.devices()
    log.info("HAL discovered under a variant's environment", env=dict(env), devices=[d.id for d in devices])
    return hal


@contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    bad = {k: v for k, v in env.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise InvalidArgumentError(f"environment variables and values must be strings, got {bad}")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _pick(name: str, valid: Mapping[str, Candidate], selection: Selection) -> Candidate:
    matches = [c for q, c in valid.items() if name in (q, c.name)]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise InvalidArgumentError(
            f"candidate {name!r} of op {selection.op!r} is ambiguous: {[c.qualified_name for c in matches]}; "
            "use provider/name"
        )
    why = [str(r) for r in selection.rejected if name in (r.candidate, r.candidate.split("/")[-1])]
    raise InvalidArgumentError(
        f"candidate {name!r} of op {selection.op!r} cannot run on {selection.device} for these inputs: "
        + ("; ".join(why) if why else f"no such candidate; valid: {sorted(valid)}")
    )


def _to_dtype(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """An explicit conversion of floating-point tensors; integer tensors (indices) stay as they are."""

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    return convert


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
