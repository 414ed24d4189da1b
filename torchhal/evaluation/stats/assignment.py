"""Experiment assignment: deterministic bucketing of units to variants, and the check that the
observed split matches the design (a sample ratio mismatch means the experiment is broken).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from torchhal.evaluation.stats import _checks
from torchhal.evaluation.stats.distributions import chi2_sf
from torchhal.hal_core.errors import InvalidArgumentError

V = TypeVar("V", bound=Hashable)


@dataclass(frozen=True, slots=True)
class SampleRatioMismatch:
    """Pearson's chi-square goodness of fit of the observed counts to the designed split."""

    statistic: float
    df: int
    p_value: float
    observed: tuple[int, ...]
    expected: tuple[float, ...]
    total: int


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
    w = np.ones(len(variants)) if weights is None else np.asarray(weights, dtype=np.float64)
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


def sample_ratio_mismatch(counts: Sequence[int], expected_ratios: Sequence[float]) -> SampleRatioMismatch:
    """Chi-square test that `counts` per variant follow `expected_ratios` (Pearson 1900).

    A small p-value (SRM practice alerts at p < 0.001) means assignment or logging lost units
    unevenly, and no comparison between the arms can be trusted (Fabijan et al. 2019).
    """
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
    total = int(observed.sum())
    if total == 0:
        raise InvalidArgumentError("sample ratio check needs at least one counted unit; all counts are 0")
    expected = total * ratios / ratios.sum()
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
