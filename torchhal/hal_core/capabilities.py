"""What a device is (declared) and what it was measured to do (measured), as frozen pydantic models.

Declared facts come from the vendor runtime or a datasheet; measured facts come from
`profile.py`. The two are separate models so that no figure can pass for the other.
"""

from __future__ import annotations

import enum
import math
import sys
from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from torchhal.hal_core.errors import ConfigurationError, InvalidArgumentError

if TYPE_CHECKING:
    import torch

SCHEMA_VERSION = 1


class DType(str, enum.Enum):
    """Numeric formats a device can compute in. `tf32` is a matmul mode, not a tensor dtype."""

    FP64 = "fp64"
    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    FP8_E4M3_FNUZ = "fp8_e4m3fnuz"
    FP8_E5M2_FNUZ = "fp8_e5m2fnuz"
    INT8 = "int8"

    @property
    def rate_unit(self) -> str:
        """The unit of a compute rate in this format: int8 operations are not floating-point ones."""
        return "TOP/s" if self is DType.INT8 else "TFLOP/s"

    def to_torch(self) -> torch.dtype | None:
        """The torch dtype of this format; None for tf32, which torch has only as a mode."""
        import torch

        return None if self is DType.TF32 else getattr(torch, _TORCH_NAMES[self])

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> DType | None:
        """The DType of a torch dtype, or None when torchhal does not track that format."""
        name = str(dtype).removeprefix("torch.")
        for member, torch_name in _TORCH_NAMES.items():
            if torch_name == name:
                return member
        return None


_TORCH_NAMES = {
    DType.FP64: "float64",
    DType.FP32: "float32",
    DType.BF16: "bfloat16",
    DType.FP16: "float16",
    DType.FP8_E4M3: "float8_e4m3fn",
    DType.FP8_E5M2: "float8_e5m2",
    DType.FP8_E4M3_FNUZ: "float8_e4m3fnuz",
    DType.FP8_E5M2_FNUZ: "float8_e5m2fnuz",
    DType.INT8: "int8",
}


class Feature(str, enum.Enum):
    """Capabilities that change which kernels, timers and collectives can be used."""

    TENSOR_CORES = "tensor_cores"  # matrix units (NVIDIA tensor cores, AMD matrix cores, Intel XMX)
    FP8 = "fp8"
    GRAPHS = "graphs"  # capture and replay of launch sequences
    P2P = "p2p"  # direct device-to-device access
    TRITON = "triton"  # Triton can compile for this device
    UNIFIED_MEMORY = "unified_memory"
    DEVICE_EVENTS = "device_events"  # device-side timing events
    ECC = "ecc"
    SIMULATED = "simulated"  # time and memory are modelled, numerics are real


class LinkType(str, enum.Enum):
    NVLINK = "nvlink"
    XGMI = "xgmi"
    XE_LINK = "xe_link"
    PCIE = "pcie"
    HOST = "host"  # through host memory (CPU, or a device without a direct path)


# What a measurement gives: a rate or a time is finite and positive, a size is positive. A cache
# file holding anything else was not written by a measurement (hand-edited, or another tool).
MeasuredFigure = Annotated[float, Field(gt=0, allow_inf_nan=False)]
MeasuredSize = Annotated[int, Field(gt=0)]
# A datasheet figure is held to the same rule: a spec's clock of 1e308 gave an infinite peak that
# ranked its device first and made its op times 0.
DeclaredFigure = MeasuredFigure


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_serializer("*", when_used="json")
    def _sets_sorted(self, value: Any) -> Any:
        """Sets dump sorted: frozenset order follows string hashing, which changes per process,
        and the same device must give the same JSON (reports, fingerprints, digests)."""
        if isinstance(value, (set, frozenset)):
            return sorted(v.value if isinstance(v, enum.Enum) else v for v in value)
        return value


class DeclaredPeaks(_Frozen):
    """Datasheet figures. Declared, never measured: `source` names the datasheet."""

    source: str
    tflops: dict[DType, DeclaredFigure] = Field(default_factory=dict)
    memory_bandwidth_gbps: DeclaredFigure | None = None


class _Versioned(_Frozen):
    """A record that outlives the process (profile caches, reports): one written under another
    schema version is refused, never read as if its fields meant the same."""

    schema_version: int = SCHEMA_VERSION

    @field_validator("schema_version")
    @classmethod
    def _supported(cls, version: int) -> int:
        if version != SCHEMA_VERSION:
            raise ValueError(f"this torchhal reads schema_version {SCHEMA_VERSION}, got {version}")
        return version


class DeviceCapabilities(_Versioned):
    """One physical device as its adapter declares it."""

    vendor: str
    adapter: str
    device_type: str  # as torch knows it: cuda, xpu, cpu, or a PrivateUse1 name
    index: int = Field(ge=0)
    name: str
    arch: str  # sm_90, gfx942, xe-hpc, x86_64, ...
    compute_units: int = Field(ge=1)  # SMs, CUs, Xe cores, CPU cores, systolic arrays
    simd_width: int = Field(ge=1)  # warp 32, wavefront 64 or 32, sub-group, vector lanes
    memory_bytes: int = Field(ge=0)  # 0: the runtime does not say (the host on Windows)
    dtypes: frozenset[DType]
    features: frozenset[Feature] = frozenset()
    collective_backends: tuple[str, ...] = ()
    kernel_backends: tuple[str, ...] = ()
    shared_memory_per_block_bytes: int | None = None
    l2_cache_bytes: int | None = None
    declared_peaks: DeclaredPeaks | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    driver_version: str | None = None

    @field_validator("dtypes")
    @classmethod
    def _tf32_is_a_mode_of_fp32(cls, dtypes: frozenset[DType]) -> frozenset[DType]:
        """tf32 is how fp32 matmuls may run, not a storage format: declared without fp32, every
        check that allocates a tf32 tensor (there is no such torch dtype) failed far from here."""
        if DType.TF32 in dtypes and DType.FP32 not in dtypes:
            declared = sorted(d.value for d in dtypes)
            raise ValueError(f"tf32 is a mode of fp32 matmuls: declaring it needs fp32 too, got {declared}")
        return dtypes

    @property
    def simulated(self) -> bool:
        return Feature.SIMULATED in self.features

    def supports_dtype(self, dtype: DType | torch.dtype) -> bool:
        if not isinstance(dtype, DType):
            converted = DType.from_torch(dtype)
            if converted is None:
                return False
            dtype = converted
        return dtype in self.dtypes

    def has(self, feature: Feature) -> bool:
        return feature in self.features

    @property
    def memory_text(self) -> str:
        """Capacity for people to read; "memory not stated" for 0, which is not a measurement."""
        return f"{self.memory_bytes / 2**30:.1f} GiB" if self.memory_bytes else "memory not stated"


class CollectiveBandwidth(_Frozen):
    backend: str
    collective: str
    world_size: MeasuredSize
    message_bytes: MeasuredSize
    bus_bandwidth_gbps: MeasuredFigure


class MeasuredProfile(_Versioned):
    """What `profile.py` measured on one device. Simulated devices report simulated time.

    `direct_*` are the same measurements made with plain torch calls that bypass the HAL, in
    the same run, so the HAL's own figures always stand beside a peer (None when simulated).
    Copy bandwidth counts bytes read plus bytes written.
    """

    fingerprint: str
    device_id: str
    device_name: str
    simulated: bool
    matmul_tflops: dict[DType, MeasuredFigure]
    matmul_sizes: dict[DType, MeasuredSize]  # n of the n×n×n products, grown until a call takes ~10 ms
    copy_bandwidth_gbps: MeasuredFigure
    copy_bytes: MeasuredSize
    launch_latency_us: MeasuredFigure
    direct_matmul_tflops: dict[DType, MeasuredFigure] | None = None
    direct_copy_bandwidth_gbps: MeasuredFigure | None = None
    direct_launch_latency_us: MeasuredFigure | None = None
    collective_bandwidth: tuple[CollectiveBandwidth, ...] = ()
    measured_at: datetime
    torch_version: str
    notes: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _figures_with_sizes(self) -> MeasuredProfile:
        """Each dtype's rate comes with the size it was measured at (`torchhal profile` prints them
        together: a hand-edited cache file with one and not the other crashed it), and a direct
        figure stands beside a HAL figure of its dtype."""
        rates, sizes = set(self.matmul_tflops), set(self.matmul_sizes)
        if rates != sizes:
            raise ValueError(
                "matmul_tflops and matmul_sizes must name the same dtypes, "
                f"got {sorted(rates)} and {sorted(sizes)}"
            )
        direct = set(self.direct_matmul_tflops or ())
        if not direct <= rates:
            raise ValueError(
                f"direct_matmul_tflops names {sorted(direct - rates)}, which matmul_tflops lacks"
            )
        return self


MemoryFigure = Literal["total", "free", "used"]
MEMORY_FIGURES: tuple[MemoryFigure, ...] = ("total", "free", "used")


class MemoryInfo(_Frozen):
    """Device memory as the runtime reports it. `used_bytes` is this process's allocations.

    `unknown` names the figures the runtime does not give (the host's free memory on macOS,
    every figure on Windows); each is 0 in its int field, which stays an int for readers of the
    fields, so a 0 there is not a measurement. Read figures through `known()`, which says None.
    """

    total_bytes: int = Field(ge=0)
    free_bytes: int = Field(ge=0)
    used_bytes: int = Field(ge=0)
    simulated: bool = False
    unknown: frozenset[MemoryFigure] = frozenset()

    @model_validator(mode="after")
    def _unknown_is_zero(self) -> MemoryInfo:
        """An unknown figure holding a number would be read as a measurement by the int field."""
        for figure in sorted(self.unknown):
            value = getattr(self, f"{figure}_bytes")
            if value != 0:
                raise ValueError(f"{figure}_bytes must be 0 when 'unknown' names {figure!r}, got {value}")
        return self

    def known(self, figure: MemoryFigure) -> int | None:
        """The figure ("total", "free" or "used") in bytes, or None where the runtime does not give it."""
        if figure not in MEMORY_FIGURES:
            raise InvalidArgumentError(
                f"MemoryInfo.known: figure must be one of {MEMORY_FIGURES}, got {figure!r}"
            )
        value: int = getattr(self, f"{figure}_bytes")
        return None if figure in self.unknown else value


class HealthStatus(str, enum.Enum):
    OK = "ok"
    DEGRADED = "degraded"
    FAILED = "failed"
    UNKNOWN = "unknown"  # the runtime offers no health information


class HealthReport(_Frozen):
    status: HealthStatus
    temperature_c: float | None = Field(default=None, allow_inf_nan=False)
    ecc_errors: int | None = Field(default=None, ge=0)
    utilization_pct: float | None = Field(default=None, ge=0, le=100)
    messages: tuple[str, ...] = ()

    @classmethod
    def from_readings(
        cls,
        source: str,
        *,
        temperature: tuple[str, float | None],
        limit: tuple[str, float | None],
        ecc: tuple[str, int | None],
        utilization_pct: float | None,
    ) -> HealthReport:
        """A GPU's report from what its management library (`source`) read: each reading is
        (name, value or None). DEGRADED at or above the temperature limit or on ECC errors, OK
        only when some check could be made, UNKNOWN when none could, so a reading that never came
        is never taken as a good one; the messages name what `source` did not report."""
        (t_name, t), (l_name, lim), (e_name, errors) = temperature, limit, ecc
        # a value no sensor gives (NaN, infinite, a negative count) is a reading that never came:
        # NaN compared below every limit and read as a good temperature
        t, lim = _readable(t), _readable(lim)
        errors = errors if errors is None or errors >= 0 else None
        usage = _readable(utilization_pct)
        utilization_pct = usage if usage is not None and 0 <= usage <= 100 else None
        problems, passed = [], []
        if t is not None and lim is not None:
            if t >= lim:
                problems.append(f"{t_name} {t:g} C is at or above the {l_name} {lim:g} C")
            else:
                passed.append(f"{t_name} {t:g} C, below the {l_name} {lim:g} C")
        if errors:
            problems.append(f"{errors} {e_name} error(s)")
        elif errors is not None:
            passed.append(f"no {e_name} errors")
        named = ((t_name, t), (l_name, lim), (f"{e_name} count", errors))
        unread = [name for name, value in named if value is None]
        status = HealthStatus.DEGRADED if problems else (HealthStatus.OK if passed else HealthStatus.UNKNOWN)
        missing = (f"{source} did not report: {', '.join(unread)}",) if unread else ()
        return cls(
            status=status,
            temperature_c=t,
            ecc_errors=errors,
            utilization_pct=utilization_pct,
            messages=(*(problems or passed), *missing),
        )


def _readable(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


FAST_LINKS = frozenset({LinkType.NVLINK, LinkType.XGMI, LinkType.XE_LINK})


class Link(_Frozen):
    """A direct connection between two devices of one adapter."""

    a: str
    b: str
    type: LinkType
    count: int | None = Field(default=None, ge=1)  # bonded links (NV18 means 18)
    bandwidth_gbps: float | None = Field(default=None, gt=0, allow_inf_nan=False)  # declared, per direction
    source: str  # where the fact came from: nvml, nvidia-smi, amdsmi, declared

    def connects(self, x: str, y: str) -> bool:
        return {self.a, self.b} == {x, y}


class Topology(_Frozen):
    devices: tuple[str, ...] = ()
    links: tuple[Link, ...] = ()

    @model_validator(mode="after")
    def _links_between_listed_devices(self) -> Topology:
        """A link to a device not listed cannot be placed (islands() raised a bare ValueError)."""
        listed = set(self.devices)
        for lk in self.links:
            stray = [end for end in (lk.a, lk.b) if end not in listed]
            if stray:
                raise ValueError(
                    f"link {lk.a}-{lk.b} names {', '.join(stray)}, which devices does not list "
                    f"({', '.join(self.devices) or 'none'})"
                )
        return self

    def link(self, x: str, y: str) -> Link | None:
        return next((lk for lk in self.links if lk.connects(x, y)), None)

    def peers(self, device: str) -> tuple[str, ...]:
        return tuple(lk.b if lk.a == device else lk.a for lk in self.links if device in (lk.a, lk.b))

    def islands(self, fast: frozenset[LinkType] = FAST_LINKS) -> list[tuple[str, ...]]:
        """Groups of devices joined by fast links, in device order (connected components)."""
        seen: set[str] = set()
        groups: list[tuple[str, ...]] = []
        for start in self.devices:
            if start in seen:
                continue
            group, stack = [], [start]
            while stack:
                dev = stack.pop()
                if dev in seen:
                    continue
                seen.add(dev)
                group.append(dev)
                stack.extend(
                    lk.b if lk.a == dev else lk.a
                    for lk in self.links
                    if lk.type in fast and dev in (lk.a, lk.b)
                )
            groups.append(tuple(sorted(group, key=self.devices.index)))
        return groups

    def merged(self, other: Topology) -> Topology:
        return Topology(devices=self.devices + other.devices, links=self.links + other.links)


class ProbeResult(_Frozen):
    """Whether an adapter's vendor runtime is present, and why not when it is absent."""

    available: bool
    reason: str
    runtime_version: str | None = None


class DeviceRequirements(_Frozen):
    """What a caller needs from a device; `failures()` says which needs a device misses.

    `collective_backend` is a torch.distributed backend name (`nccl`, `xccl`, `gloo`), which an
    AMD device meets with RCCL, or `rccl`, AMD's library, which only AMD devices meet."""

    device_type: str | None = None
    vendor: str | None = None
    adapter: str | None = None
    dtypes: frozenset[DType] = frozenset()
    features: frozenset[Feature] = frozenset()
    min_memory_bytes: int = Field(default=0, ge=0)
    min_compute_units: int = Field(default=0, ge=0)
    collective_backend: str | None = None
    allow_simulated: bool = True

    if not TYPE_CHECKING:  # type checkers keep the signature the fields give

        def __init__(self, **data: Any) -> None:
            """A refusal is a ConfigurationError, as every deliberate torchhal error: pydantic's
            ValidationError escaped (`dtypes={"bf17"}`), ending with a URL."""
            try:
                super().__init__(**data)
            except ValidationError as exc:
                raise ConfigurationError.from_validation(
                    "invalid DeviceRequirements", exc, lambda err: f"{err['loc'][0]}={err['input']!r}"
                ) from None

    def __str__(self) -> str:
        """The requirements in words, as NoDeviceMatchesError states them (the repr spelt out
        every default and enum member)."""
        parts = [
            f"{name} {value}"
            for name in ("device_type", "vendor", "adapter", "collective_backend")
            if (value := getattr(self, name)) is not None
        ]
        for name, members in (("dtypes", self.dtypes), ("features", self.features)):
            if members:
                parts.append(f"{name} {', '.join(sorted(m.value for m in members))}")
        if self.min_memory_bytes:
            parts.append(f"at least {self.min_memory_bytes} bytes of memory")
        if self.min_compute_units:
            parts.append(f"at least {self.min_compute_units} compute units")
        parts.append("simulated allowed" if self.allow_simulated else "no simulated device")
        return "; ".join(parts)

    @field_validator("dtypes", mode="before")
    @classmethod
    def _torch_dtypes(cls, value: object) -> object:
        """torch dtypes are what a PyTorch user writes first (`dtypes={torch.bfloat16}`); they
        were refused as not being DType values. A format torchhal does not track is named."""
        torch = sys.modules.get("torch")  # a torch.dtype exists only once torch is imported
        if torch is None or isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            return value
        out = []
        for item in value:
            if isinstance(item, torch.dtype):
                dtype = DType.from_torch(item)
                if dtype is None:
                    known = ", ".join(f"torch.{name}" for name in _TORCH_NAMES.values())
                    raise ValueError(f"torchhal does not track {item}; the torch dtypes it does: {known}")
                item = dtype
            out.append(item)
        return out

    @field_validator("collective_backend", mode="before")
    @classmethod
    def _backend_lower(cls, value: object) -> object:
        """torch.distributed takes backend names in any case (`Backend("NCCL")` is "nccl"), and
        devices declare torch's lower-case names, so "NCCL" was refused by every device."""
        return value.lower() if isinstance(value, str) else value

    @field_validator("min_memory_bytes", "min_compute_units", mode="before")
    @classmethod
    def _not_a_bool(cls, value: object) -> object:
        """True was 1 byte; 16e9 stays 16 GB (an integral float is a count)."""
        if isinstance(value, bool):
            raise ValueError(f"must be a count, not a bool; got {value}")
        return value

    def failures(self, caps: DeviceCapabilities) -> list[str]:
        out = []
        for attr in ("device_type", "vendor", "adapter"):
            want = getattr(self, attr)
            if want is not None and getattr(caps, attr) != want:
                out.append(f"{attr} is {getattr(caps, attr)!r}, need {want!r}")
        missing = sorted(d.value for d in self.dtypes - caps.dtypes)
        if missing:
            out.append(f"dtypes {missing} not supported")
        absent = sorted(f.value for f in self.features - caps.features)
        if absent:
            out.append(f"features {absent} missing")
        if caps.memory_bytes < self.min_memory_bytes:
            if caps.memory_bytes == 0:  # the adapter could not read it: not a measured 0
                out.append(
                    f"memory unknown (the adapter does not state it), {self.min_memory_bytes} required"
                )
            else:
                out.append(f"memory {caps.memory_bytes} bytes < {self.min_memory_bytes} required")
        if caps.compute_units < self.min_compute_units:
            out.append(f"compute units {caps.compute_units} < {self.min_compute_units} required")
        if self.collective_backend is not None:
            problem = _collective_failure(self.collective_backend, caps)
            if problem is not None:
                out.append(problem)
        if caps.simulated and not self.allow_simulated:
            out.append("simulated device, and allow_simulated is False")
        return out

    def collective_match(self, caps: DeviceCapabilities) -> str | None:
        """What meets the collective backend requirement on `caps` (None: none asked, or not
        met), for explanations: `rccl` is met by torch's `nccl` on AMD devices, which they say."""
        want = self.collective_backend
        if want is None or _collective_failure(want, caps) is not None:
            return None
        if want in caps.collective_backends:
            return f"collective {want!r}: declared"
        backend, vendor = _LIBRARY_BACKENDS[want]
        return f"collective {want!r}: {want.upper()}, torch's {backend!r} on this {vendor} device"


# Collective libraries that torch runs under another backend's name, as (the backend name, the
# vendor whose devices run the library under it): ROCm builds of torch call RCCL "nccl", which is
# what the AMD adapter declares, so a user asking for rccl meant AMD's devices and was refused by
# every one. A device may also declare a library's own name, which then matches as it is.
_LIBRARY_BACKENDS = {"rccl": ("nccl", "amd")}


def _collective_failure(want: str, caps: DeviceCapabilities) -> str | None:
    """Why `caps` does not offer the collective backend or library `want`, or None when it does."""
    declared = list(caps.collective_backends)
    if want in declared:
        return None
    if want not in _LIBRARY_BACKENDS:
        return f"collective backend {want!r} not in {declared}"
    backend, vendor = _LIBRARY_BACKENDS[want]
    if backend in declared and caps.vendor == vendor:
        return None
    return (
        f"collective backend {want!r} ({want.upper()}, torch's {backend!r} on {vendor} devices) not "
        f"available: this {caps.vendor!r} device declares {declared}"
    )
