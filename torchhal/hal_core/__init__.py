"""The HAL core: contracts for adapters, devices, kernels and collectives.

Plugins import the names re-exported here and nothing deeper. This package never imports
torchhal's subsystems (kernels, distributed, evaluation, inference).
"""

from torchhal.hal_core import telemetry, torch_flags
from torchhal.hal_core.adapter import (
    HAL_API_VERSION,
    DeviceTimer,
    EventTimer,
    HostTimer,
    ProbedAdapter,
    VendorAdapter,
)
from torchhal.hal_core.capabilities import (
    SCHEMA_VERSION,
    CollectiveBandwidth,
    DeclaredPeaks,
    DeviceCapabilities,
    DeviceRequirements,
    DType,
    Feature,
    HealthReport,
    HealthStatus,
    Link,
    LinkType,
    MeasuredProfile,
    MemoryInfo,
    ProbeResult,
    Topology,
)
from torchhal.hal_core.device import Device
from torchhal.hal_core.errors import (
    CallDeclined,
    CollectiveError,
    ConfigurationError,
    DeviceNotFoundError,
    DeviceOutOfMemoryError,
    InvalidArgumentError,
    KernelFailedError,
    NoDeviceMatchesError,
    PluginError,
    TorchHALError,
    UnknownOpError,
    UnsupportedError,
)
from torchhal.hal_core.hookspecs import hookimpl
from torchhal.hal_core.kernels import Candidate, KernelRegistry, RejectionReason, Selection, Unsupported
from torchhal.hal_core.live import LiveProbe, record_probe
from torchhal.hal_core.recorded import RecordedProbe

__all__ = [
    "HAL_API_VERSION",
    "SCHEMA_VERSION",
    "CallDeclined",
    "Candidate",
    "CollectiveBandwidth",
    "CollectiveError",
    "ConfigurationError",
    "DType",
    "DeclaredPeaks",
    "Device",
    "DeviceCapabilities",
    "DeviceNotFoundError",
    "DeviceOutOfMemoryError",
    "DeviceRequirements",
    "DeviceTimer",
    "EventTimer",
    "Feature",
    "HealthReport",
    "HealthStatus",
    "HostTimer",
    "InvalidArgumentError",
    "KernelFailedError",
    "KernelRegistry",
    "Link",
    "LinkType",
    "LiveProbe",
    "MeasuredProfile",
    "MemoryInfo",
    "NoDeviceMatchesError",
    "PluginError",
    "ProbeResult",
    "ProbedAdapter",
    "RecordedProbe",
    "RejectionReason",
    "Selection",
    "Topology",
    "TorchHALError",
    "UnknownOpError",
    "Unsupported",
    "UnsupportedError",
    "VendorAdapter",
    "hookimpl",
    "record_probe",
    "telemetry",
    "torch_flags",
]
