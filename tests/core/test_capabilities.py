"""The versioned records: frozen, and refused when written under another schema version."""

from __future__ import annotations

from datetime import datetime, timezone

import pydantic
import pytest

from tests.core.adapters import fake_caps
from torchhal.hal_core import (
    SCHEMA_VERSION,
    ConfigurationError,
    DeviceCapabilities,
    DeviceRequirements,
    HealthReport,
    HealthStatus,
    Link,
    LinkType,
    MeasuredProfile,
    Topology,
)


def measured(**overrides: object) -> MeasuredProfile:
    fields: dict[str, object] = dict(
        fingerprint="0123456789abcdef",
        device_id="acme:0",
        device_name="Acme Test Accelerator",
        simulated=False,
        matmul_tflops={"fp32": 1.5},
        matmul_sizes={"fp32": 256},
        copy_bandwidth_gbps=20.0,
        copy_bytes=2**20,
        launch_latency_us=3.0,
        measured_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
        torch_version="2.0",
    )
    fields.update(overrides)
    return MeasuredProfile.model_validate(fields)


@pytest.mark.parametrize("make", [fake_caps, measured], ids=["DeviceCapabilities", "MeasuredProfile"])
def test_records_are_frozen(make):
    record = make()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        record.schema_version = SCHEMA_VERSION + 1


@pytest.mark.parametrize(
    ("model", "make"),
    [(DeviceCapabilities, fake_caps), (MeasuredProfile, measured)],
    ids=["DeviceCapabilities", "MeasuredProfile"],
)
def test_another_schema_version_is_refused_naming_field_supported_and_seen(model, make):
    seen = SCHEMA_VERSION + 98
    with pytest.raises(pydantic.ValidationError) as err:
        make(schema_version=seen)
    (error,) = err.value.errors()
    assert error["loc"] == ("schema_version",)
    assert f"this torchhal reads schema_version {SCHEMA_VERSION}, got {seen}" in error["msg"]
    assert model.__name__ in str(err.value)
    with pytest.raises(pydantic.ValidationError, match="schema_version"):
        model.model_validate_json(make().model_copy(update={"schema_version": seen}).model_dump_json())


@pytest.mark.parametrize("value", [True, 1.5])
def test_requirement_counts_are_counts_not_bools_or_fractions(value):
    """min_memory_bytes=True became 1 byte."""
    with pytest.raises(ConfigurationError, match="min_memory_bytes"):
        DeviceRequirements(min_memory_bytes=value)
    assert DeviceRequirements(min_memory_bytes=16e9).min_memory_bytes == 16 * 10**9


def test_tf32_without_fp32_is_refused_naming_the_declared_dtypes():
    """tf32 is a mode of fp32 matmuls: declared alone, the kit's dtype check failed with an
    allocation error far from the declaration."""
    from torchhal.hal_core import DType

    with pytest.raises(pydantic.ValidationError, match=r"tf32 is a mode of fp32 matmuls.*\['bf16', 'tf32'\]"):
        fake_caps(dtypes=frozenset({DType.TF32, DType.BF16}))
    assert DType.TF32 in fake_caps(dtypes=frozenset({DType.TF32, DType.FP32})).dtypes


@pytest.mark.parametrize(
    ("temperature", "limit", "ecc", "unread"),
    [
        (float("nan"), 90.0, None, "GPU temperature, ECC count"),  # NaN < 90 is False, NaN >= 90 too
        (70.0, float("nan"), None, "slowdown, ECC count"),  # was OK: "below the slowdown nan C"
        (float("inf"), 90.0, -1, "GPU temperature, ECC count"),
    ],
)
def test_a_reading_no_sensor_gives_is_not_read_as_a_good_one(temperature, limit, ecc, unread):
    report = HealthReport.from_readings(
        "nvml",
        temperature=("GPU temperature", temperature),
        limit=("slowdown", limit),
        ecc=("ECC", ecc),
        utilization_pct=250.0,
    )
    assert report.status is HealthStatus.UNKNOWN
    assert report.messages == (f"nvml did not report: {unread}",)
    assert report.utilization_pct is None
    for field, value in (("temperature_c", float("nan")), ("ecc_errors", -1), ("utilization_pct", -3.0)):
        with pytest.raises(pydantic.ValidationError, match=field):
            HealthReport(status=HealthStatus.OK, **{field: value})


def test_readings_that_were_read_still_decide():
    hot = HealthReport.from_readings(
        "nvml",
        temperature=("GPU temperature", 95.0),
        limit=("slowdown", 90.0),
        ecc=("ECC", 0),
        utilization_pct=40.0,
    )
    assert hot.status is HealthStatus.DEGRADED and hot.utilization_pct == 40.0
    assert hot.messages == ("GPU temperature 95 C is at or above the slowdown 90 C",)


def test_a_topology_links_only_devices_it_lists():
    """A link to an unlisted device was accepted, and islands() then raised 'x not in tuple'."""
    link = Link(a="acme:0", b="acme:7", type=LinkType.NVLINK, source="declared")
    with pytest.raises(
        pydantic.ValidationError, match="link acme:0-acme:7 names acme:7, which devices does not list"
    ):
        Topology(devices=("acme:0", "acme:1"), links=(link,))
    assert Topology(devices=("acme:0", "acme:7"), links=(link,)).islands() == [("acme:0", "acme:7")]
