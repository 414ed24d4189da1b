"""One comparison: is variant A better than baseline B on one metric, beyond the noise threshold?

Per comparison (all statistics from `torchhal.evaluation.stats`):
* the verdict's test: is the shift beyond the threshold? Mann–Whitney U (robust to the skew
  and outliers of timings) of A ∓ threshold against B, one-sided in the direction of the
  observed shift and doubled for choosing that direction: a test of H0 "|shift| <= threshold"
  under the shift model. Its p-values are corrected across the experiment's family of
  comparisons (Holm by default). A change merely different from 0 is reported too
  (`p_value`, two-sided Mann–Whitney), but never makes a verdict on its own;
* effect: the Hodges–Lehmann shift A − B with its distribution-free interval, the relative
  change shift / |median B|, and for positive metrics the ratio of medians A/B with a BCa
  bootstrap interval (`ratio_method` "bca"; "exact" for constant samples). BCa is defined for
  every such pair of samples (`bootstrap_ratio_of_medians` says why), so no fallback is needed;
* equivalence: TOST (two one-sided Welch tests) against ± the threshold;
* achieved power: the probability that this design (sample sizes, observed spreads, alpha)
  shows a true change of twice the threshold to lie beyond the threshold (Welch's noncentral
  t, one-sided at alpha/2 as the verdict's test, whose one-sided p is doubled: the distance
  from the null boundary is one threshold); and the minimum
  detectable effect against 0 at this n, so "inconclusive" says what it would take.

Verdict: improved / regressed when the corrected threshold test rejects; equivalent when
TOST shows the change within ± the threshold; otherwise inconclusive. With an A/A pair
(true shift 0) a false verdict needs the shift to look significantly *beyond* the threshold,
far rarer than alpha. Samples that are constant in both arms (up to rounding, `ROUNDING_RTOL`)
are compared exactly, by their medians, where the values are deterministic (simulated time,
memory accounting, quality errors); for real timings a constant sample means the timer could
not resolve the call, and is refused.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchhal.evaluation.metrics import Metric, Threshold
from torchhal.evaluation.stats import (
    _checks,
    benjamini_hochberg,
    bootstrap_ratio_of_medians,
    hodges_lehmann_shift,
    holm,
    mann_whitney_u,
    minimum_detectable_effect,
    power_welch,
    tost,
)
from torchhal.evaluation.stats.intervals import critical_count
from torchhal.hal_core import InvalidArgumentError, telemetry

log = telemetry.get_logger("torchhal.evaluation.compare")

MIN_SAMPLES = 4
"""Per arm: the fewest for which a 95 % Hodges–Lehmann interval exists (C(8, 4) = 70 >= 40)."""

CORRECTIONS = ("holm", "bh", "none")


class Verdict(str, enum.Enum):
    IMPROVED = "improved"
    REGRESSED = "regressed"
    EQUIVALENT = "equivalent"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class Comparison:
    """Variant vs baseline on one metric. Shifts and intervals are variant − baseline, in `unit`."""

    metric: str
    unit: str
    higher_is_better: bool
    variant: str
    baseline: str
    n_variant: int
    n_baseline: int
    median_variant: float
    median_baseline: float
    shift: float
    shift_interval: tuple[float, float]
    relative_change: float | None  # shift / |median_baseline|; None when that median is 0
    ratio: float | None  # median_variant / median_baseline, positive metrics only
    ratio_interval: tuple[float, float] | None
    ratio_method: str | None  # "bca", or "exact" for constant samples
    threshold: float  # absolute, in `unit`
    threshold_spec: str
    confidence: float
    test: str  # "mann-whitney" or "exact"
    p_value: float  # two-sided, shift != 0 (uncorrected; informative)
    p_beyond: float  # shift beyond the threshold (the verdict's test, uncorrected)
    p_corrected: float  # p_beyond corrected over the family
    correction: str
    equivalence_p: float | None  # TOST; None when the threshold is 0
    power: float | None  # of showing a true change of 2 × threshold to be beyond the threshold
    mde: float | None  # minimum detectable |shift| against 0 at this n, in `unit`
    verdict: Verdict = Verdict.INCONCLUSIVE
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["verdict"] = self.verdict.value
        return out


def compare(
    candidate: Any,
    baseline: Any,
    *,
    metric: Metric,
    threshold: Threshold,
    variant: str = "variant",
    baseline_name: str = "baseline",
    alpha: float = 0.05,
    deterministic: bool = False,
    seed: int = 0,
    n_resamples: int = 10_000,
) -> Comparison:
    """Compare one metric of `candidate` against `baseline`; the verdict uses the uncorrected
    threshold test until `correct()` applies the family's correction."""
    if not 0 < alpha < 0.5:
        raise InvalidArgumentError(f"alpha must lie strictly between 0 and 0.5, got {alpha!r}")
    a = _sample(candidate, metric, variant)
    b = _sample(baseline, metric, baseline_name)
    med_a, med_b = float(np.median(a)), float(np.median(b))
    what = f"{metric.name} of {variant!r} vs {baseline_name!r}"
    thr = threshold.absolute_for(med_b, what)
    common: dict[str, Any] = {
        "metric": metric.name,
        "unit": metric.unit,
        "higher_is_better": metric.higher_is_better,
        "variant": variant,
        "baseline": baseline_name,
        "n_variant": a.size,
        "n_baseline": b.size,
        "median_variant": med_a,
        "median_baseline": med_b,
        "threshold": thr,
        "threshold_spec": threshold.describe(),
        "confidence": 1.0 - alpha,
    }
    if _checks.constant(a) and _checks.constant(b):
        if not deterministic:
            raise InvalidArgumentError(
                f"{what}: both samples have zero variance ({a[0]!r} × {a.size}, {b[0]!r} × {b.size}); "
                "real timings never repeat exactly, so the timer did not resolve the call: raise `inner`"
            )
        return _exact(a, b, common)
    mw = mann_whitney_u(a, b, "two-sided")
    hl = hodges_lehmann_shift(a, b, confidence=1.0 - alpha)
    ratio = ratio_interval = ratio_method = None
    if metric.positive:
        boot = bootstrap_ratio_of_medians(a, b, confidence=1.0 - alpha, n_resamples=n_resamples, seed=seed)
        ratio, ratio_interval, ratio_method = boot.ratio, boot.bca, "bca"
    p_beyond = _beyond_threshold(a, b, hl.shift, thr)
    sd_a, sd_b = float(a.std(ddof=1)), float(b.std(ddof=1))
    equivalence_p = power = None
    if thr > 0:
        equivalence_p = tost(a, b, -thr, thr, alpha=alpha).p_value
        # at alpha/2: the verdict doubles its one-sided p (`_beyond_threshold`); at alpha the
        # power read 0.48 where the verdict's test rejected 0.32 of such changes
        power = power_welch(thr, sd_a, sd_b, a.size, b.size, alpha / 2, alternative="greater").power
    mde = minimum_detectable_effect(a, b, min(a.size, b.size), alpha).effect
    comparison = Comparison(
        **common,
        shift=hl.shift,
        shift_interval=hl.interval,
        relative_change=hl.shift / abs(med_b) if med_b != 0 else None,
        ratio=ratio,
        ratio_interval=ratio_interval,
        ratio_method=ratio_method,
        test="mann-whitney",
        p_value=mw.p_value,
        p_beyond=p_beyond,
        p_corrected=p_beyond,
        correction="none",
        equivalence_p=equivalence_p,
        power=power,
        mde=abs(mde),
    )
    return decide(comparison, alpha)


def min_sample_size(alpha: float) -> int:
    """The fewest values per arm `compare` takes at `alpha`: `MIN_SAMPLES`, or more where its
    1 − alpha Hodges–Lehmann interval needs them (tie-free n <= 8 need C(2n, n) >= 2/alpha)."""
    confidence = _checks.probability(1.0 - alpha, "confidence 1 − alpha")  # alpha < 1e-16 rounds it to 1
    n = MIN_SAMPLES
    while critical_count(n, n, confidence)[0] < 1:
        n += 1
    return n


def correct(comparisons: Sequence[Comparison], alpha: float = 0.05, method: str = "holm") -> list[Comparison]:
    """Correct the p-values of the statistical comparisons for multiplicity and re-decide them.

    Exact comparisons are not tests and stay out of the family.
    """
    if method not in CORRECTIONS:
        raise InvalidArgumentError(f"correction must be one of {CORRECTIONS}, got {method!r}")
    tested = [i for i, c in enumerate(comparisons) if c.test != "exact"]
    out = list(comparisons)
    if not tested or method == "none":
        return out
    pvalues = [comparisons[i].p_beyond for i in tested]
    adjusted = (holm if method == "holm" else benjamini_hochberg)(pvalues, alpha).adjusted
    for i, p in zip(tested, adjusted, strict=True):
        updated = dataclasses.replace(comparisons[i], p_corrected=p, correction=method)
        out[i] = decide(updated, alpha)
    return out


def decide(c: Comparison, alpha: float) -> Comparison:
    """The verdict of a comparison from its corrected p-value, shift, threshold and TOST."""
    direction = Verdict.IMPROVED if (c.shift > 0) == c.higher_is_better else Verdict.REGRESSED
    shift = f"shift {c.shift:+.4g} {c.unit}"
    if c.test == "exact":
        if abs(c.shift) > c.threshold:
            return dataclasses.replace(
                c, verdict=direction, reason=f"exact values: {shift} beyond the threshold {c.threshold:.4g}"
            )
        return dataclasses.replace(
            c,
            verdict=Verdict.EQUIVALENT,
            reason=f"exact values: {shift} within the threshold {c.threshold:.4g}",
        )
    p_text = f"p = {c.p_corrected:.3g} ({c.correction})"
    if c.p_corrected < alpha:
        verdict = direction
        reason = f"{shift} significantly beyond the threshold {c.threshold:.4g}, {p_text}"
    elif c.equivalence_p is not None and c.equivalence_p < alpha:
        verdict = Verdict.EQUIVALENT
        reason = f"TOST p = {c.equivalence_p:.3g}: the change lies within ± {c.threshold:.4g} {c.unit}"
    else:
        verdict = Verdict.INCONCLUSIVE
        differs = "differs from 0" if c.p_value < alpha else "is not shown to differ from 0"
        mde = f"; detectable against 0 at this n: |shift| >= {c.mde:.4g}" if c.mde is not None else ""
        reason = (
            f"{shift} {differs} (p = {c.p_value:.3g}) but is not shown beyond the threshold "
            f"{c.threshold:.4g} ({p_text}) nor within it{mde}"
        )
    return dataclasses.replace(c, verdict=verdict, reason=reason)


def _beyond_threshold(a: np.ndarray, b: np.ndarray, shift: float, thr: float) -> float:
    """p of H0 |shift| <= thr: Mann–Whitney of the candidate moved back by the threshold, one-sided
    in the direction of the observed shift, doubled for having chosen that direction."""
    if shift == 0:
        return 1.0
    if shift > 0:
        one_sided = mann_whitney_u(a - thr, b, "greater").p_value
    else:
        one_sided = mann_whitney_u(a + thr, b, "less").p_value
    return min(1.0, 2.0 * one_sided)


def _exact(a: np.ndarray, b: np.ndarray, common: dict[str, Any]) -> Comparison:
    med_a, med_b = common["median_variant"], common["median_baseline"]
    shift = med_a - med_b
    ratio = med_a / med_b if med_a > 0 and med_b > 0 else None
    exact = Comparison(
        **common,
        shift=shift,
        shift_interval=(shift, shift),
        relative_change=shift / abs(med_b) if med_b != 0 else None,
        ratio=ratio,
        ratio_interval=(ratio, ratio) if ratio is not None else None,
        ratio_method="exact" if ratio is not None else None,
        test="exact",
        p_value=0.0 if shift != 0 else 1.0,
        p_beyond=0.0 if abs(shift) > common["threshold"] else 1.0,
        p_corrected=0.0 if abs(shift) > common["threshold"] else 1.0,
        correction="none",
        equivalence_p=None,
        power=None,
        mde=None,
    )
    log.info("exact comparison of constant samples", metric=exact.metric, variant=exact.variant, shift=shift)
    return decide(exact, 1.0 - exact.confidence)


def _sample(values: Any, metric: Metric, name: str) -> np.ndarray:
    x = _checks.numbers(values, f"{metric.name} samples of {name!r}")
    if x.ndim != 1:
        raise InvalidArgumentError(f"{metric.name} samples of {name!r} must be 1-D, got shape {x.shape}")
    if x.size < MIN_SAMPLES:
        raise InvalidArgumentError(
            f"{metric.name} samples of {name!r}: need at least {MIN_SAMPLES} values, got {x.size}"
        )
    bad = np.flatnonzero(~np.isfinite(x))
    if bad.size:
        raise InvalidArgumentError(
            f"{metric.name} samples of {name!r} must be finite; index {bad[0]} is {x[bad[0]]}"
        )
    if metric.positive and (x <= 0).any():
        first = int(np.flatnonzero(x <= 0)[0])
        raise InvalidArgumentError(
            f"{metric.name} samples of {name!r} must be > 0; index {first} is {x[first]}"
        )
    return x
