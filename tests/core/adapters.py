"""Small adapters for tests: a configurable fake accelerator built on recorded facts."""

from __future__ import annotations

from collections.abc import Sequence

from torchhal.hal_core import (
    DeviceCapabilities,
    DType,
    Feature,
    HealthReport,
    HealthStatus,
    MemoryInfo,
    ProbeResult,
    Topology,
    VendorAdapter,
)


def fake_caps(index: int = 0, **overrides: object) -> DeviceCapabilities:
    fields: dict[str, object] = dict(
        vendor="acme",
        adapter="acme",
        device_type="cpu",
        index=index,
        name="Acme Test Accelerator",
        arch="acme-1",
        compute_units=8,
        simd_width=16,
        memory_bytes=2**34,
        dtypes=frozenset({DType.FP32, DType.BF16}),
        features=frozenset({Feature.TENSOR_CORES}),
        collective_backends=("gloo",),
    )
    fields.update(overrides)
    return DeviceCapabilities.model_validate(fields)


class FakeAdapter(VendorAdapter):
    """An adapter over a fixed list of capabilities; tensors live on the host."""

    name = "acme"
    vendor = "acme"
    priority = 50
    namespace = "acme"

    def __init__(self, devices: Sequence[DeviceCapabilities] = (), available: bool = True) -> None:
        self._devices = list(devices) or [fake_caps()]
        self._available = available

    def probe(self) -> ProbeResult:
        return ProbeResult(
            available=self._available, reason="recorded facts" if self._available else "no acme"
        )

    def discover(self) -> Sequence[DeviceCapabilities]:
        return self._devices

    def synchronize(self, index: int) -> None:
        """Host tensors: nothing is queued."""

    def memory_info(self, index: int) -> MemoryInfo:
        total = self._devices[index].memory_bytes
        return MemoryInfo(total_bytes=total, free_bytes=total, used_bytes=0)

    def health(self, index: int) -> HealthReport:
        return HealthReport(status=HealthStatus.OK)

    def topology(self) -> Topology:
        return Topology(devices=tuple(f"acme:{c.index}" for c in self._devices))

    def collective_backend(self) -> str:
        return "gloo"
