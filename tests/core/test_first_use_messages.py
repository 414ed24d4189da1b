"""Errors and log lines a first-time user meets in the core: a device missing because its plugin
failed, allowlist names, requirements refused and unmet, and the guards switch read as a bool."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import (
    ConfigurationError,
    DeviceNotFoundError,
    DeviceRequirements,
    DType,
    NoDeviceMatchesError,
    dispatch_memo,
    kernels,
    telemetry,
)
from torchhal.hal_core.plugins import Status
from torchhal.hal_core.settings import Settings

BOOL_WORDS = "(on: 1, true, yes, on; off: 0, false, no, off)"


def test_a_missing_device_names_the_failed_plugins(monkeypatch: pytest.MonkeyPatch, settings) -> None:
    monkeypatch.setenv("TORCHHAL_SIMASIC_SPEC", "bogus")
    hal = HardwareAbstractionLayer(settings=settings(plugins="simasic"))
    with pytest.raises(DeviceNotFoundError) as err:
        hal.device("simasic:0")
    ((plugin, stage, reason),) = err.value.failed_plugins
    assert (plugin, stage) == ("simasic", "probe") and "got 'bogus'" in reason
    assert str(err.value).startswith("no device 'simasic:0'; devices found: cpu; ")
    assert f"plugin 'simasic' failed at probe: {reason}" in str(err.value)


def test_a_missing_device_without_failed_plugins_says_only_what_was_found(settings) -> None:
    hal = HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1"))
    with pytest.raises(DeviceNotFoundError) as err:
        hal.device("cuda:7")
    assert str(err.value) == "no device 'cuda:7'; devices found: cpu"


def test_a_failed_plugin_is_logged_as_failed(settings, capsys: pytest.CaptureFixture[str]) -> None:
    """The log said "plugin skipped" where the diagnostics said `failed`."""
    telemetry.configure(log_level="warning")
    hal = HardwareAbstractionLayer(settings=settings(plugins="nosuch"))
    assert [d.status for d in hal.diagnostics if d.name == "nosuch"] == [Status.FAILED]
    logged = [line for line in capsys.readouterr().err.splitlines() if "plugin=nosuch" in line]
    assert len(logged) == 1 and "plugin failed" in logged[0], logged


def test_an_unknown_allowlist_name_lists_the_names_the_allowlist_accepts(settings) -> None:
    """The list left out `cpu`, which is accepted, and named builtin-kernels, which always loads."""
    hal = HardwareAbstractionLayer(settings=settings(plugins="nosuch"))
    (diag,) = [d for d in hal.diagnostics if d.name == "nosuch"]
    assert (diag.status, diag.stage) == (Status.FAILED, "allowlist")
    accepted = diag.reason.split("; it accepts: ")[1].split(", ")
    assert "cpu" in accepted and "simasic" in accepted and "builtin-kernels" not in accepted
    for ok in accepted:  # each accepted name is one the allowlist takes without a failure
        taken = HardwareAbstractionLayer(settings=settings(plugins=ok))
        assert not [d for d in taken.diagnostics if d.stage == "allowlist" and d.status is Status.FAILED]


def test_naming_the_built_in_kernels_in_the_allowlist_is_accepted(settings) -> None:
    """They always load; an allowlist copied from the old message (which listed them) must not
    fail, nor stop a strict HAL."""
    hal = HardwareAbstractionLayer(settings=settings(plugins="builtin-kernels", strict_plugins="1"))
    assert not [d for d in hal.diagnostics if d.status is Status.FAILED]
    assert hal.device("cpu").id == "cpu"


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [("dtypes", "bf17", "'fp32', 'tf32', 'bf16'"), ("features", "tensorcores", "'tensor_cores', 'fp8'")],
)
def test_an_unknown_requirement_is_a_configuration_error(field: str, value: str, allowed: str) -> None:
    """pydantic's ValidationError escaped, no TorchHALError, ending with a URL."""
    with pytest.raises(ConfigurationError) as err:
        DeviceRequirements(**{field: {value}})
    message = str(err.value)
    assert message.startswith(f"invalid DeviceRequirements: {field}={value!r}: Input should be ")
    assert allowed in message and "pydantic.dev" not in message and "\n" not in message


def test_no_device_matches_states_the_requirements_in_words(settings) -> None:
    hal = HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1"))
    with pytest.raises(NoDeviceMatchesError) as err:
        hal.choose_device(DeviceRequirements(dtypes=frozenset({DType.FP8_E4M3})))
    first, *rest = str(err.value).splitlines()
    assert first == "no device meets the requirements (dtypes fp8_e4m3; simulated allowed):"
    assert rest == ["  cpu: dtypes ['fp8_e4m3'] not supported"]
    wide = DeviceRequirements(
        vendor="nvidia",
        features={"fp8"},
        min_memory_bytes=1 << 30,
        min_compute_units=8,
        allow_simulated=False,
    )
    assert str(wide) == (
        "vendor nvidia; features fp8; at least 1073741824 bytes of memory; at least 8 compute units; "
        "no simulated device"
    )


@pytest.fixture
def unbound(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The memo's guard kind unbound, so the test sees it chosen; restored afterwards."""
    monkeypatch.setattr(dispatch_memo, "_GUARD", None)
    monkeypatch.setattr(kernels, "_first_admitted", dispatch_memo._python_first_admitted)
    return monkeypatch


@pytest.mark.parametrize(
    ("value", "python"), [("false", False), ("off", False), (" no ", False), ("on", True)]
)
def test_the_pure_python_guards_switch_reads_as_a_bool(
    unbound: pytest.MonkeyPatch, value: str, python: bool
) -> None:
    """ "false", "no" and "off" turned the Python guards on: anything but "0" did."""
    pytest.importorskip("torchhal_speedups")
    unbound.setenv(dispatch_memo.PURE_PYTHON_GUARDS, value)
    assert dispatch_memo.guard_implementation() == ("python" if python else "torchhal_speedups")


def test_an_invalid_pure_python_guards_value_is_refused_naming_it(
    unbound: pytest.MonkeyPatch, settings: Callable[..., Settings]
) -> None:
    unbound.setenv(dispatch_memo.PURE_PYTHON_GUARDS, "maybe")
    with pytest.raises(ConfigurationError) as err:
        HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1")).report()
    assert str(err.value) == (
        "invalid torchhal setting: TORCHHAL_PURE_PYTHON_GUARDS='maybe': "
        f"Input should be a valid boolean, unable to interpret input {BOOL_WORDS}"
    )
