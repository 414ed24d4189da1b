"""The conformance kit: the CPU adapter passes; each broken adapter fails exactly the check it breaks."""

from __future__ import annotations

import json
import sys

import pytest

from tests.testing import adapters
from tests.testing.adapters import CPU_NOT_APPLICABLE
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import ConfigurationError, DType, InvalidArgumentError
from torchhal.testing import CheckStatus, ConformanceReport, checks_adapter, format_report, run_conformance


def by_status(report: ConformanceReport, status: CheckStatus) -> set[str]:
    return {c.check for c in report.checks if c.status is status}


@pytest.fixture(scope="module")
def cpu_report() -> ConformanceReport:
    return run_conformance("cpu", hal=HardwareAbstractionLayer())


def test_cpu_adapter_passes_every_applicable_check(cpu_report: ConformanceReport) -> None:
    assert cpu_report.ok, format_report(cpu_report)
    assert by_status(cpu_report, CheckStatus.NOT_APPLICABLE) == CPU_NOT_APPLICABLE
    assert by_status(cpu_report, CheckStatus.FAILED) == set()
    assert all(c.status is CheckStatus.PASSED for c in cpu_report.checks if c.mandatory)
    assert cpu_report.adapter == "cpu" and [d["id"] for d in cpu_report.devices] == ["cpu"]


def test_every_check_appears_with_a_reason(cpu_report: ConformanceReport) -> None:
    ids = [c.check for c in cpu_report.checks]
    assert len(ids) == len(set(ids))
    assert {f"dtype.{d.value}" for d in DType} <= set(ids)
    assert all(c.reason.strip() for c in cpu_report.checks)


def test_report_json_lists_checks_devices_versions_and_summary(cpu_report: ConformanceReport) -> None:
    import torch

    doc = json.loads(cpu_report.to_json())
    assert doc["adapter"] == "cpu" and doc["ok"] is True
    assert doc["torch_version"] == torch.__version__
    assert doc["devices"] == [
        {"id": "cpu", "name": d["name"], "arch": d["arch"], "device_type": "cpu", "simulated": False}
        for d in cpu_report.devices
    ]
    statuses = [c["status"] for c in doc["checks"]]
    assert set(statuses) <= {"passed", "failed", "not_applicable"}
    assert doc["summary"] == {
        "passed": statuses.count("passed"),
        "failed": 0,
        "not_applicable": len(CPU_NOT_APPLICABLE),
        "total": len(statuses),
    }
    assert doc["seed"] == cpu_report.seed


def test_format_report_is_a_table_with_a_verdict(cpu_report: ConformanceReport) -> None:
    text = format_report(cpu_report)
    for result in cpu_report.checks:
        assert result.check in text
    assert "DOES NOT CONFORM" not in text and text.rstrip().endswith("CONFORMS")


def test_adapter_by_unknown_name_is_a_clear_error() -> None:
    known = r"\(adapters, their hardware present or not: .*cpu"
    with pytest.raises(ConfigurationError, match=rf"no adapter named 'warp9' {known}"):
        run_conformance("warp9", hal=HardwareAbstractionLayer())


def test_a_sound_two_device_adapter_and_correct_kernels_pass() -> None:
    for adapter in (adapters.TwinHostAdapter(), adapters.GoodKernels()):
        report = run_conformance(adapter)
        assert report.ok, format_report(report)
    kernels = by_status(report, CheckStatus.PASSED)
    assert {"kernel.matmul/cpu/einsum", "kernel.attention/cpu/sdpa", "kernel.rms_norm/cpu/aten"} <= kernels
    # its predicate declines all but the odd and the aligned 2-D cases, which run in 4 dtypes
    einsum = report.result("kernel.matmul/cpu/einsum").reason
    assert (
        einsum.startswith("8 case(s) within tolerance") and "20 case(s) declined by its predicate" in einsum
    )


BROKEN = [
    (adapters.AsymmetricTopology, "adapter.topology", "disagree by direction"),
    (adapters.ForeignTopology, "adapter.topology", "not of this adapter: ['cuda:7']"),
    (adapters.FrozenMemory, "device.memory_accounting", "used_bytes grew by 0 bytes"),
    (adapters.OverfullMemory, "device.memory_info", "> total_bytes"),
    (adapters.InflatedMemory, "device.memory_accounting", "it plus 1/8 of it or 4 MiB, whichever is more"),
    (adapters.RepeatedLink, "adapter.topology", "the link twin:0->twin:1 is listed 2 times"),
    (adapters.NegativeBandwidth, "adapter.topology", "bandwidth_gbps"),
    (adapters.ShiftingDiscovery, "adapter.discover", "other records on a second call"),
    (adapters.TensorSwitch, "adapter.numerics_settings", "must map names to bool, int, float, str or None"),
    (adapters.CountingSwitch, "adapter.numerics_settings", "answered differently on two reads"),
    (adapters.Fp8Unstorable, "dtype.fp8_e4m3", "cannot allocate torch.float8_e4m3fn"),
    (adapters.DuplicateIndexes, "adapter.discover", "indexes must be unique, repeated: [0]"),
    (adapters.RaisingProbe, "adapter.probe", "RuntimeError: driver exploded"),
    (adapters.FutureApi, "adapter.attributes", "(2, 3) does not cover"),
    (adapters.ZeroTimer, "device.timer", "must be a finite number > 0, got 0.0"),
    (adapters.EventsClaimedNotUsed, "device.timer_events", "HostTimer"),
    (adapters.GraphsClaimedNotCaptured, "device.graphs", "NotImplementedError: adapter"),
    (adapters.StaleReplay, "device.graphs", "did not recompute the captured x * 2"),
    (adapters.UnknownBackend, "collectives.backend", "'warpdrive'"),
    (adapters.UnavailableBackendDeclared, "collectives.all_reduce", "warpdrive: declared but not available"),
    (adapters.RaisingSynchronize, "device.synchronize", "cpu: raised RuntimeError: stream 0 lost"),
    (adapters.WrongHealth, "device.health", "must return HealthReport"),
    (adapters.WrongKernel, "kernel.matmul/cpu/sloppy", "fp32"),
    (adapters.RaisingPredicate, "kernel.matmul/cpu/fragile", "predicate raised KeyError"),
    (adapters.DtypeChangingKernel, "kernel.matmul/cpu/upcast", "is torch.float32"),
    (adapters.WrongAndScribbling, "kernel.rms_norm/cpu/sloppy", "output 0: error"),
    (adapters.ScribblingKernel, "kernel.swiglu/cpu/inplace", "modified its input(s) 'up' in place"),
    (adapters.IndexScribbling, "kernel.linear_cross_entropy/cpu/inplace", "input(s) 'target' in place"),
    (adapters.FastShapesOnly, "kernel.attention/cpu/flashish", "x64: output 0: error"),
    (adapters.RaisingRegistration, "kernels.register", "no_such_op"),
]


@pytest.mark.parametrize(("adapter_class", "check", "reason"), BROKEN, ids=[b[0].__name__ for b in BROKEN])
def test_broken_adapter_fails_exactly_the_right_check(adapter_class: type, check: str, reason: str) -> None:
    report = run_conformance(adapter_class())
    assert not report.ok
    assert by_status(report, CheckStatus.FAILED) == {check}, format_report(report)
    assert reason in report.result(check).reason


def test_a_raising_probe_blocks_the_rest_with_a_reason() -> None:
    report = run_conformance(adapters.RaisingProbe())
    rest = [c for c in report.checks if c.check not in ("adapter.attributes", "adapter.probe")]
    assert rest and all(c.status is CheckStatus.NOT_APPLICABLE for c in rest)
    assert all("blocked: probe() raised RuntimeError" in c.reason for c in rest)
    assert report.devices == ()


def test_a_raising_synchronize_blocks_the_checks_that_wait_on_the_device() -> None:
    report = run_conformance(adapters.RaisingSynchronize())
    blocked = {c.check for c in report.checks if "blocked: synchronize() failed" in c.reason}
    assert blocked == {"device.memory_accounting", "device.timer", "collectives.all_reduce"}
    assert by_status(report, CheckStatus.PASSED) >= {"device.memory_info", "device.health", "dtype.fp32"}


def test_a_device_without_a_fillable_dtype_makes_all_reduce_not_applicable() -> None:
    report = run_conformance(adapters.Fp8OnlyHost())
    result = report.result("collectives.all_reduce")
    assert result.status is CheckStatus.NOT_APPLICABLE, result.reason
    assert result.reason.startswith("gloo: cpu declares none of")


def test_a_check_past_its_time_limit_fails_naming_the_call_and_the_run_goes_on() -> None:
    adapter = adapters.HangingSynchronize()
    try:
        report = run_conformance(adapter, time_limit_s=0.5)
    finally:
        adapter.release.set()
    assert by_status(report, CheckStatus.FAILED) == {"device.synchronize"}, format_report(report)
    reason = report.result("device.synchronize").reason
    assert "did not finish within the 0.5 s time limit: stuck in synchronize()" in reason
    waiting = report.result("device.memory_accounting")
    assert waiting.status is CheckStatus.NOT_APPLICABLE and "it has not returned" in waiting.reason


def test_a_check_interrupted_raises_the_interrupt_in_the_callers_thread() -> None:
    """A check ending in a BaseException left no outcome in its thread, which the kit took for a
    timeout and then failed looking up the finished thread's frame (a bare KeyError).
    KeyboardInterrupt stops the run; SystemExit fails the check (test_kit_exits_and_hangs)."""
    from torchhal.testing.suite import Check, ConformanceSuite

    def interrupt(ctx: object) -> str:
        raise KeyboardInterrupt("stop")

    suite = ConformanceSuite(adapters.TwinHostAdapter(), time_limit_s=5)
    with pytest.raises(KeyboardInterrupt, match="stop"):
        suite.run_check(Check("x.interrupt", "interrupted", True, interrupt))
    exited = suite.run_check(Check("x.exit", "exits", True, lambda ctx: sys.exit(3)))
    assert exited.status is CheckStatus.FAILED and exited.reason.startswith("raised SystemExit: 3")


@pytest.mark.parametrize("limit", [0, -1, float("nan"), float("inf"), True, "60"])
def test_the_time_limit_must_be_a_finite_positive_number(limit: object) -> None:
    with pytest.raises(
        InvalidArgumentError, match=f"time_limit_s must be a finite number > 0, got {limit!r}"
    ):
        run_conformance(adapters.TwinHostAdapter(), time_limit_s=limit)  # type: ignore[arg-type]


def test_an_absent_runtime_conforms_with_everything_else_not_applicable() -> None:
    report = run_conformance(adapters.AbsentRuntime())
    assert report.ok
    assert by_status(report, CheckStatus.PASSED) == {"adapter.attributes", "adapter.probe"}
    assert "no such runtime on this machine" in report.result("device.memory_info").reason
    assert format_report(report).endswith(
        "CONFORMS (no device present: only the adapter object and its probe were checked)"
    )


def test_a_slow_probe_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checks_adapter, "PROBE_BUDGET_S", adapters.SlowProbe.delay_s / 2)
    report = run_conformance(adapters.SlowProbe())
    assert by_status(report, CheckStatus.FAILED) == {"adapter.probe"}
    assert "the budget is" in report.result("adapter.probe").reason


def test_the_seed_replays_the_random_inputs() -> None:
    def kernel_reasons(seed: int) -> list[str]:
        report = run_conformance(adapters.EinsumMatmul(), seed=seed)
        return [c.reason for c in report.checks if c.check.startswith("kernel.")]

    first = kernel_reasons(1234)
    assert kernel_reasons(1234) == first
    assert kernel_reasons(4321) != first


def test_the_same_adapter_instance_from_a_hal_is_certified() -> None:
    hal = HardwareAbstractionLayer(adapters=[adapters.TwinHostAdapter()])
    report = run_conformance("twin", hal=hal)
    assert report.ok and report.adapter == "twin"
    assert [d["id"] for d in report.devices] == ["twin:0", "twin:1"]


def test_the_kits_registry_keeps_each_ops_memo_setting() -> None:
    """attention_varlen's signature reads its offsets' contents on the CPU, so calls there opt out
    of the argument memo; the kit's copy of the core ops must keep that, or a second CPU call with
    new offsets of the same shape would skip their validation."""
    from torchhal.testing.context import AdapterUnderTest

    registry = AdapterUnderTest(adapters.GoodKernels(), seed=0).kernel_registry()
    core = HardwareAbstractionLayer()

    def memo_settings(kernels):
        return {op: (kernels.op(op).memoize, kernels.op(op).reads_values_on) for op in kernels.ops()}

    assert memo_settings(registry) == memo_settings(core.kernels)
    for op in ("attention_varlen", "attention_varlen_forward", "attention_varlen_backward"):
        assert registry.op(op).reads_values_on == frozenset({"cpu"})
