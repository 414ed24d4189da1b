"""Settings from TORCHHAL_* environment variables, validated by a pydantic model.

A plain model read from `os.environ` rather than pydantic-settings: that package adds about
200 ms to the first HAL on a 2-core machine, against a 50 ms discovery budget
(docs/decisions.md). Each field `x` is read from `TORCHHAL_X`; errors name the variable.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from torchhal.hal_core import telemetry
from torchhal.hal_core.errors import ConfigurationError
from torchhal.hal_core.kernels import reference_refusal

PREFIX = "TORCHHAL_"
# read by name elsewhere, not settings of a HAL (torchhal.hal_core.dispatch_memo: per process)
OTHER_CORE_VARIABLES = ("TORCHHAL_PURE_PYTHON_GUARDS",)

log = telemetry.get_logger("torchhal.settings")
_warned_typos: set[str] = set()
_warned_no_home = False
_temp_dir: Path | None = None  # the cache directory without a home, once chosen


def _default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/torchhal, or ~/.cache/torchhal where it is unset or relative (the XDG
    specification: a relative path there is invalid and ignored). Without a home (HOME unset and
    a user id the password database lacks, as containers run), a directory of this user's in the
    temporary directory, as torch's inductor cache does: it raised, failing every HAL and log line."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "torchhal"
    try:
        return Path.home() / ".cache" / "torchhal"
    except (RuntimeError, KeyError) as exc:  # RuntimeError: pathlib; KeyError: pwd on some Pythons
        fallback = _own_temp_dir()
        _say_no_home(fallback, exc)
        return fallback


def _own_temp_dir() -> Path:
    """`<tempdir>/torchhal-<uid>`, made private (0700) where it is not there yet. The temporary
    directory is everyone's: one there already that another user owns, or that others may write,
    could feed this process kernel winners, so a fresh private directory is used instead (the
    cache then lasts for this process only), logged and counted. Chosen once per process, and
    kept before the log line, which reads the settings and so comes back here."""
    global _temp_dir
    if _temp_dir is not None:
        return _temp_dir
    uid = getattr(os, "getuid", lambda: None)()
    shared = Path(tempfile.gettempdir()) / f"torchhal-{'user' if uid is None else uid}"
    try:
        shared.mkdir(mode=0o700, exist_ok=True)
        st = shared.stat()
    except OSError:
        st = None
    if st is not None and (uid is None or (st.st_uid == uid and not st.st_mode & 0o022)):
        _temp_dir = shared
        return shared
    _temp_dir = Path(tempfile.mkdtemp(prefix="torchhal-"))
    telemetry.count("torchhal.cache.untrusted_temp_dir")
    log.warning(
        "temporary cache directory not this user's alone; using a private one for this process",
        refused=str(shared),
        using=str(_temp_dir),
    )
    return _temp_dir


def _say_no_home(fallback: Path, exc: BaseException) -> None:
    """Logged once and counted. The flag is set first: the log line reads the settings from the
    environment on first use, which comes back here."""
    global _warned_no_home
    if _warned_no_home:
        return
    _warned_no_home = True
    telemetry.count("torchhal.cache.no_home")
    log.warning(
        "no home directory to keep torchhal's cache in; set TORCHHAL_CACHE_DIR or HOME",
        using=str(fallback),
        error=f"{type(exc).__name__}: {exc}",
    )


class Settings(BaseModel):
    # forbid: a misspelt keyword (Settings(strict_plugin=True)) was dropped without a word
    model_config = ConfigDict(frozen=True, extra="forbid")

    plugins: tuple[str, ...] | None = None  # allowlist of plugin names; None allows all
    disable_plugin_autoload: bool = False
    strict_plugins: bool = False
    disable_kernels: tuple[str, ...] = ()  # candidate names (or provider/name) never selected
    autotune: Literal["off", "on", "auto"] = (
        "auto"  # measure valid candidates; auto: real event-timed devices
    )
    # how measured selection times a candidate: "eager", calls back to back (what an eager caller
    # pays: host launch cost included); "graph", replays of its calls captured as a device graph
    # (what a caller replaying CUDA/HIP graphs pays: device time alone)
    selection_timing: Literal["eager", "graph"] = "eager"
    otel_exporter: Literal["none", "console", "otlp", "memory"] | None = None
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "warning"
    log_format: Literal["console", "json"] = "console"
    # validate_default: a relative HOME is made absolute now too, as a relative TORCHHAL_CACHE_DIR
    cache_dir: Path = Field(default_factory=_default_cache_dir, validate_default=True)

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

    @field_validator("disable_kernels")
    @classmethod
    def _keeps_the_reference(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        """The reference cannot be disabled (`kernels.reference_refusal`)."""
        refused = reference_refusal(value)
        if refused:
            raise ValueError(refused)
        return value

    @field_validator("cache_dir", mode="before")
    @classmethod
    def _home(cls, value: object) -> object:
        """'~/cache' as a shell would read it, not a directory named '~' in the working directory;
        a relative path taken from the working directory now, not at each use (a process that
        changes directory kept writing its cache somewhere new)."""
        if not isinstance(value, (str, Path)):
            return value
        try:
            return Path(value).expanduser().absolute()
        except RuntimeError as exc:  # '~user' unknown, or '~' without HOME or a user entry
            raise ValueError(f"'~' cannot be expanded ({exc}); give an absolute path") from None

    @field_validator(
        "log_level", "log_format", "otel_exporter", "autotune", "selection_timing", mode="before"
    )
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        _warn_misspelt(env)
        values = {
            name: env[PREFIX + name.upper()].strip()  # " 1 " as "1", as the allowlist strips its names
            for name in cls.model_fields
            if env.get(PREFIX + name.upper(), "").strip() != ""  # blank is unset, as "" is
        }
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise ConfigurationError.from_validation(
                "invalid torchhal setting",
                exc,
                lambda err: f"{PREFIX}{str(err['loc'][0]).upper()}={values.get(str(err['loc'][0]))!r}",
            ) from None


def env_bool(name: str) -> bool:
    """A boolean TORCHHAL_ variable read outside Settings (a per-process switch), read as the
    settings' booleans are: blank is unset (False), and a value pydantic does not read as a bool
    is refused naming the variable ("false" turned TORCHHAL_PURE_PYTHON_GUARDS on)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return False
    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError as exc:
        raise ConfigurationError.from_validation(
            "invalid torchhal setting", exc, lambda err: f"{name}={value!r}"
        ) from None


def _warn_misspelt(env: Mapping[str, str]) -> None:
    """A TORCHHAL_ variable one typo away from a setting (TORCHHAL_AUTOTUNES) is logged once: it
    would be ignored without a word. Others are left alone: plugins read variables of their own."""
    known = [PREFIX + name.upper() for name in Settings.model_fields] + list(OTHER_CORE_VARIABLES)
    for name in env:
        if not name.startswith(PREFIX) or name in known or name in _warned_typos:
            continue
        import difflib  # only where an unknown TORCHHAL_ variable is set: discovery's budget

        close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
        if close:
            _warned_typos.add(name)
            log.warning("not a torchhal setting; ignored", variable=name, did_you_mean=close[0])
