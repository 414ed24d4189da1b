"""The simulated ASIC's spec: a validated description of one systolic-array accelerator.

Specs are TOML files (read with `tomllib`, or its backport `tomli` on Python 3.10)
or JSON files. Three ship with the plugin; `TORCHHAL_SIMASIC_SPEC` picks one by
name or points at a file, and `TORCHHAL_SIMASIC_DEVICES` overrides the device count (1 to
MAX_DEVICES). Every malformed value raises `ConfigurationError` naming the field, the
constraint and the value.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Annotated, Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from torchhal.hal_core import ConfigurationError, DType

SPEC_ENV = "TORCHHAL_SIMASIC_SPEC"
DEVICES_ENV = "TORCHHAL_SIMASIC_DEVICES"
BUNDLED = ("edge", "datacenter", "h100-like")
DEFAULT_SPEC = "edge"
BUNDLED_DIR = Path(__file__).with_name("specs")
# The topology links every pair of devices, n(n - 1)/2 links: 64 is 8 times a large host's
# accelerator count and keeps discovery near 20 ms (2,016 links); 400 devices took a second.
MAX_DEVICES = 64
# The array's columns are the device's SIMD width (DeviceCapabilities.simd_width), which the
# conformance kit bounds at 4096 lanes (torchhal.testing.checks_adapter.MAX_SIMD_WIDTH): a wider
# array was a valid spec whose device failed adapter.discover. Real arrays have a few hundred.
MAX_COLS = 4096
# The least clock, memory bandwidth or host link a spec may give: the smallest normal float. Its
# reciprocal is finite (about 4.5e307), and it stays above 0 in GB/s and, for a clock, in TFLOP/s.
MIN_RATE = sys.float_info.min

# Strict, so a bool or a string ("800e6") is refused rather than read as a number; a float
# field takes an integer (`clock_hz = 800000000`), which TOML and JSON write without a point.
PositiveInt = Annotated[int, Field(ge=1, strict=True)]
NonNegativeInt = Annotated[int, Field(ge=0, strict=True)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False, strict=True)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False, strict=True)]


class SimASICSpec(BaseModel):
    """One accelerator: an R × C output-stationary systolic array, its SRAM and its memory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Annotated[str, Field(min_length=1)]
    rows: PositiveInt  # R: processing elements per column of the array
    cols: PositiveInt  # C: processing elements per row of the array, at most MAX_COLS
    clock_hz: PositiveFloat
    macs_per_cell_per_cycle: dict[DType, PositiveInt]  # one per dtype in `dtypes`
    sram_bytes: NonNegativeInt  # on-chip buffer that holds operand panels for reuse
    memory_bytes: PositiveInt  # device memory capacity
    memory_bandwidth_bytes_per_s: PositiveFloat
    dtypes: Annotated[frozenset[DType], Field(min_length=1)]
    launch_overhead_s: NonNegativeFloat
    devices: Annotated[int, Field(ge=1, le=MAX_DEVICES, strict=True)] = 1
    host_link_bytes_per_s: PositiveFloat | None = None  # declared link between devices, via the host

    @field_validator("dtypes", mode="before")
    @classmethod
    def _each_dtype_once(cls, value: Any) -> Any:
        """A dtype listed twice is a slip (another was meant): the set kept one without a word."""
        if isinstance(value, (list, tuple)):
            repeated = sorted({str(getattr(d, "value", d)) for d in value if value.count(d) > 1})
            if repeated:
                raise ValueError(f"each dtype must be listed once, {repeated} are listed more than once")
        return value

    @field_validator("cols")
    @classmethod
    def _cols_fit_a_simd_width(cls, value: int) -> int:
        if value > MAX_COLS:
            raise ValueError(
                f"must be at most {MAX_COLS} (the array's columns are the device's SIMD width, "
                "which the conformance kit bounds there)"
            )
        return value

    @field_validator("clock_hz", "memory_bandwidth_bytes_per_s", "host_link_bytes_per_s")
    @classmethod
    def _rate_is_a_normal_float(cls, value: float | None) -> float | None:
        """A rate the cost model divides by: a subnormal one (1e-310) validated, then its
        reciprocal overflowed to inf (every op's time) or its GB/s rounded to 0 (discovery's
        declared peaks refused it), in errors that named no spec field."""
        if value is not None and value < MIN_RATE:
            raise ValueError(
                f"must be at least {MIN_RATE!r}, the smallest normal float: below it 1 / rate, "
                "which the cost model divides by, overflows to inf, and the declared GB/s or "
                "TFLOP/s round to 0"
            )
        return value

    @model_validator(mode="after")
    def _matmul_dtypes_are_supported(self) -> SimASICSpec:
        for field, listed in (
            ("dtypes", self.dtypes),
            ("macs_per_cell_per_cycle", self.macs_per_cell_per_cycle),
        ):
            if DType.TF32 in listed:  # its rate went into the declared peaks and was never charged
                raise ValueError(
                    f"{field}: tf32 is not modelled (fp32 tensors are charged at the fp32 MAC rate "
                    "whatever torch's float32 matmul precision), got tf32"
                )
        if self.sram_bytes > self.memory_bytes:  # the buffer caches panels of what memory holds
            raise ValueError(
                f"sram_bytes: on-chip SRAM must not exceed memory_bytes ({self.memory_bytes}), "
                f"got {self.sram_bytes}"
            )
        if not self.macs_per_cell_per_cycle:
            raise ValueError("macs_per_cell_per_cycle: needs at least one dtype, got an empty table")
        extra = sorted(d.value for d in self.macs_per_cell_per_cycle.keys() - self.dtypes)
        if extra:
            raise ValueError(
                f"macs_per_cell_per_cycle: every dtype must also be listed in dtypes "
                f"{sorted(d.value for d in self.dtypes)}, got {extra} that are not"
            )
        # A dtype without a rate had no array: its matmuls, attention and cross-entropy ran on the
        # host, uncharged, with a warning; DESIGN.md says an unsupported dtype is refused.
        rateless = sorted(d.value for d in self.dtypes - self.macs_per_cell_per_cycle.keys())
        if rateless:
            raise ValueError(
                f"dtypes: every dtype needs a MAC rate in macs_per_cell_per_cycle "
                f"{sorted(d.value for d in self.macs_per_cell_per_cycle)} (the array computes the "
                f"device's matmuls), got {rateless} without one"
            )
        for dtype in self.macs_per_cell_per_cycle:  # each factor finite, their product may not be
            if not math.isfinite(self.peak_flops_per_s(dtype)):
                raise ValueError(
                    f"clock_hz: rows x cols x MACs x clock must give a finite {dtype.value} peak, got "
                    f"{self.rows} x {self.cols} x {self.macs_per_cell_per_cycle[dtype]} x {self.clock_hz:g}"
                )
        return self

    def peak_flops_per_s(self, dtype: DType) -> float:
        """The array's peak: 2 FLOPs per MAC × R × C cells × MACs per cell per cycle × clock."""
        return 2.0 * self.rows * self.cols * self.macs_per_cell_per_cycle[dtype] * self.clock_hz

    def fingerprint(self) -> str:
        """A stable hash of the spec, so caches keyed by device change when the spec does."""
        data = self.model_dump(mode="json")
        data["dtypes"] = sorted(data["dtypes"])
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def parse_spec(data: Mapping[str, Any], source: str) -> SimASICSpec:
    """Validate a spec's raw data; errors name the field, the constraint and the value."""
    try:
        return SimASICSpec.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(_describe(err) for err in exc.errors())
        raise ConfigurationError(f"simulated ASIC spec {source}: {problems}") from None


def _describe(err: Any) -> str:
    field = ".".join(str(part) for part in err["loc"])
    if err["type"] == "missing":
        return f"field {field!r}: required, but missing"
    message = str(err["msg"]).removeprefix("Value error, ")
    if not field:  # a model-level check, whose message names its field itself
        return message
    return f"field {field!r}: {message}, got {err['input']!r}"


def load_spec(path: str | os.PathLike[str]) -> SimASICSpec:
    """Read a spec from a `.toml` or `.json` file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigurationError(f"simulated ASIC spec {path}: cannot read it: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # a ValueError: it escaped as a bare traceback
        raise ConfigurationError(
            f"simulated ASIC spec {path}: must be UTF-8 text, got byte {exc.object[exc.start]:#04x} "
            f"at offset {exc.start}"
        ) from None
    return parse_spec(_decode(text, path.suffix, str(path)), str(path))


def _decode(text: str, suffix: str, source: str) -> Any:
    try:
        if suffix == ".toml":
            return tomllib.loads(text)
        if suffix == ".json":
            data = json.loads(text, object_pairs_hook=partial(_unique_keys, source))
            if not isinstance(data, dict):
                raise ConfigurationError(
                    f"simulated ASIC spec {source}: must be a JSON object, got {type(data).__name__}"
                )
            return data
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigurationError(
            f"simulated ASIC spec {source}: not valid {suffix[1:].upper()}: {exc}"
        ) from None
    raise ConfigurationError(
        f"simulated ASIC spec {source}: file name must end in .toml or .json, got {suffix!r}"
    )


def _unique_keys(source: str, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are unique: json.loads keeps the last of a repeated key without
    a word (`"rows": 4, ..., "rows": 8` was an 8-row array); TOML refuses one itself."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ConfigurationError(f"simulated ASIC spec {source}: key {key!r} appears more than once")
        data[key] = value
    return data


def bundled_spec(name: str) -> SimASICSpec:
    """One of the specs shipped with the plugin, by name (see BUNDLED)."""
    if name not in BUNDLED:
        raise ConfigurationError(f"simulated ASIC spec name must be one of {BUNDLED}, got {name!r}")
    # beside this module: the wheel installs as files, and importlib.resources would add 2 ms to
    # discovery (its readers' import) on a 2-core machine
    text = (BUNDLED_DIR / f"{name}.toml").read_text(encoding="utf-8")
    return parse_spec(_decode(text, ".toml", f"bundled {name!r}"), f"bundled {name!r}")


def spec_from_env(environ: Mapping[str, str] | None = None) -> SimASICSpec:
    """The spec named by TORCHHAL_SIMASIC_SPEC (default: the edge spec), with the device override."""
    env = os.environ if environ is None else environ
    chosen = env.get(SPEC_ENV, "").strip() or DEFAULT_SPEC
    if chosen in BUNDLED:
        spec = bundled_spec(chosen)
    elif Path(chosen).is_file():
        spec = load_spec(chosen)
    else:
        raise ConfigurationError(
            f"{SPEC_ENV} must name a bundled spec {BUNDLED} or an existing .toml/.json file, got {chosen!r}"
        )
    devices = env.get(DEVICES_ENV, "").strip()
    if not devices:
        return spec
    return spec.model_copy(update={"devices": _device_count(devices)})


def _device_count(text: str) -> int:
    """TORCHHAL_SIMASIC_DEVICES as ASCII digits only: str.isdigit() also admits '²', which int()
    refuses, and '٣', which int() reads as 3. Leading zeros go first, so that the length check
    keeps int() off strings past its 4300-digit limit."""
    digits = text.lstrip("0") if text.isascii() and text.isdigit() else ""
    if not digits or len(digits) > len(str(MAX_DEVICES)) or int(digits) > MAX_DEVICES:
        raise ConfigurationError(f"{DEVICES_ENV} must be an integer from 1 to {MAX_DEVICES}, got {text!r}")
    return int(digits)
