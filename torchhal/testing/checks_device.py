"""Mandatory per-device checks: synchronize, memory figures, health, topology and timers."""

from __future__ import annotations

import gc
import math
import time
from typing import TYPE_CHECKING

from torchhal.hal_core import DType, Feature, HealthReport, HealthStatus, HostTimer, MemoryInfo, Topology
from torchhal.hal_core.capabilities import MEMORY_FIGURES, MemoryFigure
from torchhal.testing.context import AdapterUnderTest, CheckFailed, NotApplicable, each_device

if TYPE_CHECKING:
    import torch

    from torchhal.hal_core import Device

MIB = 2**20
ACCOUNTING_BUFFER_BYTES = 64 * MIB  # or 1% of capacity, whichever is smaller
# On a device that is not simulated, used_bytes must grow by >= 90% of the buffer and fall by
# >= 90% of it once the buffer is freed (page rounding, allocator slack) ...
ACCOUNTING_TOLERANCE = 0.10
# ... and grow by at most the buffer plus an eighth of it or 4 MiB, whichever is more. used_bytes
# is this process's allocations: on CUDA, ROCm and XPU torch's memory_allocated, each block rounded
# up to 512 bytes, the caching allocator's reserve left out (so it also falls on a free); on the
# host the resident set, in pages (2 MiB ones with transparent huge pages), plus what the fill's
# first run starts (1.4 MiB on x86-64 Linux). The bound was twice the buffer plus 64 MiB, which
# passed a device counting every allocation twice. A simulated device's ledger has no slack: its
# figures must move by exactly the buffer.
ACCOUNTING_SLACK_FRACTION, ACCOUNTING_SLACK = 8, 4 * MIB
TIMER_BUFFER_BYTES = 4 * MIB
TIMER_COPIES = 8
TIMER_WALL_SLACK_MS = 1.0  # device time between two marks cannot exceed host wall time around them (+ slack)
FILLABLE = (DType.FP32, DType.BF16, DType.FP16, DType.FP64, DType.INT8)  # dtypes with in-place random fills


def fill_dtype(device: Device) -> torch.dtype:
    """A declared dtype the kit can fill with random values in place on the device."""
    for dtype in FILLABLE:
        if dtype in device.capabilities.dtypes:
            torch_dtype = dtype.to_torch()
            assert torch_dtype is not None
            return torch_dtype
    declared = sorted(d.value for d in device.capabilities.dtypes)
    raise NotApplicable(f"{device.id} declares none of {[d.value for d in FILLABLE]} (declared: {declared})")


def random_buffer(ctx: AdapterUnderTest, device: Device, nbytes: int, salt: str) -> torch.Tensor:
    """A buffer allocated through Device.empty and filled with random values on the device."""
    dtype = fill_dtype(device)
    buffer = device.empty((max(1, nbytes // dtype.itemsize),), dtype)
    generator = ctx.generator(salt, buffer.device)
    if dtype.is_floating_point:
        buffer.uniform_(-1.0, 1.0, generator=generator)
    else:
        buffer.random_(-128, 128, generator=generator)
    return buffer


def check_synchronize(ctx: AdapterUnderTest) -> str:
    ctx.synchronize_once()
    return f"synchronize() returned on {len(ctx.devices())} device(s)"


def check_memory_info(ctx: AdapterUnderTest) -> str:
    """Compares the figures the runtime gives; the detail names those it does not (`unknown`)."""

    def one(device: Device) -> str:
        info = device.memory_info()
        if not isinstance(info, MemoryInfo):
            raise CheckFailed(f"memory_info() must return MemoryInfo, got {type(info).__name__}")
        total, free, used = (info.known(figure) for figure in MEMORY_FIGURES)
        problems = inconsistencies(info)
        if info.simulated != device.simulated:
            problems.append(
                f"MemoryInfo.simulated is {info.simulated} but the device's SIMULATED feature "
                f"is {device.simulated}"
            )
        if problems:
            raise CheckFailed("; ".join(problems))
        sim = ", simulated" if info.simulated else ""
        figures = ", ".join(
            f"{name} {'unknown' if value is None else f'{value / MIB:.{digits}f} MiB'}"
            for name, value, digits in zip(MEMORY_FIGURES, (total, free, used), (0, 0, 1), strict=True)
        )
        unread = f" (not compared: {', '.join(sorted(info.unknown))} unknown)" if info.unknown else ""
        return f"{figures}{sim}{unread}"

    return each_device(ctx.devices(), one)


def inconsistencies(info: MemoryInfo) -> list[str]:
    """What the known figures of one reading contradict: each within total_bytes, free and used
    together too (free memory is nobody's)."""
    total, free, used = (info.known(figure) for figure in MEMORY_FIGURES)
    problems = []
    if total is not None:
        if total <= 0:
            problems.append(f"total_bytes must be > 0, got {total}")
        if free is not None and free > total:
            problems.append(f"free_bytes {free} > total_bytes {total}")
        if used is not None and used > total:
            problems.append(f"used_bytes {used} > total_bytes {total}")
        elif free is not None and used is not None and free + used > total:
            problems.append(f"free_bytes {free} + used_bytes {used} > total_bytes {total}")
    return problems


def check_memory_accounting(ctx: AdapterUnderTest) -> str:
    """used_bytes grows by a buffer's size when it is allocated and falls back when it is freed,
    and the readings in between stay consistent; a simulated device's figures, free_bytes too,
    move by exactly the buffer. Not applicable where no device gives `used_bytes`; a device that
    does not is named."""
    ctx.require_synchronize()
    unread: list[str] = []
    checked: list[str] = []

    def one(device: Device) -> str:
        gc.collect()  # so that garbage freed mid-check cannot offset the figure
        before = device.memory_info()
        if "used" in before.unknown:
            unread.append(device.id)
            return "not checked: memory_info() says used_bytes is unknown"
        total = before.known("total")
        nbytes = ACCOUNTING_BUFFER_BYTES if total is None else min(ACCOUNTING_BUFFER_BYTES, total // 100)
        buffer = random_buffer(ctx, device, nbytes, f"accounting:{device.id}")
        device.synchronize()
        after = device.memory_info()
        allocated = buffer.numel() * buffer.element_size()
        del buffer
        gc.collect()  # a buffer an adapter holds in a reference cycle is freed too
        device.synchronize()
        freed = device.memory_info()
        for reading, when in ((after, "after allocating"), (freed, "after freeing")):
            if "used" in reading.unknown:
                raise CheckFailed(f"used_bytes was known before an allocation and unknown {when} it")
        compare = _exact_accounting if device.simulated else _real_accounting
        detail, problems = compare(before, after, freed, allocated)
        if inconsistencies(before):  # device.memory_info fails it already: not failed twice
            detail += "; readings not checked for consistency (see device.memory_info)"
        else:  # free memory that does not move with the allocation can contradict used only now
            for reading, when in ((after, "after allocating"), (freed, "after freeing")):
                problems += [f"{when} {allocated} bytes: {p}" for p in inconsistencies(reading)]
        if problems:
            raise CheckFailed("; ".join(problems))
        checked.append(device.id)
        return detail

    detail = each_device(ctx.devices(), one)
    if unread and len(unread) == len(ctx.devices()):
        raise NotApplicable(
            f"memory_info() says used_bytes is unknown on {', '.join(unread)}: "
            "its growth on an allocation cannot be checked"
        )
    if not checked:  # some devices without used_bytes, the others not applicable
        raise NotApplicable(f"no device checked: {detail}")
    return detail


def _real_accounting(
    before: MemoryInfo, after: MemoryInfo, freed: MemoryInfo, allocated: int
) -> tuple[str, list[str]]:
    """used_bytes within the allocator's slack (see ACCOUNTING_SLACK); free_bytes is not compared:
    the runtime's is device-wide (CUDA and ROCm: the driver's mem_get_info, which a caching
    allocator's reserve and other processes move apart from this buffer; the host: its free pages)."""
    grew, fell = after.used_bytes - before.used_bytes, after.used_bytes - freed.used_bytes
    least = (1 - ACCOUNTING_TOLERANCE) * allocated
    most = allocated + max(allocated // ACCOUNTING_SLACK_FRACTION, ACCOUNTING_SLACK)
    problems = []
    if not least <= grew <= most:
        problems.append(
            f"used_bytes grew by {grew} bytes ({before.used_bytes} -> {after.used_bytes}) after "
            f"allocating and filling {allocated} bytes; must grow by at least "
            f"{1 - ACCOUNTING_TOLERANCE:.0%} of it and at most {most} bytes (it plus "
            f"1/{ACCOUNTING_SLACK_FRACTION} of it or {ACCOUNTING_SLACK // MIB} MiB, whichever is more)"
        )
    if fell < least:
        problems.append(
            f"used_bytes fell by {fell} bytes ({after.used_bytes} -> {freed.used_bytes}) after the "
            f"{allocated}-byte buffer was freed; must fall by at least {1 - ACCOUNTING_TOLERANCE:.0%} "
            "of it (used_bytes is live allocations, not an allocator's cache)"
        )
    detail = (
        f"used_bytes grew by {grew / MIB:.2f} MiB for a {allocated / MIB:.2f} MiB buffer and fell by "
        f"{fell / MIB:.2f} MiB when it was freed; free_bytes not compared (not simulated: the "
        "runtime's free memory is device-wide, moved by allocator caches and other processes)"
    )
    return detail, problems


def _exact_accounting(
    before: MemoryInfo, after: MemoryInfo, freed: MemoryInfo, allocated: int
) -> tuple[str, list[str]]:
    """A simulated device keeps a ledger, without allocator slack or other processes: used_bytes
    and, where known, free_bytes move by exactly the buffer, and back when it is freed."""
    unknown = before.unknown | after.unknown | freed.unknown
    figures: list[MemoryFigure] = ["used"] if "free" in unknown else ["used", "free"]
    problems = []
    for figure in figures:
        first, held, last = (r.known(figure) or 0 for r in (before, after, freed))
        rise = allocated if figure == "used" else -allocated  # free falls as used rises
        for when, start, end, want in (("allocating", first, held, rise), ("freeing", held, last, -rise)):
            if end - start != want:
                problems.append(
                    f"{figure}_bytes moved by {end - start:+d} bytes ({start} -> {end}) on {when} a "
                    f"{allocated}-byte buffer; a simulated device's must move by exactly {want:+d}"
                )
    unread = "; free_bytes unknown, not compared" if "free" in unknown else ""
    detail = (
        f"{' and '.join(f'{f}_bytes' for f in figures)} moved by exactly the {allocated / MIB:.2f} MiB "
        f"buffer on allocating and on freeing it (simulated: an exact ledger){unread}"
    )
    return detail, problems


def check_health(ctx: AdapterUnderTest) -> str:
    """A device that reports itself failed cannot be certified; degraded and unknown pass, their
    messages in the detail (degraded still computes, and unknown is a runtime without health data)."""

    def one(device: Device) -> str:
        report = device.health()
        if not isinstance(report, HealthReport):
            raise CheckFailed(f"health() must return HealthReport, got {type(report).__name__}")
        said = "; ".join(report.messages) or "no messages"
        if report.status is HealthStatus.FAILED:
            raise CheckFailed(f"health() reports status failed ({said}): a failed device cannot be certified")
        return f"{report.status.value} ({said})" if report.messages else report.status.value

    return each_device(ctx.devices(), one)


def check_topology(ctx: AdapterUnderTest) -> str:
    own = [d.id for d in ctx.devices()]
    topology = ctx.adapter.topology()
    if not isinstance(topology, Topology):
        raise CheckFailed(f"topology() must return Topology, got {type(topology).__name__}")
    problems = []
    listed = list(topology.devices)
    if sorted(listed) != sorted(own):
        problems.append(f"topology lists devices {listed}; the adapter's devices are {own}")
    pairs: dict[frozenset[str], list[tuple[object, ...]]] = {}
    directions: dict[tuple[str, str], int] = {}
    for link in topology.links:
        foreign = [end for end in (link.a, link.b) if end not in own]
        if foreign:
            problems.append(f"link {link.a}-{link.b} names devices not of this adapter: {foreign}")
        if link.a == link.b:
            problems.append(f"link {link.a}-{link.b} joins a device to itself")
        facts = (link.type.value, link.count, link.bandwidth_gbps)
        pairs.setdefault(frozenset((link.a, link.b)), []).append(facts)
        directions[(link.a, link.b)] = directions.get((link.a, link.b), 0) + 1
    for (a, b), times in directions.items():
        if times > 1:  # one link, listed once or once each way
            problems.append(f"the link {a}->{b} is listed {times} times")
    for pair, variants in pairs.items():
        if len(set(variants)) > 1:
            problems.append(f"links between {' and '.join(sorted(pair))} disagree by direction: {variants}")
    if problems:
        raise CheckFailed("; ".join(problems))
    return f"{len(listed)} device(s), {len(topology.links)} link(s), symmetric, own devices only"


def _timed_copies(ctx: AdapterUnderTest, device: Device) -> tuple[float, float]:
    """Device-timer and host-wall milliseconds around a few device copies of a random buffer."""
    src = random_buffer(ctx, device, TIMER_BUFFER_BYTES, f"timer:{device.id}")
    dst = device.empty(src.shape, src.dtype)
    timer = device.timer()
    wall_start = time.perf_counter()
    start = timer.mark()
    for _ in range(TIMER_COPIES):
        device.copy_(dst, src)
    end = timer.mark()
    elapsed = timer.elapsed_ms(start, end)
    wall_ms = (time.perf_counter() - wall_start) * 1e3
    if not torch_equal(dst, src):
        raise CheckFailed("Device.copy_ did not copy the buffer")
    return elapsed, wall_ms


def torch_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    return bool(torch.equal(a.cpu(), b.cpu()))


def check_timer(ctx: AdapterUnderTest) -> str:
    ctx.require_synchronize()  # a timer's marks wait on the device (HostTimer through synchronize)

    def one(device: Device) -> str:
        elapsed, wall_ms = _timed_copies(ctx, device)
        what = f"{TIMER_COPIES} copies of {TIMER_BUFFER_BYTES // MIB} MiB"
        if not (isinstance(elapsed, (int, float)) and math.isfinite(elapsed) and elapsed > 0):
            raise CheckFailed(f"elapsed_ms across {what} must be a finite number > 0, got {elapsed!r}")
        if not device.simulated and elapsed > wall_ms + TIMER_WALL_SLACK_MS:
            raise CheckFailed(
                f"elapsed_ms {elapsed:.3f} across {what} exceeds the host wall time around it "
                f"({wall_ms:.3f} ms)"
            )
        sim = " simulated" if device.simulated else ""
        return f"{elapsed:.3f} ms{sim} for {what} (host wall {wall_ms:.3f} ms)"

    return each_device(ctx.devices(), one)


def check_timer_events(ctx: AdapterUnderTest) -> str:
    with_events = [d for d in ctx.devices() if Feature.DEVICE_EVENTS in d.capabilities.features]
    if not with_events:
        raise NotApplicable("no device declares the device_events feature")

    def one(device: Device) -> str:
        timer = device.timer()
        if isinstance(timer, HostTimer):
            raise CheckFailed("declares device_events but timer() is the host-clock HostTimer")
        return f"{type(timer).__name__}"

    return each_device(with_events, one)


GRAPH_ELEMENTS = 4096


def check_graphs(ctx: AdapterUnderTest) -> str:
    """A device declaring graphs captures work once and each replay recomputes it on the inputs'
    new values (measured selection times replays under TORCHHAL_SELECTION_TIMING=graph)."""
    import torch

    with_graphs = [d for d in ctx.devices() if Feature.GRAPHS in d.capabilities.features]
    if not with_graphs:
        raise NotApplicable("no device declares the graphs feature")
    checked = [d for d in with_graphs if DType.FP32 in d.capabilities.dtypes]
    if not checked:
        raise NotApplicable("the devices that declare graphs declare no fp32, in which the check computes")

    def one(device: Device) -> str:
        x = device.to_device(torch.randn(GRAPH_ELEMENTS))
        out = device.empty((GRAPH_ELEMENTS,), torch.float32)
        replay = device.graph_replay(lambda: torch.mul(x, 2.0, out=out))
        fresh = torch.randn(GRAPH_ELEMENTS)
        device.copy_(x, fresh)
        replay()
        device.synchronize()
        if not torch_equal(out, fresh * 2.0):
            raise CheckFailed("a replay did not recompute the captured x * 2 on x's new values")
        return "captured x * 2, replayed on new values"

    return each_device(checked, one)
