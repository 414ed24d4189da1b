"""The simulated ASIC adapter, a third-party-style plugin, passes the conformance kit."""

from __future__ import annotations

import pytest

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import DType
from torchhal.testing import CheckStatus, format_report, run_conformance

pytest.importorskip(
    "torchhal_simasic", reason="the torchhal-simasic plugin is not installed in this environment"
)


@pytest.mark.parametrize(("spec", "devices"), [("edge", "2"), ("h100-like", "1")])
def test_simasic_conforms(monkeypatch: pytest.MonkeyPatch, spec: str, devices: str) -> None:
    monkeypatch.setenv("TORCHHAL_SIMASIC_SPEC", spec)
    monkeypatch.setenv("TORCHHAL_SIMASIC_DEVICES", devices)
    report = run_conformance("simasic", hal=HardwareAbstractionLayer())
    assert report.ok, format_report(report)
    assert [d["id"] for d in report.devices] == [f"simasic:{i}" for i in range(int(devices))]
    assert all(d["simulated"] for d in report.devices)

    declared = set(DType) - {
        DType(c.check.removeprefix("dtype."))
        for c in report.checks
        if c.check.startswith("dtype.") and c.status is CheckStatus.NOT_APPLICABLE
    }
    assert DType.FP64 not in declared  # the simulated array has no fp64: its check must not pass
    passed = {c.check for c in report.checks if c.status is CheckStatus.PASSED}
    assert {f"dtype.{d.value}" for d in declared} <= passed
    assert {"device.timer_events", "collectives.all_reduce", "device.memory_accounting"} <= passed
    assert {
        "kernel.matmul/simasic/simasic",
        "kernel.rms_norm/simasic/simasic",
        "kernel.attention/simasic/simasic",
    } <= passed
    if int(devices) > 1:
        assert "1 link(s)" in report.result("adapter.topology").reason
