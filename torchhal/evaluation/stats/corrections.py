"""Multiple-comparison corrections: adjusted p-values for a family of tests run together."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from torchhal.evaluation.stats import _checks


@dataclass(frozen=True, slots=True)
class CorrectedPValues:
    """Adjusted p-values in the input's order, and which hypotheses are rejected at `alpha`."""

    adjusted: tuple[float, ...]
    reject: tuple[bool, ...]
    alpha: float
    method: str


def _result(order: np.ndarray, adjusted_sorted: np.ndarray, alpha: float, method: str) -> CorrectedPValues:
    adjusted = np.empty_like(adjusted_sorted)
    adjusted[order] = np.minimum(adjusted_sorted, 1.0)
    return CorrectedPValues(
        tuple(float(v) for v in adjusted), tuple(bool(v <= alpha) for v in adjusted), alpha, method
    )


def holm(pvalues: Sequence[float] | np.ndarray, alpha: float = 0.05) -> CorrectedPValues:
    """Holm's (1979) step-down adjustment; controls the family-wise error rate.

    For sorted p_(1) <= ... <= p_(m): adj_(i) = max_{j<=i} min(1, (m − j + 1)·p_(j)), as
    statsmodels' `multipletests(method="holm")` defines it.
    """
    p = _checks.pvalues(pvalues)
    alpha = _checks.probability(alpha, "alpha")
    order = np.argsort(p, kind="stable")
    m = p.size
    stepped = p[order] * np.arange(m, 0, -1)
    return _result(order, np.maximum.accumulate(stepped), alpha, "holm")


def benjamini_hochberg(pvalues: Sequence[float] | np.ndarray, alpha: float = 0.05) -> CorrectedPValues:
    """Benjamini & Hochberg's (1995) step-up adjustment; controls the false discovery rate.

    For sorted p-values: adj_(i) = min_{j>=i} min(1, m·p_(j)/j), as statsmodels'
    `multipletests(method="fdr_bh")` defines it. Valid for independent or positively dependent tests.
    """
    p = _checks.pvalues(pvalues)
    alpha = _checks.probability(alpha, "alpha")
    order = np.argsort(p, kind="stable")
    m = p.size
    # m·p/j rounded once: in floats (p·m)/j rounds twice, and p = 0.05 at rank j = m came out
    # 0.05000000000000001, not rejected at alpha = 0.05 although p_(j) <= j·alpha/m holds.
    scaled = np.array([float(Fraction(v) * m / j) for j, v in enumerate(p[order].tolist(), start=1)])
    return _result(order, np.minimum.accumulate(scaled[::-1])[::-1], alpha, "benjamini-hochberg")
