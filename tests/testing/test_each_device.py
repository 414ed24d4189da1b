"""A per-device check on several devices: a device the check does not apply to is a note, never a
reason to drop the failures found on the others, nor to skip the devices after it."""

from __future__ import annotations

import random
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from tests.testing.adapters import TwinHostAdapter
from torchhal.hal_core import DeviceCapabilities, DType, MemoryInfo
from torchhal.testing import CheckStatus, format_report, run_conformance
from torchhal.testing.context import CheckFailed, NotApplicable, each_device


def _devices(*ids: str) -> Any:
    return [SimpleNamespace(id=i) for i in ids]


def _by_id(outcomes: dict[str, str | Exception]) -> Any:
    seen: list[str] = []

    def check(device: Any) -> str:
        seen.append(device.id)
        outcome = outcomes[device.id]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return check, seen


def test_a_failure_before_a_device_not_applicable_is_kept_and_later_devices_run() -> None:
    check, seen = _by_id(
        {
            "d:0": CheckFailed("grew 10x"),
            "d:1": NotApplicable("declares fp8 only"),
            "d:2": CheckFailed("raised"),
        }
    )
    with pytest.raises(CheckFailed) as err:
        each_device(_devices("d:0", "d:1", "d:2"), check)
    assert str(err.value) == "d:0: grew 10x; d:2: raised"
    assert seen == ["d:0", "d:1", "d:2"]


def test_a_pass_beside_a_device_not_applicable_passes_naming_it() -> None:
    check, _ = _by_id({"d:0": NotApplicable("d:0 declares fp8 only"), "d:1": "fine"})
    assert each_device(_devices("d:0", "d:1"), check) == "not applicable: d:0 declares fp8 only; d:1: fine"


def test_not_applicable_only_when_no_device_applies() -> None:
    check, _ = _by_id({"d:0": NotApplicable("d:0 declares fp8 only"), "d:1": NotApplicable("no events")})
    with pytest.raises(NotApplicable) as err:
        each_device(_devices("d:0", "d:1"), check)
    assert str(err.value) == "d:0 declares fp8 only; d:1: no events"


class InflatedTwinBesideFp8Twin(TwinHostAdapter):
    """twin:0 over-reports used_bytes 10x (broken); twin:1 declares fp8 only, which the kit cannot
    fill, so the accounting check does not apply to it."""

    base: int | None = None

    def discover(self) -> Sequence[DeviceCapabilities]:
        first, second = super().discover()
        return [first, second.model_copy(update={"dtypes": frozenset({DType.FP8_E4M3})})]

    def memory_info(self, index: int) -> MemoryInfo:
        info = super().memory_info(index)
        if index:
            return info
        if self.base is None:
            self.base = info.used_bytes
        return info.model_copy(update={"used_bytes": self.base + 10 * (info.used_bytes - self.base)})


def test_the_kit_fails_the_broken_device_though_the_next_one_is_not_applicable() -> None:
    """The check was reported not applicable (twin:1's reason), hiding twin:0's failure."""
    report = run_conformance(InflatedTwinBesideFp8Twin(), seed=random.randrange(2**63))
    result = report.result("device.memory_accounting")
    assert result.status is CheckStatus.FAILED, format_report(report)
    assert result.reason.startswith("twin:0: used_bytes grew by "), result.reason
    timer = report.result("device.timer")  # twin:0 timed; twin:1 named, not applicable
    assert timer.status is CheckStatus.PASSED, timer.reason
    assert "not applicable: twin:1 declares none of" in timer.reason
