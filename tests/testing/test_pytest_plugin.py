"""The pytest face of the kit, run through pytester: one item per check, failures and skips with reasons."""

from __future__ import annotations

import pytest

from tests.testing.adapters import CPU_NOT_APPLICABLE
from torchhal.hal_core.adapters.cpu import CPUAdapter
from torchhal.testing import ConformanceSuite

pytest_plugins = ["pytester"]

CPU_CHECKS = len(ConformanceSuite(CPUAdapter(), seed=0).checks())
USE_PLUGIN = 'pytest_plugins = ["torchhal.testing.pytest_plugin"]\n'


def test_cpu_adapter_through_conftest_registration(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(USE_PLUGIN)
    result = pytester.runpytest("--torchhal-adapter=cpu", "-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=CPU_CHECKS - len(CPU_NOT_APPLICABLE), skipped=len(CPU_NOT_APPLICABLE))
    result.stdout.fnmatch_lines(
        [
            "*torchhal conformance: adapter 'cpu', seed *",
            "*dtype.tf32 not applicable: no device declares tf32*",
        ]
    )


def test_cpu_adapter_through_dash_p_with_keyword_selection(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        "-p",
        "torchhal.testing.pytest_plugin",
        "--torchhal-adapter",
        "cpu",
        "-k",
        "dtype",
        "-v",
        "-p",
        "no:cacheprovider",
    )
    result.assert_outcomes(passed=5, skipped=5, deselected=CPU_CHECKS - 10)
    result.stdout.fnmatch_lines(["*torchhal-conformance?cpu?::dtype.bf16 PASSED*"])


def test_a_failed_check_fails_its_item_with_the_reason(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        USE_PLUGIN
        + """
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import MemoryInfo
from torchhal.hal_core.adapters.cpu import CPUAdapter


class FrozenMemory(CPUAdapter):
    name = "frozen"

    def memory_info(self, index):
        return MemoryInfo(total_bytes=2**34, free_bytes=2**33, used_bytes=2**30)


def pytest_torchhal_conformance_hal(config):
    return HardwareAbstractionLayer(adapters=[FrozenMemory()])
"""
    )
    result = pytester.runpytest("--torchhal-adapter=frozen", "-p", "no:cacheprovider")
    result.assert_outcomes(
        passed=CPU_CHECKS - len(CPU_NOT_APPLICABLE) - 1, failed=1, skipped=len(CPU_NOT_APPLICABLE)
    )
    result.stdout.fnmatch_lines(
        [
            "*device.memory_accounting (*) failed: cpu: used_bytes grew by 0 bytes*",
            "FAILED *::device.memory_accounting*",
        ]
    )


def test_unknown_adapter_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(USE_PLUGIN)
    result = pytester.runpytest("--torchhal-adapter=warp9", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--torchhal-adapter: conformance: no adapter named 'warp9'*"])


def test_the_time_limit_option_reaches_the_kit_and_is_checked(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(USE_PLUGIN)
    result = pytester.runpytest("--torchhal-adapter=cpu", "--torchhal-time-limit=0", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--torchhal-time-limit: conformance: time_limit_s must be a finite number > 0, got 0.0*"]
    )


def test_without_the_option_the_plugin_adds_nothing(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(USE_PLUGIN)
    pytester.makepyfile("def test_plain():\n    assert 1 + 1 == 2\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
