"""A/B experiments: measure variants, compare each with the baseline on every metric, price them.

Variants are anything `Variant` can hold: devices, kernel candidates, dtypes, model variants,
any callable (see `variants.py` for builders). Metrics: latency, throughput, memory (from the
harness) and quality (errors against a reference variant). Every (variant, metric) pair is
one comparison against the baseline (see `compare.py`); their p-values are corrected as one
family. With a price table, each variant gets a cost per million items and the Pareto front
of cost, latency (and quality error) names the variants worth considering; every variant must
have a price (by name or device), checked before anything is measured.

A relative threshold is a fraction of the baseline's median: where that median is 0 (memory of a
baseline that leaves nothing allocated, quality of a baseline that matches the reference) it
defines no threshold, so that comparison comes back inconclusive, saying why (its shift and
interval still reported, its threshold NaN, outside the corrected family); the others are kept.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from torchhal.evaluation.compare import (
    CORRECTIONS,
    MIN_SAMPLES,
    Comparison,
    Verdict,
    compare,
    correct,
    min_sample_size,
)
from torchhal.evaluation.cost import CostRow, check_priced, check_prices, cost_row, pareto_front
from torchhal.evaluation.fingerprint import environment_fingerprint
from torchhal.evaluation.harness import ORDERS, Measurement, Variant, measure
from torchhal.evaluation.metrics import DEFAULT_THRESHOLDS, METRICS, Threshold, metric
from torchhal.evaluation.quality import ERRORS, measure_quality
from torchhal.evaluation.stats.bootstrap import MAX_RESAMPLES
from torchhal.evaluation.store import SampleStore
from torchhal.hal_core import InvalidArgumentError, telemetry

log = telemetry.get_logger("torchhal.evaluation.experiment")

PhaseProgress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class ExperimentConfig:
    """How to run and judge an experiment. `thresholds` maps metric names to their noise
    thresholds (default: `metrics.DEFAULT_THRESHOLDS`; quality must be given). `reference`
    names the variant whose outputs are the ground truth for quality."""

    baseline: str
    metrics: tuple[str, ...] = ("latency",)
    thresholds: Mapping[str, Threshold] = field(default_factory=dict)
    alpha: float = 0.05
    correction: str = "holm"
    warmup: int = 5
    repetitions: int = 30
    inner: int = 1
    order: str = "interleaved"
    seed: int = 0
    flush_every: int = 8
    reference: str | None = None
    quality_error: str = "rel_l2"
    prices: Mapping[str, float] | None = None
    n_resamples: int = 10_000
    name: str = "experiment"

    def __post_init__(self) -> None:
        for role in ("name", "baseline"):  # reports and the CLI print them as text
            value = getattr(self, role)
            if not isinstance(value, str) or not value.strip():
                raise InvalidArgumentError(f"{role} must be a non-empty string, got {value!r}")
        if self.reference is not None and not isinstance(self.reference, str):
            raise InvalidArgumentError(f"reference must be a variant name (a string), got {self.reference!r}")
        if isinstance(self.metrics, str):  # tuple("latency") would be seven one-letter metrics
            raise InvalidArgumentError(
                f"metrics must be a list of metric names, got the string {self.metrics!r}"
            )
        object.__setattr__(self, "metrics", tuple(self.metrics))
        if not self.metrics:
            raise InvalidArgumentError("an experiment needs at least one metric, got none")
        for name in self.metrics:
            metric(name)
        if len(set(self.metrics)) != len(self.metrics):
            raise InvalidArgumentError(f"metrics must be distinct, got {list(self.metrics)}")
        unknown = sorted(set(self.thresholds) - set(METRICS), key=repr)  # YAML keys may be numbers
        if unknown:
            raise InvalidArgumentError(
                f"thresholds for unknown metric(s) {unknown}; known: {sorted(METRICS)}"
            )
        object.__setattr__(
            self, "thresholds", {k: Threshold.parse(v, f"metric {k!r}") for k, v in self.thresholds.items()}
        )
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, (int, float))
            or not 0 < self.alpha < 0.5
        ):
            raise InvalidArgumentError(f"alpha must lie strictly between 0 and 0.5, got {self.alpha!r}")
        if self.correction not in CORRECTIONS:
            raise InvalidArgumentError(f"correction must be one of {CORRECTIONS}, got {self.correction!r}")
        if self.order not in ORDERS:
            raise InvalidArgumentError(f"order must be one of {ORDERS}, got {self.order!r}")
        if "quality" in self.metrics:
            if self.reference is None:
                raise InvalidArgumentError(
                    "metric 'quality' needs `reference`: the variant whose outputs are ground truth"
                )
            if "quality" not in self.thresholds:
                raise InvalidArgumentError(
                    "metric 'quality' needs a threshold (e.g. {absolute = 1e-3}): what error change matters "
                    "depends on the op and dtype, so there is no default"
                )
            relative = self.thresholds["quality"].relative
            if relative and self.reference == self.baseline:  # its errors against itself are all 0
                raise InvalidArgumentError(
                    f"thresholds['quality'] must be absolute when the reference is the baseline "
                    f"({self.baseline!r}): a relative threshold of {relative:g} scales the baseline's "
                    "error, which is 0 against itself"
                )
        # checked here, not when measuring: a spec's bad count or seed must stop before anything runs
        for name, minimum in (
            ("warmup", 0),
            ("repetitions", 1),
            ("inner", 1),
            ("flush_every", 1),
            ("seed", 0),
            ("n_resamples", 100),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
        needed = min_sample_size(self.alpha)  # compare() would refuse fewer after measuring
        if self.repetitions < needed and any(METRICS[m].source == "timing" for m in self.metrics):
            raise InvalidArgumentError(
                f"repetitions must be >= {needed} at alpha = {self.alpha:g}: compare() needs "
                f"{MIN_SAMPLES} samples per arm, more where its {1 - self.alpha:.4g} Hodges–Lehmann "
                f"interval needs them; got {self.repetitions}"
            )
        if self.n_resamples > MAX_RESAMPLES:  # the comparison would refuse it after measuring
            raise InvalidArgumentError(
                f"n_resamples must be at most {MAX_RESAMPLES:,}, got {self.n_resamples:,}"
            )
        if self.quality_error not in ERRORS:
            raise InvalidArgumentError(f"quality_error must be one of {ERRORS}, got {self.quality_error!r}")
        if self.prices is not None:
            object.__setattr__(self, "prices", check_prices(self.prices))
            if not {"latency", "throughput"} & set(self.metrics):
                raise InvalidArgumentError("prices need a timing metric ('latency' or 'throughput') to cost")

    def threshold(self, name: str) -> Threshold:
        return self.thresholds.get(name) or DEFAULT_THRESHOLDS[name]

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "baseline": self.baseline,
            "metrics": list(self.metrics),
            "thresholds": {m: self.threshold(m).describe() for m in self.metrics},
            "alpha": self.alpha,
            "correction": self.correction,
            "warmup": self.warmup,
            "repetitions": self.repetitions,
            "inner": self.inner,
            "order": self.order,
            "seed": self.seed,
            "flush_every": self.flush_every,
            "reference": self.reference,
            "quality_error": self.quality_error,
            "prices": dict(self.prices) if self.prices is not None else None,
            "n_resamples": self.n_resamples,
        }


@dataclass(frozen=True)
class ExperimentResult:
    config: ExperimentConfig
    variants: dict[str, dict[str, Any]]  # name -> description, device, simulated, items_per_call
    measurement: Measurement | None
    quality: dict[str, np.ndarray] | None
    comparisons: list[Comparison]
    cost: list[CostRow]
    pareto: list[str]
    fingerprint: dict[str, Any]

    def samples(self, variant: str, name: str) -> np.ndarray:
        """The raw sample of one metric of one variant."""
        if variant not in self.variants:
            raise InvalidArgumentError(f"unknown variant {variant!r}; variants: {sorted(self.variants)}")
        m = metric(name)
        if name not in self.config.metrics:
            raise InvalidArgumentError(
                f"metric {name!r} was not measured; measured: {list(self.config.metrics)}"
            )
        if m.source == "quality":
            assert self.quality is not None
            return self.quality[variant]
        assert self.measurement is not None
        return self.measurement.samples(variant, name)

    def comparison(self, variant: str, name: str) -> Comparison:
        for c in self.comparisons:
            if c.variant == variant and c.metric == name:
                return c
        raise InvalidArgumentError(
            f"no comparison of {variant!r} on {name!r}; compared: "
            f"{sorted({(c.variant, c.metric) for c in self.comparisons})}"
        )

    def regressions(self, metrics: Sequence[str] | None = None) -> list[Comparison]:
        """Comparisons whose verdict is a significant regression beyond the threshold."""
        wanted = set(metrics) if metrics is not None else None
        return [
            c
            for c in self.comparisons
            if c.verdict is Verdict.REGRESSED and (wanted is None or c.metric in wanted)
        ]


def run_experiment(
    variants: Sequence[Variant],
    config: ExperimentConfig,
    *,
    store: SampleStore | None = None,
    progress: PhaseProgress | None = None,
) -> ExperimentResult:
    """Measure, compare against the baseline, correct, and price. See the module docstring."""
    names = [v.name for v in variants]
    if len(variants) < 2:
        raise InvalidArgumentError(f"an A/B experiment needs at least 2 variants, got {names}")
    for role, name in (("baseline", config.baseline), ("reference", config.reference)):
        if name is not None and name not in names:
            raise InvalidArgumentError(f"{role} {name!r} is not a variant; variants: {names}")
    if "quality" in config.metrics:  # one quality value per input set: too few must stop before measuring
        sets = len(next(v for v in variants if v.name == config.reference).inputs)
        needed = min_sample_size(config.alpha)
        if sets < needed:
            raise InvalidArgumentError(
                f"metric 'quality' needs >= {needed} input sets at alpha = {config.alpha:g} (one error "
                f"per set: compare() needs {MIN_SAMPLES} per arm, more where its Hodges–Lehmann "
                f"interval needs them); reference {config.reference!r} has {sets}"
            )
    if config.prices is not None:  # a cost row is made after all measuring: a missing price stops here
        check_priced([(v.name, v.device.id) for v in variants], config.prices)
    timing = [m for m in config.metrics if METRICS[m].source == "timing"]
    measurement = quality = None
    with telemetry.span(
        "torchhal.evaluation.experiment", experiment=config.name, variants=names, metrics=list(config.metrics)
    ):
        if timing:
            measurement = measure(
                variants,
                warmup=config.warmup,
                repetitions=config.repetitions,
                inner=config.inner,
                order=config.order,
                seed=config.seed,
                track_memory="memory" in timing,
                flush_every=config.flush_every,
                store=store,
                progress=None if progress is None else (lambda d, t: progress("timing", d, t)),
            )
        if "quality" in config.metrics:
            assert config.reference is not None
            quality = measure_quality(
                variants,
                config.reference,
                kind=config.quality_error,
                store=store,
                progress=None if progress is None else (lambda d, t: progress("quality", d, t)),
            )
        comparisons = _compare_all(variants, config, measurement, quality)
    cost, front = _cost(variants, config, measurement, quality)
    fingerprint = (
        measurement.fingerprint if measurement else environment_fingerprint(v.device for v in variants)
    )
    info = {
        v.name: {
            "description": v.description,
            "device": v.device.id,
            "simulated": v.device.simulated,
            "items_per_call": v.items_per_call,
        }
        for v in variants
    }
    for c in comparisons:
        log.info("comparison", variant=c.variant, metric=c.metric, verdict=c.verdict.value, reason=c.reason)
    return ExperimentResult(config, info, measurement, quality, comparisons, cost, front, fingerprint)


def _compare_all(
    variants: Sequence[Variant],
    config: ExperimentConfig,
    measurement: Measurement | None,
    quality: dict[str, np.ndarray] | None,
) -> list[Comparison]:
    by_name = {v.name: v for v in variants}
    base = by_name[config.baseline]
    raw: list[Comparison] = []
    undefined: set[int] = set()  # positions in `raw` whose relative threshold is 0 × a median of 0
    for v in variants:
        if v.name == config.baseline:
            continue
        for name in config.metrics:
            m = METRICS[name]
            if m.source == "quality":
                assert quality is not None
                a, b = quality[v.name], quality[base.name]
                deterministic = True
            else:
                assert measurement is not None
                a, b = measurement.samples(v.name, name), measurement.samples(base.name, name)
                # simulated time and memory accounting repeat exactly; real timings never do
                deterministic = name == "memory" or (v.device.simulated and base.device.simulated)
            threshold = config.threshold(name)
            no_threshold = bool(threshold.relative) and float(np.median(b)) == 0.0
            c = compare(
                a,
                b,
                metric=m,
                # the effect is still estimated (against 0); the verdict is left inconclusive below
                threshold=Threshold(absolute=0.0) if no_threshold else threshold,
                variant=v.name,
                baseline_name=base.name,
                alpha=config.alpha,
                deterministic=deterministic,
                seed=config.seed + len(raw),
                n_resamples=config.n_resamples,
            )
            if no_threshold:
                undefined.add(len(raw))
                c = _without_threshold(c, threshold)
            raw.append(c)
    tested = correct([c for i, c in enumerate(raw) if i not in undefined], config.alpha, config.correction)
    judged = iter(tested)
    return [c if i in undefined else next(judged) for i, c in enumerate(raw)]


def _without_threshold(c: Comparison, threshold: Threshold) -> Comparison:
    """An inconclusive comparison whose relative threshold is undefined (the baseline's median is
    0): no change can be judged beyond or within it. Its shift, interval and two-sided p against 0
    stay (informative); it is not a test of the threshold, so it stays out of the corrected family."""
    assert threshold.relative is not None
    effect = (
        f"exact values: shift {c.shift:+.4g} {c.unit}"
        if c.test == "exact"
        else f"shift {c.shift:+.4g} {c.unit}, p = {c.p_value:.3g} against 0, uncorrected"
    )
    reason = (
        f"no threshold: a relative threshold of {threshold.relative:g} is 0 for a baseline median of 0 "
        f"{c.unit}, so no change can be judged beyond or within it ({effect}); give an absolute "
        f"threshold for {c.metric!r}, e.g. {{absolute = x}}"
    )
    log.warning(
        "comparison left inconclusive: relative threshold of a zero baseline median",
        variant=c.variant,
        metric=c.metric,
        threshold=threshold.describe(),
    )
    return dataclasses.replace(
        c,
        threshold=math.nan,
        threshold_spec=threshold.describe(),
        p_beyond=math.nan,
        p_corrected=math.nan,
        correction="none",
        equivalence_p=None,
        power=None,
        verdict=Verdict.INCONCLUSIVE,
        reason=reason,
    )


def _cost(
    variants: Sequence[Variant],
    config: ExperimentConfig,
    measurement: Measurement | None,
    quality: dict[str, np.ndarray] | None,
) -> tuple[list[CostRow], list[str]]:
    if config.prices is None:
        return [], []
    assert measurement is not None
    rows = []
    for v in variants:
        result = measurement.variants[v.name]
        rows.append(
            cost_row(
                v.name,
                v.device.id,
                float(np.median(result.latency_ms)),
                v.items_per_call,
                config.prices,
                simulated=v.device.simulated,
            )
        )
    points = {
        r.variant: {
            "cost_per_million_items": r.cost_per_million_items,
            "median_latency_ms": r.median_latency_ms,
        }
        for r in rows
    }
    objectives = {"cost_per_million_items": "min", "median_latency_ms": "min"}
    if quality is not None:
        for name, point in points.items():
            point["median_error"] = float(np.median(quality[name]))
        objectives["median_error"] = "min"
    return rows, pareto_front(points, objectives)
