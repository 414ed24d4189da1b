"""Input validation shared by every statistic: one place that turns bad input into clear errors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from torchhal.hal_core.errors import InvalidArgumentError

ALTERNATIVES = ("two-sided", "less", "greater")
ROUNDING_RTOL = 1e-9
"""Differences within this fraction of a sample's magnitude are floating-point rounding (simulated
time is a difference of clock readings): never an outlier, never variance."""
NUMERIC_KINDS = "biuf"  # bool, signed and unsigned int, float: numeric strings and complex are refused


def numbers(values: Any, what: str) -> np.ndarray:
    """`values` as a float64 array, refusing what is not real numbers: strings ("1e3" converted
    silently) and complex values (whose imaginary part float64 drops with only a warning).
    `what` names the values in the error ("sample 'a'")."""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{what} must be numbers, got {values!r:.80}: {exc}") from exc
    if arr.dtype.kind not in NUMERIC_KINDS:
        raise InvalidArgumentError(
            f"{what} must be numbers, got {values!r:.80}: dtype {arr.dtype} is not bool, int or float"
        )
    return arr.astype(np.float64, copy=False)


def constant(x: np.ndarray) -> bool:
    """All values equal up to floating-point rounding (`ROUNDING_RTOL`): no variance to test on."""
    return float(np.ptp(x)) <= ROUNDING_RTOL * float(np.abs(x).max())


def sample(values: Any, name: str, *, min_size: int) -> np.ndarray:
    """`values` as a 1-D float64 array, refusing too few values, non-numbers and any NaN or infinity."""
    arr = numbers(values, f"sample {name!r}")
    if arr.ndim != 1:
        raise InvalidArgumentError(f"sample {name!r} must be 1-D, got shape {arr.shape}")
    if arr.size < min_size:
        raise InvalidArgumentError(f"sample {name!r} needs at least {min_size} values, got {arr.size}")
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise InvalidArgumentError(
            f"sample {name!r} must be finite; index {bad[0]} is {arr[bad[0]]} "
            f"({bad.size} non-finite value(s) in all)"
        )
    return arr


def positive_sample(values: Any, name: str, *, min_size: int) -> np.ndarray:
    """A finite sample whose values are all > 0 (times, throughputs)."""
    arr = sample(values, name, min_size=min_size)
    bad = np.flatnonzero(arr <= 0)
    if bad.size:
        raise InvalidArgumentError(f"sample {name!r} must be > 0 everywhere; index {bad[0]} is {arr[bad[0]]}")
    return arr


def same_length(a: np.ndarray, b: np.ndarray, what: str) -> None:
    """Paired samples must pair up one to one."""
    if a.size != b.size:
        raise InvalidArgumentError(f"{what} needs samples of equal length, got {a.size} and {b.size}")


def alternative(value: str) -> str:
    if value not in ALTERNATIVES:
        raise InvalidArgumentError(f"alternative must be one of {ALTERNATIVES}, got {value!r}")
    return value


def probability(value: float, name: str) -> float:
    """A level strictly inside (0, 1): alpha, confidence, power, a quantile."""
    v = float(value)
    if not 0.0 < v < 1.0:
        raise InvalidArgumentError(f"{name} must lie strictly between 0 and 1, got {value!r}")
    return v


def positive_int(value: int, name: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def finite_number(value: float, name: str) -> float:
    v = float(value)
    if not np.isfinite(v):
        raise InvalidArgumentError(f"{name} must be finite, got {value!r}")
    return v


def nonnegative_sd(value: float, name: str) -> float:
    v = finite_number(value, name)
    if v < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {value!r}")
    return v


def pvalues(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """A non-empty 1-D array of p-values in [0, 1]."""
    arr = sample(values, "pvalues", min_size=1)
    bad = np.flatnonzero((arr < 0) | (arr > 1))
    if bad.size:
        raise InvalidArgumentError(f"p-values must lie in [0, 1]; index {bad[0]} is {arr[bad[0]]}")
    return arr
