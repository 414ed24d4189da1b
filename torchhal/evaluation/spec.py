"""Experiment spec files for `torchhal ab`: TOML (tomllib; tomli on 3.10), or YAML when PyYAML is installed.

    [experiment]            name, baseline, metrics, alpha, correction, warmup, repetitions,
                            inner, order, seed, flush_every, reference, quality_error, n_resamples
    [thresholds]            metric = 0.05 (relative) | {relative = x} | {absolute = x}
    [prices]                device id or variant name = cost per hour
    [workload]              op, device, dtype, args, kwargs, input_sets, items_per_call, seed
    [[variants]]            name, and one of: kernel = "provider/name" (a candidate of the
                            workload's op) | callable = "module:function"; optionally device,
                            dtype, env = {VAR = "value"} (a HAL discovered under that environment)

`args` lists the positional arguments: a list of ints is a random-normal tensor of that shape;
a table {shape = [...], dtype = "...", distribution = "normal"|"uniform"} a tensor made so
("uniform" is U[0.5, 1.5), never zero); {value = x} a plain number. Inputs are drawn on the
host from a generator seeded by (workload seed, set index), then copied explicitly to each
variant's device. Dtypes: an argument that declares its own `dtype` keeps it in every
variant; the variant's `dtype` (else [workload] dtype, else float32) applies to the floating
arguments that declare none. Where a variant's or the workload's `dtype` is given and a floating
argument declares another, the spec is refused, naming the argument and both dtypes (a variant
cannot both be "in bfloat16" and take that argument in float64). `callable` imports and runs code
named by the spec, as pytest runs a test file: use spec files you trust.
"""

from __future__ import annotations

import importlib
import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchhal.evaluation.experiment import ExperimentConfig
from torchhal.evaluation.harness import Variant
from torchhal.evaluation.inputs import Inputs
from torchhal.evaluation.variants import hal_for_environment, kernel_variants
from torchhal.hal_core import ConfigurationError, Device, TorchHALError
from torchhal.hal_core.hal import HardwareAbstractionLayer

SECTIONS = {"experiment", "thresholds", "prices", "workload", "variants"}
EXPERIMENT_KEYS = {
    "name",
    "baseline",
    "metrics",
    "alpha",
    "correction",
    "warmup",
    "repetitions",
    "inner",
    "order",
    "seed",
    "flush_every",
    "reference",
    "quality_error",
    "n_resamples",
}
WORKLOAD_KEYS = {"op", "device", "dtype", "args", "kwargs", "input_sets", "items_per_call", "seed"}
VARIANT_KEYS = {"name", "kernel", "callable", "device", "dtype", "env"}


@dataclass(frozen=True)
class LoadedSpec:
    path: Path
    config: ExperimentConfig
    variants: list[Variant]


def read_spec(path: str | Path) -> dict[str, Any]:
    """The spec file's content as a dict (TOML, or YAML with PyYAML installed)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigurationError(f"spec {path}: is a directory, not a spec file")
    if not path.is_file():
        raise ConfigurationError(f"spec {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigurationError(f"spec {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as exc:
            raise ConfigurationError(
                f"spec {path}: YAML specs need PyYAML (pip install pyyaml); TOML needs nothing extra"
            ) from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigurationError(f"spec {path}: invalid YAML: {_yaml_problem(exc)}") from exc
    elif path.suffix == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # Python 3.10: the backport, a dependency there
            import tomli as tomllib
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigurationError(f"spec {path}: invalid TOML: {exc}") from exc
    else:
        raise ConfigurationError(f"spec {path}: expected a .toml, .yaml or .yml file, got {path.suffix!r}")
    if not isinstance(data, dict):
        raise ConfigurationError(f"spec {path}: expected a table at the top level, got {type(data).__name__}")
    return data


def load_spec(path: str | Path, hal: HardwareAbstractionLayer | None = None) -> LoadedSpec:
    """Read a spec and build its configuration and variants (inputs made, devices resolved)."""
    path = Path(path)
    data = read_spec(path)
    where = f"spec {path}"
    _keys(data, SECTIONS, where)
    experiment = _table(data, "experiment", where, required=True)
    _keys(experiment, EXPERIMENT_KEYS, f"{where}: [experiment]")
    workload = _table(data, "workload", where)
    _keys(workload, WORKLOAD_KEYS, f"{where}: [workload]")
    raw_variants = data.get("variants")
    if not isinstance(raw_variants, list) or len(raw_variants) < 2:
        raise ConfigurationError(f"{where}: [[variants]] needs at least 2 entries, got {raw_variants!r}")
    try:
        config = ExperimentConfig(
            **experiment,
            thresholds=_table(data, "thresholds", where),
            prices=data.get("prices"),
        )
    except TorchHALError as exc:
        raise ConfigurationError(f"{where}: [experiment]: {exc}") from exc
    except TypeError as exc:
        raise ConfigurationError(f"{where}: [experiment]: {exc}") from exc
    hal = hal or HardwareAbstractionLayer()
    builder = _Builder(hal, workload, where)
    variants = [builder.variant(v, f"{where}: variants[{i}]") for i, v in enumerate(raw_variants)]
    _check_names([v.name for v in variants], config, where)
    return LoadedSpec(path, config, variants)


def _check_names(names: list[str], config: ExperimentConfig, where: str) -> None:
    """run_experiment checks these too, but only after the CLI has made --out and the store."""
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigurationError(
                f"{where}: variants[{i}]: name must be unique, "
                f"got {name!r}, already the name of variants[{names.index(name)}]"
            )
    for role in ("baseline", "reference"):
        value = getattr(config, role)
        if value is not None and value not in names:
            raise ConfigurationError(
                f"{where}: [experiment]: {role} must be one of the variant names {names}, got {value!r}"
            )


def _yaml_problem(exc: Exception) -> str:
    """PyYAML's message spans lines and quotes the source; keep what went wrong and where, as TOML's."""
    what = ": ".join(filter(None, (getattr(exc, "context", None), getattr(exc, "problem", None))))
    mark = getattr(exc, "problem_mark", None)
    at = f" (at line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return (what or " ".join(str(exc).split())) + at


class _Builder:
    def __init__(self, hal: HardwareAbstractionLayer, workload: dict[str, Any], where: str) -> None:
        self.hal, self.workload, self.where = hal, workload, where
        self.op = workload.get("op")
        self.items = workload.get("items_per_call", 1)
        self.sets = workload.get("input_sets", 4)
        if isinstance(self.sets, bool) or not isinstance(self.sets, int) or self.sets < 1:
            raise ConfigurationError(
                f"{where}: [workload] input_sets must be an integer >= 1, got {self.sets!r}"
            )
        self.host_inputs = self._host_inputs()
        self.declared = self._declared_dtypes()  # kept in every variant

    def variant(self, raw: Any, where: str) -> Variant:
        if not isinstance(raw, dict):
            raise ConfigurationError(f"{where}: expected a table, got {raw!r}")
        _keys(raw, VARIANT_KEYS, where)
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"{where}: 'name' must be a non-empty string, got {name!r}")
        if ("kernel" in raw) == ("callable" in raw):
            raise ConfigurationError(f"{where} ({name}): give exactly one of 'kernel' or 'callable'")
        env = raw.get("env")
        hal = self.hal if env is None else hal_for_environment(_str_map(env, f"{where}: env"))
        device = self._device(hal, raw.get("device", self.workload.get("device")), where)
        dtype = self._variant_dtype(raw, name, where)
        inputs = self._inputs_for(device, dtype)
        try:
            if "kernel" in raw:
                if not isinstance(self.op, str):
                    raise ConfigurationError(
                        f"{where} ({name}): 'kernel' needs [workload] op, got {self.op!r}"
                    )
                (base,) = kernel_variants(
                    hal, self.op, device, inputs, candidates=[raw["kernel"]], items_per_call=self.items
                )
                fn, description = base.fn, base.description
            else:
                fn = _import(raw["callable"], where)
                description = f"callable {raw['callable']}"
            if env is not None:
                description += f" with {env}"
            kept = ", ".join(
                f"args[{k}] {d}"
                for k, d in sorted(self.declared.items())
                if d.is_floating_point and d != dtype
            )
            description += f" on {device.id} in {dtype}" + (f" ({kept} as declared)" if kept else "")
            return Variant(name, fn, device, inputs, hal, self.items, description)
        except ConfigurationError:
            raise
        except TorchHALError as exc:
            raise ConfigurationError(f"{where} ({name}): {exc}") from exc

    def _variant_dtype(self, raw: dict[str, Any], name: str, where: str) -> torch.dtype:
        """The dtype of the floating arguments that declare none; where the variant or the workload
        names it, a floating argument declaring another dtype is refused, not silently replaced."""
        if "dtype" in raw:
            source = f"{where} dtype"
            dtype = _dtype(raw["dtype"], where)
        elif "dtype" in self.workload:
            source = f"{self.where}: [workload] dtype"
            dtype = _dtype(self.workload["dtype"], f"{self.where}: [workload]")
        else:
            return torch.float32  # the default never overrides an argument's own dtype
        for k, declared in sorted(self.declared.items()):
            if declared.is_floating_point and declared != dtype:
                raise ConfigurationError(
                    f"{where} ({name}): [workload] args[{k}] declares dtype {declared} "
                    f"({self.where}: [workload] args[{k}].dtype), but the variant's dtype is {dtype} "
                    f"({source}); make them agree, or drop one of them"
                )
        return dtype

    def _inputs_for(self, device: Device, dtype: torch.dtype) -> Inputs:
        """The host sets on `device`: floating tensors of arguments without a declared dtype in
        `dtype`, every other argument as made."""

        def place(k: int, value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if value.is_floating_point() and k not in self.declared:
                value = value.to(dtype)
            return device.to_device(value)

        host = self.host_inputs
        return Inputs([tuple(place(k, a) for k, a in enumerate(s)) for s in host.sets], host.kwargs)

    def _device(self, hal: HardwareAbstractionLayer, device_id: Any, where: str) -> Device:
        try:
            return hal.best_device() if device_id is None else hal.device(str(device_id))
        except TorchHALError as exc:
            raise ConfigurationError(f"{where}: device: {exc}") from exc

    def _host_inputs(self) -> Inputs:
        args = self.workload.get("args", [])
        kwargs = self.workload.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise ConfigurationError(
                f"{self.where}: [workload] args must be a list and kwargs a table, "
                f"got {args!r} and {kwargs!r}"
            )
        seed = self.workload.get("seed", 0)
        where = f"{self.where}: [workload] args"

        def make(i: int) -> tuple[Any, ...]:
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{i}".encode()))
            return tuple(_argument(a, gen, f"{where}[{k}]") for k, a in enumerate(args))

        return Inputs([make(i) for i in range(self.sets)], kwargs)  # kwargs may be named `count`

    def _declared_dtypes(self) -> dict[int, torch.dtype]:
        """The positions of the arguments that declare their own dtype (checked by `_host_inputs`)."""
        args = self.workload.get("args", [])
        return {
            k: _dtype(a["dtype"], f"{self.where}: [workload] args[{k}]")
            for k, a in enumerate(args)
            if isinstance(a, dict) and "dtype" in a and "value" not in a
        }


def _argument(spec: Any, gen: torch.Generator, where: str) -> Any:
    if isinstance(spec, list):
        spec = {"shape": spec}
    if not isinstance(spec, dict):
        raise ConfigurationError(f"{where}: expected a shape list or a table, got {spec!r}")
    if "value" in spec:
        _keys(spec, {"value"}, where)
        return spec["value"]
    _keys(spec, {"shape", "dtype", "distribution"}, where)
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise ConfigurationError(f"{where}: shape must be a list of integers >= 0, got {shape!r}")
    dtype = _dtype(spec.get("dtype", "float32"), where)
    distribution = spec.get("distribution", "normal")
    if distribution == "normal":
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if distribution == "uniform":
        return (torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    raise ConfigurationError(f"{where}: distribution must be 'normal' or 'uniform', got {distribution!r}")


def _dtype(name: Any, where: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ConfigurationError(
            f"{where}: dtype must name a torch dtype (float32, bfloat16, ...), got {name!r}"
        )
    return dtype


def _import(target: Any, where: str) -> Callable[..., Any]:
    if not isinstance(target, str) or target.count(":") != 1:
        raise ConfigurationError(f"{where}: callable must be 'module:function', got {target!r}")
    module_name, attr = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"{where}: cannot import module {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigurationError(f"{where}: {module_name!r} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]


def _table(data: Mapping[str, Any], key: str, where: str, *, required: bool = False) -> dict[str, Any]:
    value = data.get(key)
    if value is None:
        if required:
            raise ConfigurationError(f"{where}: missing [{key}] table")
        return {}
    if not isinstance(value, dict):
        raise ConfigurationError(f"{where}: [{key}] must be a table, got {value!r}")
    return value


def _keys(table: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed, key=repr)  # YAML keys may be numbers too
    if unknown:
        raise ConfigurationError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def _str_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ConfigurationError(f"{where}: must be a table of strings, got {value!r}")
    return value
