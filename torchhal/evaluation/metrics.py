"""The metrics an A/B experiment compares, which way is better, and the noise threshold of each.

A threshold is the smallest change that matters: a verdict of improved or regressed needs a
statistically significant change beyond it; equivalent means the change is shown to lie
within it. Relative thresholds are fractions of the baseline's median; absolute ones are in
the metric's unit (quality errors, whose baseline may be exactly 0, need an absolute one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torchhal.hal_core import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class Metric:
    name: str
    unit: str
    higher_is_better: bool
    source: str  # "timing" (from the harness) or "quality" (errors against a reference variant)
    positive: bool  # values are > 0, so a ratio of medians is defined
    doc: str


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric("latency", "ms", False, "timing", True, "time per call, from the device's timer"),
        Metric("throughput", "items/s", True, "timing", True, "items per call / time per call"),
        Metric(
            "memory",
            "bytes",
            False,
            "timing",
            False,
            "device bytes in use after a call, its result held, minus before (not the transient peak)",
        ),
        Metric(
            "quality", "error", False, "quality", False, "error of the output against the reference variant"
        ),
    )
}


def metric(name: str) -> Metric:
    try:
        return METRICS[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown metric {name!r}; known metrics: {sorted(METRICS)}") from None


@dataclass(frozen=True, slots=True)
class Threshold:
    """The noise threshold of one metric: `relative` (fraction of the baseline median) or `absolute`."""

    relative: float | None = None
    absolute: float | None = None

    def __post_init__(self) -> None:
        if (self.relative is None) == (self.absolute is None):
            raise InvalidArgumentError(
                f"a threshold is relative or absolute, exactly one; got relative={self.relative!r}, "
                f"absolute={self.absolute!r}"
            )
        value = self.relative if self.relative is not None else self.absolute
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
        ):
            raise InvalidArgumentError(f"a threshold must be a finite number >= 0, got {value!r}")

    @classmethod
    def parse(cls, value: Any, what: str) -> Threshold:
        """From a spec: a number (relative), or a table with `relative` or `absolute`."""
        if isinstance(value, Threshold):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return cls(relative=float(value))
        if isinstance(value, dict) and set(value) <= {"relative", "absolute"} and len(value) == 1:
            return cls(**value)  # its own checks: float() took true as 1.0 and crashed on "abc"
        raise InvalidArgumentError(
            f"threshold for {what}: give a number (relative to the baseline median) or "
            f"{{relative = x}} or {{absolute = x}}, got {value!r}"
        )

    def absolute_for(self, baseline_median: float, what: str) -> float:
        """This threshold in the metric's unit, for a baseline with this median."""
        if self.absolute is not None:
            return float(self.absolute)
        assert self.relative is not None
        if baseline_median == 0 and self.relative > 0:
            raise InvalidArgumentError(
                f"{what}: a relative threshold of {self.relative:g} is 0 for a baseline median of 0; "
                "give an absolute threshold for this metric"
            )
        return float(self.relative * abs(baseline_median))

    def describe(self) -> str:
        return (
            f"{self.relative:.3g} relative" if self.relative is not None else f"{self.absolute:.3g} absolute"
        )


DEFAULT_THRESHOLDS: dict[str, Threshold] = {
    "latency": Threshold(relative=0.05),
    "throughput": Threshold(relative=0.05),
    "memory": Threshold(relative=0.05),
}
"""Used when an experiment names none for a metric. 5 % is a policy, not a measurement: timing noise
on a shared host is often a few percent, so smaller changes are rarely worth acting on. Quality
has no default: its threshold depends on the dtype and the op, so the experiment must state it."""
