"""Mandatory checks of the adapter object itself: attributes, probe() and discover()."""

from __future__ import annotations

import time

from torchhal.hal_core import (
    HAL_API_VERSION,
    SCHEMA_VERSION,
    Device,
    DeviceCapabilities,
    MemoryInfo,
    ProbeResult,
    VendorAdapter,
)
from torchhal.hal_core.adapter import attribute_problems
from torchhal.testing.context import AdapterUnderTest, CheckFailed, describe

PROBE_BUDGET_S = 1.0  # probe() must be cheap: the HAL probes every installed adapter on first use
MAX_SIMD_WIDTH = (
    4096  # lanes: CPU vectors 4-16, warps 32, wavefronts 64, systolic columns up to a few hundred
)
MAX_COMPUTE_UNITS = 2**24  # SMs, CUs, cores; even wafer-scale parts stay below this


def check_attributes(ctx: AdapterUnderTest) -> str:
    adapter = ctx.adapter
    problems = attribute_problems(adapter)
    if problems:
        raise CheckFailed("; ".join(problem for _, problem in problems))
    return (
        f"name {adapter.name!r}, vendor {adapter.vendor!r}, priority {adapter.priority}, "
        f"api_versions {adapter.api_versions} covers HAL API {HAL_API_VERSION}"
    )


def check_probe(ctx: AdapterUnderTest) -> str:
    results, durations = [], []
    for _ in range(2):
        start = time.perf_counter()
        try:
            result = ctx.adapter.probe()
        except Exception as exc:
            raise CheckFailed(f"probe() raised {describe(exc)}") from exc
        durations.append(time.perf_counter() - start)
        results.append(result)
    first, second = results
    if not isinstance(first, ProbeResult):
        raise CheckFailed(f"probe() must return a ProbeResult, got {type(first).__name__}: {first!r}")
    slow = max(durations)
    if slow >= PROBE_BUDGET_S:
        raise CheckFailed(f"probe() took {slow:.3f} s, the budget is {PROBE_BUDGET_S} s")
    if first != second:
        raise CheckFailed(f"probe() answered differently on two calls: {first!r} then {second!r}")
    if not first.reason.strip():
        raise CheckFailed("probe() gave an empty reason; say why the runtime is present or absent")
    state = "available" if first.available else "absent"
    return f"{state} ({first.reason}); two calls agree, slowest {slow * 1e3:.2f} ms"


def check_numerics_settings(ctx: AdapterUnderTest) -> str:
    """An evaluation's fingerprint records these: they must be JSON scalars under string names,
    and the same on a second read (a value that moves by itself would split every experiment)."""
    ctx.require_available()
    reads = []
    for _ in range(2):
        try:
            reads.append(ctx.adapter.numerics_settings())
        except Exception as exc:
            raise CheckFailed(f"numerics_settings() raised {describe(exc)}") from exc
    first, second = reads
    if not isinstance(first, dict):
        raise CheckFailed(f"numerics_settings() must return a dict, got {type(first).__name__}: {first!r}")
    bad = {
        name: value
        for name, value in first.items()
        if not isinstance(name, str) or not (value is None or isinstance(value, (bool, int, float, str)))
    }
    if bad:
        raise CheckFailed(f"numerics_settings() must map names to bool, int, float, str or None, got {bad!r}")
    if first != second:
        raise CheckFailed(f"numerics_settings() answered differently on two reads: {first!r} then {second!r}")
    return f"{len(first)} switches ({', '.join(sorted(first)) or 'none of its own'}); two reads agree"


def check_discover(ctx: AdapterUnderTest) -> str:
    import torch

    adapter = ctx.adapter
    found = ctx.discovered()
    if not found:
        raise CheckFailed("probe() says available but discover() returned no device")
    problems: list[str] = []
    indexes: dict[int, int] = {}
    ids: dict[str, int] = {}
    for position, caps in enumerate(found):
        where = f"device #{position}"
        if not isinstance(caps, DeviceCapabilities):
            problems.append(f"{where} is a {type(caps).__name__}, not DeviceCapabilities")
            continue
        where = f"device #{position} (index {caps.index})"
        if caps.schema_version != SCHEMA_VERSION:
            problems.append(
                f"{where}: schema_version {caps.schema_version}, this torchhal reads {SCHEMA_VERSION}"
            )
        if caps.adapter != adapter.name:
            problems.append(
                f"{where}: adapter field {caps.adapter!r} is not the adapter's name {adapter.name!r}"
            )
        if caps.vendor != adapter.vendor:
            problems.append(
                f"{where}: vendor field {caps.vendor!r} is not the adapter's vendor {adapter.vendor!r}"
            )
        try:
            parsed = torch.device(caps.device_type).type
        except RuntimeError as exc:
            problems.append(
                f"{where}: device_type {caps.device_type!r} is not a device type torch knows ({exc})"
            )
        else:
            if parsed != caps.device_type:
                problems.append(
                    f"{where}: device_type {caps.device_type!r} reads back from torch as {parsed!r}"
                )
        if caps.memory_bytes == 0 and "total" not in _unknown_memory(adapter, caps.index):
            problems.append(
                f"{where}: memory_bytes is 0, which only a device whose memory_info() names 'total' "
                "in `unknown` may declare (its runtime does not say)"
            )
        if not 1 <= caps.simd_width <= MAX_SIMD_WIDTH:
            problems.append(f"{where}: simd_width must be in [1, {MAX_SIMD_WIDTH}], got {caps.simd_width}")
        if not 1 <= caps.compute_units <= MAX_COMPUTE_UNITS:
            problems.append(
                f"{where}: compute_units must be in [1, {MAX_COMPUTE_UNITS}], got {caps.compute_units}"
            )
        if not caps.dtypes:
            problems.append(f"{where}: declares no dtype")
        indexes[caps.index] = indexes.get(caps.index, 0) + 1
        device_id = Device(adapter, caps).id
        ids[device_id] = ids.get(device_id, 0) + 1
    repeated = sorted(i for i, n in indexes.items() if n > 1)
    if repeated:
        problems.append(f"device indexes must be unique, repeated: {repeated}")
    repeated_ids = sorted(i for i, n in ids.items() if n > 1)
    if repeated_ids and not repeated:
        problems.append(f"device ids must be unique, repeated: {repeated_ids}")
    start = time.perf_counter()
    try:
        again = list(adapter.discover())
    except Exception as exc:
        raise CheckFailed(f"discover() raised on its second call: {describe(exc)}") from exc
    seconds = time.perf_counter() - start
    if again != found:  # the HAL discovers once per process, and devices must not move between HALs
        problems.append(f"discover() returned other records on a second call: {found!r} then {again!r}")
    if problems:
        raise CheckFailed("; ".join(problems))
    listing = ", ".join(
        f"{Device(adapter, c).id} ({c.device_type}, {c.arch}, {c.memory_text})" for c in found
    )
    return f"{len(found)} device(s): {listing}; a second call agrees ({seconds * 1e3:.1f} ms)"


def _unknown_memory(adapter: VendorAdapter, index: int) -> frozenset[str]:
    """The figures the device's `memory_info()` says its runtime does not give; none where that
    call raises or returns something else (the memory checks report those)."""
    try:
        info = adapter.memory_info(index)
    except Exception:
        return frozenset()
    return info.unknown if isinstance(info, MemoryInfo) else frozenset()
