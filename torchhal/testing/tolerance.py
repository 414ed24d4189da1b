"""The FlashAttention-style tolerance for a kernel candidate against its op's reference.

A candidate's max error against an fp64 "truth" (the reference run on fp64 copies of the
same rounded inputs) may be at most 2x the max error of the reference run in the
candidate's own dtype, plus a floor that keeps the bound above zero when that error is 0:
- 2·max|((t + 0.3) - 0.3) - t| computed in the dtype, t the truth rounded to the dtype
  (FlashAttention-3's forward floor: about two ulps at the data's scale);
- for fp32 and fp64 also 64 ulps of the largest |truth| in the precision the reference
  computes in: the same-dtype reference can be as exact as the truth (fp64: the very same
  computation, error 0), while a correct candidate that sums in another order differs by
  O(sqrt(K)) ulps; 64 ulps covers reductions thousands of elements long and still fails a
  kernel off by 1e-5 in fp32. The ulps are fp32's for fp32 outputs, and fp64's for fp64 ones
  unless the reference computed them in fp32 (every value of the truth an fp32 number), so an
  fp64 candidate that computes in fp32 fails.
Values equal to the truth count as no error, equal infinities included (attention's lse is -inf
for a query that sees no key), and the floor reads the finite truth only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

REFERENCE_ERROR_FACTOR = 2.0
FULL_PRECISION_FLOOR_ULPS = 64


@dataclass(frozen=True, slots=True)
class Comparison:
    error: float  # candidate vs truth, max abs
    reference_error: float  # same-dtype reference vs truth, max abs
    bound: float

    @property
    def ok(self) -> bool:
        return self.error <= self.bound  # False for NaN errors

    @property
    def ratio(self) -> float:
        """The error as a fraction of the allowed one: 0 for an exact answer, even where nothing
        was allowed (an all-zero output), which read "inf of the allowed error" and, as the
        worst case, hid the candidate's real worst."""
        if self.error == 0:
            return 0.0
        return self.error / self.bound if self.bound > 0 else float("inf")

    def __str__(self) -> str:
        return (
            f"error {self.error:.3g} vs allowed {self.bound:.3g} "
            f"({REFERENCE_ERROR_FACTOR:g} x reference error {self.reference_error:.3g} + floor)"
        )


def floor(truth: torch.Tensor, dtype: torch.dtype) -> float:
    import torch

    truth = truth[truth.isfinite()]
    if truth.numel() == 0:
        return 0.0
    t = truth.to(dtype)
    bound = 2 * (((t + 0.3) - 0.3) - t).abs().max().double().item()
    if dtype in (torch.float32, torch.float64):
        eps = torch.finfo(_computed_in(truth, dtype)).eps
        bound += FULL_PRECISION_FLOOR_ULPS * eps * truth.abs().max().item()
    return bound


def _computed_in(truth: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The precision the reference computed an fp32 or fp64 output in: fp32 for fp32, and for
    fp64 fp32 too where every (finite) value of the truth is an fp32 number, as a reference that
    computes in fp32 returns them (a result computed in fp64 from random inputs is not)."""
    import torch

    finite = truth[truth.isfinite()]
    if dtype == torch.float64 and not bool((finite.float().double() == finite).all()):
        return torch.float64
    return torch.float32


def compare(candidate: torch.Tensor, reference: torch.Tensor, truth: torch.Tensor) -> Comparison:
    """Candidate and same-dtype reference outputs against the fp64 truth (all moved to the host)."""
    truth = truth.cpu().double()
    error = _max_abs(_difference(candidate.cpu().double(), truth))
    reference_error = _max_abs(_difference(reference.cpu().double(), truth))
    bound = REFERENCE_ERROR_FACTOR * reference_error + floor(truth, reference.dtype)
    return Comparison(error, reference_error, bound)


def _difference(got: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """got - truth, 0 where they are equal (so -inf against -inf is no error, not NaN)."""
    return (got - truth).masked_fill(got == truth, 0.0)


def _max_abs(diff: torch.Tensor) -> float:
    if diff.numel() == 0:
        return 0.0
    if diff.isnan().any():
        return float("nan")
    return float(diff.abs().max().item())
