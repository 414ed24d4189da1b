"""backend_for: the process-group backend string chosen from recorded capabilities (no process group)."""

from __future__ import annotations

import pytest

from torchhal.hal_core import ConfigurationError, Device, DeviceCapabilities, DType, Feature
from torchhal.hal_core.adapters.cpu import CPUAdapter
from torchhal.hal_core.collectives import backend_for


def caps(
    vendor: str, device_type: str, backends: tuple[str, ...], index: int = 0, **extra: object
) -> DeviceCapabilities:
    fields: dict[str, object] = dict(
        vendor=vendor,
        adapter=vendor,
        device_type=device_type,
        index=index,
        name=f"recorded {vendor} {device_type}",
        arch="recorded",
        compute_units=4,
        simd_width=32,
        memory_bytes=2**30,
        dtypes=frozenset({DType.FP32}),
        collective_backends=backends,
    )
    fields.update(extra)
    return DeviceCapabilities.model_validate(fields)


H100 = caps("nvidia", "cuda", ("nccl", "gloo"))
MI300X = caps("amd", "cuda", ("nccl", "gloo"))  # ROCm torch: devices are cuda, RCCL is "nccl"
MAX1550 = caps("intel", "xpu", ("xccl", "gloo"))
HOST = caps("cpu", "cpu", ("gloo",))
SIM = caps("simasic", "cpu", ("gloo",), features=frozenset({Feature.SIMULATED}))
SIM_OWN_TYPE = caps("simasic", "simasic", ("gloo",), features=frozenset({Feature.SIMULATED}))


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ([H100], "cuda:nccl,cpu:gloo"),
        ([H100, caps("nvidia", "cuda", ("nccl",), index=1)], "cuda:nccl,cpu:gloo"),
        ([MI300X], "cuda:nccl,cpu:gloo"),
        ([MAX1550], "xpu:xccl,cpu:gloo"),
        ([HOST], "gloo"),
        ([SIM], "gloo"),
        ([SIM_OWN_TYPE], "gloo"),
        ([HOST, H100], "cuda:nccl,cpu:gloo"),
        ([H100, MAX1550, HOST], "cuda:nccl,xpu:xccl,cpu:gloo"),
    ],
    ids=["cuda", "two-cuda", "rocm", "xpu", "cpu", "simulated", "simulated-own-type", "cpu+cuda", "mixed"],
)
def test_backend_for_recorded_capabilities(devices: list[DeviceCapabilities], expected: str) -> None:
    assert backend_for(devices) == expected


def test_one_device_type_cannot_have_two_backends() -> None:
    other = caps("acme", "cuda", ("acmecl",))
    with pytest.raises(
        ConfigurationError, match=r"cuda tensors: nvidia:0 .* needs 'nccl' but acme:0 .* 'acmecl'"
    ):
        backend_for([H100, other])


def test_a_device_without_a_backend_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"device nvidia:0 .* declares no collective backend"):
        backend_for([caps("nvidia", "cuda", ())])


def test_a_device_uses_its_adapters_backend_over_declared_ones() -> None:
    """For a Device, the adapter's collective_backend() decides; here it says gloo, the caps say nccl."""
    device = Device(CPUAdapter(), H100)
    assert backend_for([device]) == "cuda:gloo,cpu:gloo"
