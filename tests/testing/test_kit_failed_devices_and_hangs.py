"""The conformance kit: devices that report themselves failed, discovery that
hangs, and pytest runs that end while a timed-out check still runs in torch."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest

from tests.testing import test_kit_exits_and_hangs
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import (
    HealthReport,
    HealthStatus,
    InvalidArgumentError,
    PluginError,
)
from torchhal.hal_core.adapters.cpu import CPUAdapter
from torchhal.hal_core.settings import Settings
from torchhal.testing import CheckResult, CheckStatus, ConformanceSuite
from torchhal.testing.suite import DiscoveryStuck, discover_within_limit

pytest_plugins = ["pytester"]


class ReportedHealth(CPUAdapter):
    """health() reports what it is given, as a runtime reading the device's state would."""

    name = vendor = "reported"

    def __init__(self, report: HealthReport) -> None:
        super().__init__()
        self.report = report

    def health(self, index: int) -> HealthReport:
        return self.report


def health_result(report: HealthReport) -> CheckResult:
    suite = ConformanceSuite(ReportedHealth(report), seed=0)
    (check,) = [c for c in suite.checks() if c.id == "device.health"]
    return suite.run_check(check)


def random_message() -> str:
    return f"{random.randint(1, 10**6)} uncorrectable ECC errors in row {random.randint(0, 4095)}"


def test_a_device_that_reports_failed_fails_the_health_check_naming_it() -> None:
    """A device whose health() said FAILED passed device.health (only the type was checked), so a
    broken card was certified."""
    message = random_message()
    result = health_result(HealthReport(status=HealthStatus.FAILED, messages=(message,)))
    assert result.status is CheckStatus.FAILED
    assert result.reason == (
        f"cpu: health() reports status failed ({message}): a failed device cannot be certified"
    )


def test_a_failed_device_without_messages_still_fails() -> None:
    result = health_result(HealthReport(status=HealthStatus.FAILED))
    assert result.status is CheckStatus.FAILED
    assert result.reason.startswith("cpu: health() reports status failed (no messages)")


@pytest.mark.parametrize("status", [HealthStatus.DEGRADED, HealthStatus.UNKNOWN])
def test_degraded_and_unknown_pass_with_their_messages(status: HealthStatus) -> None:
    messages = (random_message(), random_message())
    result = health_result(HealthReport(status=status, messages=messages))
    assert result.status is CheckStatus.PASSED
    assert result.reason == f"cpu: {status.value} ({messages[0]}; {messages[1]})"


class HangingDiscover(test_kit_exits_and_hangs.HangingDiscover):
    """discover() that does not return until `release` is set, under a name of its own."""

    name = vendor = "hanging"


@pytest.fixture(autouse=True)
def core_imported() -> None:
    """The core's own discovery (its kernel modules' first import) done, so that a short limit
    catches the test's adapter or plugin and not the core's imports, slow on a busy machine."""
    HardwareAbstractionLayer(settings=Settings(disable_plugin_autoload=True)).devices()


def test_discovery_past_the_time_limit_names_the_adapter_and_the_limit() -> None:
    adapter = HangingDiscover()
    hal = HardwareAbstractionLayer(adapters=[adapter], settings=Settings(disable_plugin_autoload=True))
    start = time.perf_counter()
    try:
        with pytest.raises(DiscoveryStuck) as stuck:
            discover_within_limit(hal, 1)
        assert time.perf_counter() - start < 10
        message = str(stuck.value)
        assert message.startswith(
            "conformance: discovery did not finish within the 1 s time limit: "
            "stuck in adapter 'hanging''s discover() at "
        )
        assert "test_kit_exits_and_hangs.py" in message and "TORCHHAL_PLUGINS=NAME" in message
        assert stuck.value.thread.is_alive()
    finally:
        adapter.release.set()
    stuck.value.thread.join(10)
    assert [d.id for d in hal.devices()] == ["cpu"]  # the discovery it left running finished


def test_discovery_stuck_importing_a_plugin_names_its_module(plugin_site: Path) -> None:
    (plugin_site / "sleepy_mod.py").write_text("import time\ntime.sleep(8)\n")
    add_entry_point(plugin_site, "sleepy", "sleepy_mod")
    hal = HardwareAbstractionLayer(settings=Settings(plugins=("sleepy",)))
    with pytest.raises(DiscoveryStuck) as stuck:
        discover_within_limit(hal, 2)  # the entry points are read well within it
    assert "stuck importing module 'sleepy_mod' at " in str(stuck.value)
    assert "sleepy_mod.py:2 in <module>" in str(stuck.value)
    stuck.value.thread.join(20)


def test_what_discovery_raises_reaches_the_caller(plugin_site: Path) -> None:
    (plugin_site / "broken_mod.py").write_text("raise ImportError('libwarp.so missing')\n")
    add_entry_point(plugin_site, "broken", "broken_mod")
    hal = HardwareAbstractionLayer(settings=Settings(plugins=("broken",), strict_plugins=True))
    with pytest.raises(PluginError, match=r"libwarp\.so missing"):
        discover_within_limit(hal, 30)


@pytest.mark.parametrize("limit", [0, -1.0, float("nan")])
def test_a_bad_discovery_limit_is_refused_before_discovery(limit: float) -> None:
    adapter = HangingDiscover()
    hal = HardwareAbstractionLayer(adapters=[adapter], settings=Settings(disable_plugin_autoload=True))
    with pytest.raises(InvalidArgumentError, match="time_limit_s must be a finite number > 0, got"):
        discover_within_limit(hal, limit)
    assert hal._state is None  # nothing discovered (nor left hanging)


@pytest.fixture
def plugin_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    yield site
    for name in ("sleepy_mod", "broken_mod"):
        sys.modules.pop(name, None)


def add_entry_point(site: Path, name: str, module: str) -> None:
    import importlib

    info = site / f"torchhal_test_{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchhal-test-{name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[torchhal.adapters]\n{name} = {module}\n")
    importlib.invalidate_caches()


SLOW_SYNCHRONIZE = """
import time

import pytest
import torch

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core.adapters.cpu import CPUAdapter

pytest_plugins = ["torchhal.testing.pytest_plugin"]


@torch.library.custom_op("{namespace}::nap", mutates_args=())
def nap(x: torch.Tensor, seconds: float) -> torch.Tensor:
    '''A torch op that takes its time: the thread waits inside torch's dispatcher (C++).'''
    time.sleep(seconds)
    return x.clone()


class SlowSynchronize(CPUAdapter):
    '''synchronize() in a torch op for {nap_s} s: slow, not hung.'''

    name = vendor = "slow"

    def synchronize(self, index):
        nap(torch.zeros(1), {nap_s})


def pytest_torchhal_conformance_hal(config):
    return HardwareAbstractionLayer(adapters=[SlowSynchronize()])
"""

STATUS_AFTER_THE_RUN = """

@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session):
    '''A plugin that sets the status after the run, as coverage's fail-under does.'''
    yield
    session.exitstatus = 3
"""


def slow_run(pytester: pytest.Pytester, extra: str = "") -> pytest.RunResult:
    pytester.makeconftest(SLOW_SYNCHRONIZE.format(namespace="torchhal_sweep20", nap_s=30) + extra)
    return pytester.runpytest_subprocess(
        "--torchhal-adapter=slow",
        "--torchhal-time-limit=0.5",
        "-k",
        "probe or synchronize",
        "-p",
        "no:cacheprovider",
        timeout=120,
    )


@pytest.mark.slow
def test_pytest_exits_with_the_runs_status_while_a_timed_out_check_runs_in_torch(
    pytester: pytest.Pytester,
) -> None:
    """The timed-out synchronize was still in torch's C++ code when pytest's interpreter
    finalized: the run ended with SIGABRT (exit code 134, "terminate called without an active
    exception") instead of 1 for its failed check."""
    result = slow_run(pytester)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stderr.str()[-2000:]
    assert "terminate called" not in result.stderr.str()
    result.stdout.fnmatch_lines(["*device.synchronize*did not finish within the 0.5 s time limit*"])
    result.assert_outcomes(passed=1, failed=1)


@pytest.mark.slow
def test_pytest_keeps_a_status_set_after_the_run(pytester: pytest.Pytester) -> None:
    result = slow_run(pytester, extra=STATUS_AFTER_THE_RUN)
    assert result.ret == 3, result.stderr.str()[-2000:]


@pytest.mark.slow
def test_an_in_process_run_does_not_end_its_callers_process(pytester: pytest.Pytester) -> None:
    """pytest.main() returns to its caller, which goes on: a script calls it, in its own process
    (pytester's in-process run would unload torch modules that the inner run imported, and torch
    cannot register their ops twice)."""
    pytester.makeconftest(SLOW_SYNCHRONIZE.format(namespace="torchhal_sweep20_in_process", nap_s=2))
    pytester.makepyfile(
        caller="""
        import threading

        import pytest

        adapter, limit = "--torchhal-adapter=slow", "--torchhal-time-limit=0.5"
        status = pytest.main([adapter, limit, "-k", "synchronize", "-p", "no:cacheprovider"])
        print("the caller goes on after status", int(status), flush=True)
        for thread in threading.enumerate():  # the left call ends before this process does
            if thread.name.startswith("torchhal-conformance"):
                thread.join()
        """
    )
    result = pytester.run(sys.executable, "caller.py", timeout=120)
    assert result.ret == 0, result.stderr.str()[-2000:]
    result.stdout.fnmatch_lines([f"the caller goes on after status {int(pytest.ExitCode.TESTS_FAILED)}"])


HANGING_DISCOVERY = """
import time

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core.adapters.cpu import CPUAdapter
from torchhal.hal_core.settings import Settings

pytest_plugins = ["torchhal.testing.pytest_plugin"]

# the core's own discovery (its kernel modules' first import) done here, so that the limit
# catches the adapter below and not those imports, slow on a busy machine
HardwareAbstractionLayer(settings=Settings(disable_plugin_autoload=True)).devices()


class HangingDiscover(CPUAdapter):
    name = vendor = "hanging"

    def discover(self):
        time.sleep(60)
        return super().discover()


def pytest_torchhal_conformance_hal(config):
    return HardwareAbstractionLayer(adapters=[HangingDiscover()])
"""


@pytest.mark.slow
def test_pytest_stops_with_a_usage_error_when_discovery_hangs(pytester: pytest.Pytester) -> None:
    """The plugin resolved its adapter through a discovery without any limit: a plugin whose
    discovery never returned hung `pytest` before any item existed, without a word."""
    pytester.makeconftest(HANGING_DISCOVERY)
    start = time.perf_counter()
    result = pytester.runpytest_subprocess(
        "--torchhal-adapter=hanging",
        "--torchhal-discovery-time-limit=3",
        "-p",
        "no:cacheprovider",
        timeout=120,
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stderr.str()[-2000:]
    assert time.perf_counter() - start < 50
    result.stderr.fnmatch_lines(
        ["*discovery did not finish within the 3 s time limit: stuck in adapter 'hanging''s discover()*"]
    )
