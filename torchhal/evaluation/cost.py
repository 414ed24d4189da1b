"""Cost-performance: what a million items cost on each variant, and which variants are worth it.

Prices come from the user (cost per hour of a device, in any currency), keyed by variant name
or device id; a variant's own entry wins over its device's. Cost per million items =
price per hour / 3600 × 10⁶ / throughput, throughput from the median latency. On a simulated
device the throughput is simulated, so its cost is a projection; rows say so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from torchhal.hal_core import InvalidArgumentError

SENSES = ("min", "max")


@dataclass(frozen=True, slots=True)
class CostRow:
    variant: str
    device: str
    price_per_hour: float
    price_key: str  # the price-table entry used: the variant's name or its device's id
    median_latency_ms: float
    throughput: float  # items per second at the median latency
    cost_per_million_items: float
    simulated: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_prices(prices: Mapping[str, float]) -> dict[str, float]:
    if not isinstance(prices, Mapping):  # `prices = "x"` in a spec was an AttributeError
        raise InvalidArgumentError(
            f"prices must be a table of device id or variant name to price per hour, got {prices!r}"
        )
    out = {}
    for key, value in prices.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
        ):
            raise InvalidArgumentError(
                f"price of {key!r} must be a finite number >= 0 per hour, got {value!r}"
            )
        out[str(key)] = float(value)
    return out


def price_key(variant: str, device: str, prices: Mapping[str, float]) -> str:
    """The price-table entry of a variant: its own name, else its device's id; none is an error."""
    key = variant if variant in prices else device
    if key not in prices:
        raise InvalidArgumentError(
            f"no price for variant {variant!r} (device {device!r}); the price table has {sorted(prices)}"
        )
    return key


def check_priced(variants: Sequence[tuple[str, str]], prices: Mapping[str, float]) -> None:
    """Every (variant name, device id) has a price: checked before measuring, since a cost row is
    made only after every sample, and a missing price then would throw the run away."""
    missing = [(name, device) for name, device in variants if name not in prices and device not in prices]
    if missing:
        listed = ", ".join(f"{name!r} (device {device!r})" for name, device in missing)
        raise InvalidArgumentError(
            f"no price for variant(s) {listed}: give each a price by variant name or device id; "
            f"the price table has {sorted(prices)}"
        )


def cost_row(
    variant: str,
    device: str,
    median_latency_ms: float,
    items_per_call: float,
    prices: Mapping[str, float],
    *,
    simulated: bool = False,
) -> CostRow:
    """The cost row of one variant; a variant with no price (by name or device) is an error."""
    key = price_key(variant, device, prices)
    if not (math.isfinite(median_latency_ms) and median_latency_ms > 0):
        raise InvalidArgumentError(
            f"variant {variant!r}: median latency must be > 0 ms, got {median_latency_ms}"
        )
    throughput = items_per_call * 1e3 / median_latency_ms
    price = float(prices[key])
    return CostRow(
        variant, device, price, key, median_latency_ms, throughput, price / 3600 * 1e6 / throughput, simulated
    )


def pareto_front(points: Mapping[str, Mapping[str, float]], objectives: Mapping[str, str]) -> list[str]:
    """Names of the points no other point dominates, in the order given.

    `objectives` maps each coordinate to "min" or "max". A point dominates another when it is
    at least as good in every objective and strictly better in one; equal points both stay.
    """
    if not objectives:
        raise InvalidArgumentError("pareto_front needs at least one objective")
    bad = {k: v for k, v in objectives.items() if v not in SENSES}
    if bad:
        raise InvalidArgumentError(f"objective senses must be 'min' or 'max', got {bad}")
    signs = {k: (1.0 if v == "min" else -1.0) for k, v in objectives.items()}
    scaled: dict[str, list[float]] = {}
    for name, point in points.items():
        missing = sorted(set(objectives) - set(point))
        if missing:
            raise InvalidArgumentError(f"point {name!r} has no value for objective(s) {missing}")
        values = [float(point[k]) * s for k, s in signs.items()]
        if not all(math.isfinite(v) for v in values):
            raise InvalidArgumentError(f"point {name!r} has a non-finite objective value: {dict(point)}")
        scaled[name] = values
    return [name for name, p in scaled.items() if not any(_dominates(q, p) for q in scaled.values())]


def _dominates(q: Sequence[float], p: Sequence[float]) -> bool:
    return all(a <= b for a, b in zip(q, p, strict=True)) and any(a < b for a, b in zip(q, p, strict=True))
