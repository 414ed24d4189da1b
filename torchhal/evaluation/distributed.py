"""Sharded evaluation: split (variant, item) evaluations over ranks, gather one table on every rank.

Item i goes to rank i mod world_size, so the split is fixed by the item list alone. Each rank
evaluates its items for every variant, writing each finished value to the `SampleStore` as
soon as it exists, keyed by (variant, the item's index and hash: equal items stay separate
rows): a rerun after an interruption (a killed process, an exception) loads what is done and
evaluates only the rest. The values are then gathered through the HAL communicator, so every
rank holds the same table, ordered by item whatever the world size: with deterministic
`variants` functions the table equals the single-process one.

If one rank raises, it raises at once; the others stop at the gather when the communicator's
timeout expires. What any rank finished is on disk either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from torchhal.evaluation.fingerprint import digest
from torchhal.evaluation.inputs import input_hash
from torchhal.evaluation.store import SampleStore
from torchhal.hal_core import InvalidArgumentError, telemetry

if TYPE_CHECKING:
    from torchhal.hal_core.collectives import Communicator

log = telemetry.get_logger("torchhal.evaluation.distributed")

Evaluate = Callable[[Any], "float | Mapping[str, float]"]


@dataclass(frozen=True)
class ShardedResult:
    """values[i, v, m]: metric m of variant v on item i, for every item."""

    variants: tuple[str, ...]
    metrics: tuple[str, ...]
    values: np.ndarray
    rank: int
    world_size: int
    computed: int  # evaluations this rank ran in this call
    cached: int  # evaluations this rank loaded from the store

    def column(self, variant: str, metric: str | None = None) -> np.ndarray:
        """One variant's values of one metric over all items (the only metric when there is one)."""
        if variant not in self.variants:
            raise InvalidArgumentError(f"unknown variant {variant!r}; variants: {list(self.variants)}")
        if metric is None:
            if len(self.metrics) != 1:
                raise InvalidArgumentError(f"name the metric; this evaluation has {list(self.metrics)}")
            metric = self.metrics[0]
        if metric not in self.metrics:
            raise InvalidArgumentError(f"unknown metric {metric!r}; metrics: {list(self.metrics)}")
        return self.values[:, self.variants.index(variant), self.metrics.index(metric)]


def evaluate_sharded(
    variants: Mapping[str, Evaluate],
    items: Sequence[Any],
    metrics: Sequence[str],
    *,
    name: str,
    store: SampleStore | None = None,
    communicator: Communicator | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ShardedResult:
    """Evaluate every variant on every item, sharded over `communicator`'s ranks (or all here).

    `variants` maps names to functions of one item returning a number (one metric) or a mapping
    metric -> number. `name` keys the cache: change it when the functions change.
    """
    names, metric_names = tuple(variants), tuple(metrics)
    if not names or not metric_names or not len(items):
        raise InvalidArgumentError(
            f"evaluate_sharded needs variants, metrics and items; got {len(names)} variant(s), "
            f"{len(metric_names)} metric(s), {len(items)} item(s)"
        )
    rank, world = (communicator.rank, communicator.world_size) if communicator is not None else (0, 1)
    experiment = digest(
        {"kind": "sharded", "name": name, "variants": list(names), "metrics": list(metric_names)}
    )
    if store is not None:
        store.register(experiment, {"name": name, "variants": list(names), "metrics": list(metric_names)})
    mine = list(range(rank, len(items), world))
    local = np.full((len(mine), len(names), len(metric_names)), math.nan)
    computed = cached = 0
    with telemetry.span(
        "torchhal.evaluation.sharded", evaluation=name, rank=rank, world_size=world, items=len(mine)
    ):
        for j, i in enumerate(mine):
            key = f"{i}:{input_hash(items[i])}"  # equal items are still separate evaluations
            for v, variant in enumerate(names):
                row = store.get(experiment, variant, key) if store is not None else None
                if row is None:
                    row = _as_metrics(variants[variant](items[i]), metric_names, variant, i)
                    if store is not None:
                        store.put(experiment, variant, key, row)
                    computed += 1
                else:
                    cached += 1
                local[j, v] = [row[m] for m in metric_names]
                if progress is not None:
                    progress(j * len(names) + v + 1, len(mine) * len(names))
        values = local if communicator is None else _gather(communicator, local, len(items))
    log.info("sharded evaluation done", evaluation=name, rank=rank, computed=computed, cached=cached)
    return ShardedResult(names, metric_names, values, rank, world, computed, cached)


def _gather(comm: Communicator, local: np.ndarray, n_items: int) -> np.ndarray:
    """Every rank's rows, padded to one length for all_gather, back in item order."""
    world = comm.world_size
    per_rank = math.ceil(n_items / world)
    padded = np.full((per_rank, *local.shape[1:]), math.nan)
    padded[: local.shape[0]] = local
    tensor = torch.from_numpy(padded)
    target = comm.device.torch_device
    payload = tensor if tensor.device == target else comm.device.to_device(tensor)
    gathered = comm.all_gather(payload).to("cpu").numpy().reshape(world, per_rank, *local.shape[1:])
    values = np.empty((n_items, *local.shape[1:]))
    for r in range(world):
        count = len(range(r, n_items, world))
        values[r::world] = gathered[r, :count]
    return values


def _as_metrics(value: Any, metrics: tuple[str, ...], variant: str, item: int) -> dict[str, float]:
    if isinstance(value, Mapping):
        missing = sorted(set(metrics) - set(value))
        if missing:
            raise InvalidArgumentError(
                f"variant {variant!r} on item {item} returned no value for metric(s) {missing}; "
                f"got {sorted(value)}"
            )
        row = {m: _number(value[m], variant, item, f"metric {m!r}") for m in metrics}
    elif len(metrics) == 1:
        row = {metrics[0]: _number(value, variant, item, f"its one metric {metrics[0]!r}")}
    else:
        raise InvalidArgumentError(
            f"variant {variant!r} on item {item} must return a mapping of {list(metrics)} to numbers, "
            f"got {type(value).__name__}"
        )
    bad = {m: v for m, v in row.items() if not math.isfinite(v)}
    if bad:
        raise InvalidArgumentError(f"variant {variant!r} on item {item} returned non-finite values {bad}")
    return row


def _number(value: Any, variant: str, item: int, what: str) -> float:
    """A value as a float: a number or a one-element tensor; None (a metric left unmeasured),
    text or anything else is refused by name, never turned into NaN or a crash of float()."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (int, float, np.floating, np.integer)):
        raise InvalidArgumentError(
            f"variant {variant!r} on item {item} must return a number for {what}, got {value!r}"
        )
    return float(value)
