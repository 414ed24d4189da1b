"""The conformance kit: adapter code that exits, steps that hang while the
kit plans, what a timed-out check reports, and not-applicable reasons that say why."""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Sequence

import pytest

from tests.testing import adapters
from torchhal.hal_core import DeviceCapabilities, HealthReport
from torchhal.hal_core.adapters.cpu import CPUAdapter
from torchhal.testing import CheckStatus, ConformanceReport, format_report, run_conformance
from torchhal.testing.context import AdapterUnderTest, stuck_in


def by_status(report: ConformanceReport, status: CheckStatus) -> set[str]:
    return {c.check for c in report.checks if c.status is status}


class ExitingSynchronize(CPUAdapter):
    """synchronize() calls exit(), as a vendor runtime may on a lost device."""

    def synchronize(self, index: int) -> None:
        sys.exit(0)


class ExitingProbe(CPUAdapter):
    def probe(self):  # type: ignore[no-untyped-def]
        sys.exit(0)


class InterruptedHealth(CPUAdapter):
    def health(self, index: int) -> HealthReport:
        raise KeyboardInterrupt


class HangingDiscover(CPUAdapter):
    """discover() that does not return until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def discover(self) -> Sequence[DeviceCapabilities]:
        self.release.wait()
        return super().discover()


class Fp8OnlyMatmul(adapters.Fp8OnlyHost):
    """A matmul candidate on a device that declares no dtype the kit draws kernel inputs in."""

    def register_kernels(self, registry):  # type: ignore[no-untyped-def]
        adapters.EinsumMatmul.register_kernels(self, registry)  # type: ignore[arg-type]


def test_adapter_code_that_exits_fails_its_check_and_the_run_goes_on() -> None:
    """SystemExit(0) from adapter code ended the run with that code and no report, so
    `torchhal conformance` exited 0 (conforms) for an adapter that exits the process."""
    report = run_conformance(ExitingSynchronize())
    assert by_status(report, CheckStatus.FAILED) == {"device.synchronize"}, format_report(report)
    reason = report.result("device.synchronize").reason
    assert "raised SystemExit: 0" in reason and "must not exit the process" in reason
    assert "test_kit_exits_and_hangs.py" in reason  # where the adapter's exit is
    blocked = report.result("device.memory_accounting")
    assert blocked.status is CheckStatus.NOT_APPLICABLE and "SystemExit" in blocked.reason


def test_a_probe_that_exits_fails_the_probe_check_and_blocks_the_rest() -> None:
    report = run_conformance(ExitingProbe())
    assert by_status(report, CheckStatus.FAILED) == {"adapter.probe"}, format_report(report)
    rest = [c for c in report.checks if c.check not in ("adapter.attributes", "adapter.probe")]
    assert all(c.status is CheckStatus.NOT_APPLICABLE for c in rest)
    assert all("blocked: probe() raised SystemExit: 0" in c.reason for c in rest)


def test_keyboard_interrupt_from_adapter_code_still_stops_the_run() -> None:
    with pytest.raises(KeyboardInterrupt):
        run_conformance(InterruptedHealth())


def test_a_discover_that_hangs_fails_its_check_instead_of_hanging_the_plan() -> None:
    """Planning (which needs the kernel candidates: probe, discover, register_kernels) ran in the
    caller's thread without a limit: a discover() that never returns hung the kit for good, and
    one that returned late passed adapter.discover, whatever the time limit."""
    adapter = HangingDiscover()
    release = threading.Timer(20, adapter.release.set)
    release.start()
    start = time.perf_counter()
    try:
        report = run_conformance(adapter, time_limit_s=0.5)
    finally:
        adapter.release.set()
        release.cancel()
    assert time.perf_counter() - start < 15
    failed = by_status(report, CheckStatus.FAILED)
    assert failed == {"adapter.discover", "kernels.candidates"}, format_report(report)
    assert report.result("adapter.discover").reason.startswith("discover(): it has not returned")
    unlisted = report.result("kernels.candidates").reason  # no candidate was checked: not a pass
    assert "did not finish within the 0.5 s time limit: stuck in discover() at " in unlisted
    assert "test_kit_exits_and_hangs.py" in unlisted


def test_a_candidate_on_devices_without_a_kernel_dtype_says_so() -> None:
    """The reason read "its predicate rejected every case the kit tried: " (no case was tried)."""
    result = run_conformance(Fp8OnlyMatmul()).result("kernel.matmul/cpu/einsum")
    assert result.status is CheckStatus.NOT_APPLICABLE
    assert result.reason == "no device declares a dtype the kit runs kernels in (fp32, bf16, fp16, fp64)"


def test_a_check_blocked_inside_the_kit_is_not_placed_in_the_threads_start_up() -> None:
    """A check blocked in a C call the kit made itself (a device op's `.cpu()` that never
    returns) was reported "at threading.py:... in run < ... in _bootstrap_inner": the only frames
    outside the kit were the thread's own start-up, above the kit."""
    once = AdapterUnderTest(CPUAdapter(), seed=0)._probe
    with once._lock:  # the kit's own frame (`_Once.get`) now waits in C
        thread = threading.Thread(target=once.get, daemon=True)
        thread.start()
        time.sleep(0.2)
        frames = traceback.extract_stack(sys._current_frames()[thread.ident])  # type: ignore[index]
    thread.join()
    where = stuck_in(frames)
    assert "threading.py" not in where
    assert where.startswith("in get() inside the conformance kit, at ") and "context.py" in where
