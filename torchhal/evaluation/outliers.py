"""Tukey's fences: flag samples far outside the interquartile range. Flagged, never dropped.

A timing outlier is usually real (a context switch, a clock change, a page fault), so the
statistics keep it; the flag tells a reader how many there were and where.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from torchhal.evaluation.stats._checks import ROUNDING_RTOL, numbers
from torchhal.hal_core import InvalidArgumentError

MILD, EXTREME = 1.5, 3.0  # Tukey (1977): outside 1.5 IQR is an outlier, outside 3 IQR "far out"


@dataclass(frozen=True, slots=True)
class Fences:
    """Q1/Q3 (numpy's linear quantiles), the fences at `k` IQR, and the indices outside them."""

    q1: float
    q3: float
    k: float
    low: float
    high: float
    flagged: tuple[int, ...]  # outside [low, high]
    far_out: tuple[int, ...]  # outside the fences at 3 IQR

    def as_dict(self) -> dict[str, Any]:
        return {
            "q1": self.q1,
            "q3": self.q3,
            "k": self.k,
            "low": self.low,
            "high": self.high,
            "flagged": list(self.flagged),
            "far_out": list(self.far_out),
        }


def tukey_fences(values: Any, k: float = MILD) -> Fences:
    """Fences at Q1 − k·IQR and Q3 + k·IQR, and which values fall outside them by more than rounding."""
    x = numbers(values, "Tukey fences' values")
    if x.ndim != 1 or x.size < 4:
        raise InvalidArgumentError(
            f"Tukey fences need a 1-D sample of at least 4 values, got shape {x.shape}"
        )
    if not np.isfinite(x).all():
        first = int(np.flatnonzero(~np.isfinite(x))[0])
        raise InvalidArgumentError(f"Tukey fences need finite values; index {first} is {x[first]}")
    if not k > 0:
        raise InvalidArgumentError(f"Tukey fence multiplier k must be > 0, got {k}")
    q1, q3 = (float(v) for v in np.quantile(x, [0.25, 0.75]))
    iqr = q3 - q1
    rounding = ROUNDING_RTOL * float(np.abs(x).max())
    low, high = q1 - k * iqr - rounding, q3 + k * iqr + rounding
    far_k = max(k, EXTREME)
    far = (x < q1 - far_k * iqr - rounding) | (x > q3 + far_k * iqr + rounding)
    return Fences(
        q1,
        q3,
        k,
        low,
        high,
        tuple(int(i) for i in np.flatnonzero((x < low) | (x > high))),
        tuple(int(i) for i in np.flatnonzero(far)),
    )
