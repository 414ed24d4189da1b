"""Settings from TORCHHAL_* environment variables, validated by a pydantic model.

A plain model read from `os.environ` rather than pydantic-settings: that package adds about
200 ms to the first HAL on a 2-core machine, against a 50 ms discovery budget
(docs/decisions.md). Each field `x` is read from `TORCHHAL_X`; errors name the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from torchhal.hal_core.errors import ConfigurationError

PREFIX = "TORCHHAL_"


_BOOL_WORDS = " (on: 1, true, yes, on; off: 0, false, no, off)"  # what pydantic reads as a bool


def _default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchhal"


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    plugins: tuple[str, ...] | None = None  # allowlist of plugin names; None allows all
    disable_plugin_autoload: bool = False
    strict_plugins: bool = False
    disable_kernels: tuple[str, ...] = ()  # candidate names (or provider/name) never selected
    autotune: Literal["off", "on", "auto"] = (
        "auto"  # measure valid candidates; auto: real event-timed devices
    )
    otel_exporter: Literal["none", "console", "otlp", "memory"] | None = None
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "warning"
    log_format: Literal["console", "json"] = "console"
    cache_dir: Path = Field(default_factory=_default_cache_dir)

    @field_validator("plugins", "disable_kernels", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("plugins")
    @classmethod
    def _names_some(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        """An allowlist of no names (',') would load no plugin, which has a switch of its own."""
        if value == ():
            raise ValueError("names no plugin; to load none, set TORCHHAL_DISABLE_PLUGIN_AUTOLOAD=1")
        return value

    @field_validator("cache_dir", mode="before")
    @classmethod
    def _home(cls, value: object) -> object:
        """'~/cache' as a shell would read it, not a directory named '~' in the working directory."""
        return Path(value).expanduser() if isinstance(value, (str, Path)) else value

    @field_validator("log_level", "log_format", "otel_exporter", "autotune", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        values = {
            name: env[PREFIX + name.upper()].strip()  # " 1 " as "1", as the allowlist strips its names
            for name in cls.model_fields
            if env.get(PREFIX + name.upper(), "").strip() != ""  # blank is unset, as "" is
        }
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            problems = "; ".join(
                f"{PREFIX}{str(err['loc'][0]).upper()}={values.get(str(err['loc'][0]))!r}: {err['msg']}"
                + (_BOOL_WORDS if err["type"] == "bool_parsing" else "")
                for err in exc.errors()
            )
            raise ConfigurationError(f"invalid torchhal setting: {problems}") from None
