"""Experiment assignment: deterministic bucketing of units to variants, and the check that the
observed split matches the design (a sample ratio mismatch means the experiment is broken):
Pearson's chi-square for one look at the final counts, and Lindon & Malek's (2022)
Dirichlet-multinomial Bayes factor for a check repeated as units arrive.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from torchhal.evaluation.stats import _checks
from torchhal.evaluation.stats.distributions import chi2_sf
from torchhal.evaluation.stats.special import log_beta
from torchhal.hal_core.errors import InvalidArgumentError

V = TypeVar("V", bound=Hashable)

# The Dirichlet prior's total weight c, in units (see `sequential_sample_ratio_mismatch`).
SRM_CONCENTRATION = 100.0


@dataclass(frozen=True, slots=True)
class SampleRatioMismatch:
    """Pearson's chi-square goodness of fit of the observed counts to the designed split."""

    statistic: float
    df: int
    p_value: float
    observed: tuple[int, ...]
    expected: tuple[float, ...]
    total: int


@dataclass(frozen=True, slots=True)
class SequentialSampleRatioMismatch:
    """The Bayes factor of the counts against the designed split, and the p-value it gives."""

    log_bayes_factor: float
    p_value: float  # min(1, 1/BF); the smallest over all looks so far is the anytime-valid one
    observed: tuple[int, ...]
    expected: tuple[float, ...]
    total: int
    concentration: float


def unit_uniform(unit_id: str, salt: str) -> float:
    """A uniform number in [0, 1) fixed by (salt, unit_id): the top 53 bits of a BLAKE2b digest.

    The salt is length-prefixed so no (salt, id) pair collides with another by concatenation.
    Python's `hash()` is never used: it is salted per process.
    """
    if not isinstance(unit_id, str) or not isinstance(salt, str):
        raise InvalidArgumentError(
            f"unit_id and salt must be str, got {type(unit_id).__name__} and {type(salt).__name__}"
        )
    salt_bytes = salt.encode("utf-8")
    message = len(salt_bytes).to_bytes(8, "big") + salt_bytes + unit_id.encode("utf-8")
    digest = hashlib.blake2b(message, digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) / 2.0**53  # 53 bits: exact in a float, never 1.0


def assign(unit_id: str, variants: Sequence[V], weights: Sequence[float] | None = None, salt: str = "") -> V:
    """The variant for `unit_id`: the same on every call, process and machine, for the same salt.

    Variant i gets the units whose uniform falls in its slice of [0, 1), slices proportional to
    `weights` (equal when None). Change the salt to re-randomise for a new experiment.
    """
    variants = list(variants)
    if not variants:
        raise InvalidArgumentError("assign needs at least one variant, got none")
    if len(set(variants)) != len(variants):
        raise InvalidArgumentError(f"variants must be distinct, got {variants!r}")
    w = np.ones(len(variants)) if weights is None else _checks.numbers(weights, "weights")
    if w.shape != (len(variants),):
        raise InvalidArgumentError(
            f"weights must give one number per variant ({len(variants)}), got {w.shape}"
        )
    bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
    if bad.size or w.sum() <= 0:
        where = f"index {bad[0]} is {w[bad[0]]}" if bad.size else f"they sum to {w.sum()}"
        raise InvalidArgumentError(f"weights must be finite, >= 0 and sum to > 0; {where}")
    edges = np.cumsum(w) / w.sum()
    edges[-1] = 1.0
    return variants[int(np.searchsorted(edges, unit_uniform(unit_id, salt), side="right"))]


def _counts_and_ratios(
    counts: Sequence[int], expected_ratios: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    """Counts (integers >= 0) and designed ratios (> 0), one of each per variant; ratios normalised."""
    observed = _checks.sample(counts, "counts", min_size=2)
    ratios = _checks.sample(expected_ratios, "expected_ratios", min_size=2)
    if observed.shape != ratios.shape:
        raise InvalidArgumentError(
            f"counts and expected_ratios need one entry per variant; got {observed.size} and {ratios.size}"
        )
    bad = np.flatnonzero((observed < 0) | (observed != np.floor(observed)))
    if bad.size:
        raise InvalidArgumentError(f"counts must be integers >= 0; index {bad[0]} is {observed[bad[0]]}")
    bad = np.flatnonzero(ratios <= 0)
    if bad.size:
        raise InvalidArgumentError(f"expected ratios must be > 0; index {bad[0]} is {ratios[bad[0]]}")
    return observed, ratios / ratios.sum()


def sample_ratio_mismatch(counts: Sequence[int], expected_ratios: Sequence[float]) -> SampleRatioMismatch:
    """Chi-square test that `counts` per variant follow `expected_ratios` (Pearson 1900).

    A small p-value (SRM practice alerts at p < 0.001) means assignment or logging lost units
    unevenly, and no comparison between the arms can be trusted (Fabijan et al. 2019). Valid
    for one look: checked again as units arrive, use `sequential_sample_ratio_mismatch`.
    """
    observed, ratios = _counts_and_ratios(counts, expected_ratios)
    total = int(observed.sum())
    if total == 0:
        raise InvalidArgumentError("sample ratio check needs at least one counted unit; all counts are 0")
    expected = total * ratios
    statistic = float(np.sum((observed - expected) ** 2 / expected))
    df = observed.size - 1
    return SampleRatioMismatch(
        statistic,
        df,
        chi2_sf(statistic, df),
        tuple(int(c) for c in observed),
        tuple(float(e) for e in expected),
        total,
    )


def _log_multivariate_beta(a: Sequence[float]) -> float:
    """log B(a) = Σ log Γ(a_i) − log Γ(Σ a_i), as a chain of two-argument log-betas (accurate at
    large counts): B(a_1, ..., a_k) = Π_i B(a_1 + ... + a_{i-1}, a_i)."""
    total, value = a[0], 0.0
    for item in a[1:]:
        value += log_beta(total, item)
        total += item
    return value


def sequential_sample_ratio_mismatch(
    counts: Sequence[int], expected_ratios: Sequence[float], *, concentration: float = SRM_CONCENTRATION
) -> SequentialSampleRatioMismatch:
    """The sample-ratio check that may be repeated after every unit (Lindon & Malek 2022).

    Against the designed probabilities p, the alternative is a Dirichlet(c·p) mixture of
    multinomials; the Bayes factor BF = B(c·p + n) / B(c·p) / Π p_i^n_i (B the multivariate
    beta) is a nonnegative martingale of mean 1 under a sound split, so by Ville's inequality
    P(BF ever reaches 1/α) <= α however often it is looked at. p = min(1, 1/BF); the smallest
    p of all looks so far is anytime-valid (a live check keeps that running minimum).

    c = 100 (two prior sds put a 50:50 split's shares within ±0.1): at srm_alpha = 0.001,
    and the expected counts of a broken 50:50 split, an arm with no traffic is flagged at 45
    units, 45:55 at ~1,800, 46:54 at ~2,700 and 49:51 at ~50,000 (c = 1: 13, 2,200, 3,400,
    64,000; c = 10,000: 380, 4,600, 5,900, 47,000); a 99:1 canary whose candidate gets nothing
    at ~920 units, or half its share at ~5,700. No prior flags 1000 : 850 against 50:50 at
    0.001: its likelihood ratio at the best split is 440 < 1000.
    """
    observed, ratios = _counts_and_ratios(counts, expected_ratios)
    c = _checks.finite_number(concentration, "concentration")
    if c <= 0:
        raise InvalidArgumentError(f"concentration must be > 0, got {concentration!r}")
    prior = c * ratios
    seen = observed > 0
    log_bf = (
        _log_multivariate_beta((prior + observed).tolist())
        - _log_multivariate_beta(prior.tolist())
        - float(np.sum(observed[seen] * np.log(ratios[seen])))
    )
    total = int(observed.sum())
    return SequentialSampleRatioMismatch(
        log_bf,
        1.0 if log_bf <= 0.0 else math.exp(-log_bf),
        tuple(int(v) for v in observed),
        tuple(float(e) for e in total * ratios),
        total,
        c,
    )
