"""Live monitoring: feed observations as they arrive, read an always-valid decision at any time.

For traffic split between a control and a candidate (an inference router sending a share of
requests to a new device, kernel or model), `LiveMonitor` keeps an always-valid confidence
sequence for mean(candidate) − mean(control) (`stats.SequentialTest`, an mSPRT), so reading
it after every observation does not inflate the false-positive rate. Its normal approximation
needs more values in the smaller arm when the weights are unequal, the more so the more skewed
the metric (latencies, error rates): the test waits for them and the reason says so
(`stats.sequential.SKEWNESS_LIMIT` gives what that costs). `status()` says:

* roll-back: the candidate is significantly worse (always-valid p <= alpha) and its estimated
  regression exceeds the noise threshold; or the observed split departs from the designed one
  (sample ratio mismatch, p < `srm_alpha`), which means the comparison itself is broken. The
  split check is anytime-valid too (`stats.sequential_sample_ratio_mismatch`, a Bayes factor
  whose running maximum the monitor keeps): a sound split is rolled back with probability
  <= `srm_alpha` over all looks together, not at each one (a per-look exact binomial test,
  read after every unit at 0.001, rolled back 2.8% of sound 50:50 splits by 10,000 units). The
  price is units: 1000 : 850 against 50:50 is not flagged at 0.001, the same ratio is from
  ~2,700 units (see that function for the prior and what it detects when);
* stop: the candidate is significantly better beyond the threshold, or the confidence
  sequence lies within ± the threshold (equivalent), or `max_samples` were seen without a
  decision (inconclusive, said so);
* continue: otherwise, the reason saying why. A relative threshold has no scale while the
  control's mean is exactly 0 (an error rate with no errors yet in the control): the effect is
  then not judged at all (no roll-back, improvement or equivalence on a ratio to 0) until the
  control's mean moves off 0; the sample-ratio check and `max_samples` still apply.
`assign(unit_id)` gives the deterministic variant for a request (`stats.assign`).
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from torchhal.evaluation.metrics import Threshold
from torchhal.evaluation.stats import (
    Decision,
    SequentialTest,
    _checks,
    assign,
    sequential_sample_ratio_mismatch,
)
from torchhal.hal_core import InvalidArgumentError, telemetry
from torchhal.hal_core.kernels import is_finite_number

log = telemetry.get_logger("torchhal.evaluation.monitor")

# Observations beyond this magnitude are refused: the running variance sums their squares, and
# at 1e160 these overflowed, so every later status() raised OverflowError. No metric's unit
# comes near it (bytes, ms, error rates); such a value is a bug upstream.
MAX_MAGNITUDE = 1e100


class MonitorDecision(str, enum.Enum):
    CONTINUE = "continue"
    STOP = "stop"
    ROLL_BACK = "roll-back"


@dataclass(frozen=True, slots=True)
class MonitorStatus:
    decision: MonitorDecision
    reason: str
    difference: float  # mean(candidate) − mean(control); NaN until both arms have data
    interval: tuple[float, float]  # always-valid, for the difference
    p_value: float  # always-valid
    threshold: float  # absolute, in the metric's unit; NaN until the control has data, and
    # while a relative threshold scales a control mean of 0 (the reason says so)
    n_control: int
    n_candidate: int
    srm_p_value: float | None  # anytime-valid: the smallest over all looks so far; None before any unit


class LiveMonitor:
    """An always-valid A/B monitor for one metric. Thread-safe: routers observe from many threads."""

    def __init__(
        self,
        *,
        control: str,
        candidate: str,
        higher_is_better: bool,
        threshold: Threshold,
        alpha: float = 0.05,
        weights: Sequence[float] = (0.5, 0.5),
        srm_alpha: float = 0.001,
        min_samples: int = 10,
        tuning_n: int = 100,
        max_samples: int | None = None,
        salt: str = "",
    ) -> None:
        if control == candidate:
            raise InvalidArgumentError(f"control and candidate must differ, both are {control!r}")
        if not isinstance(threshold, Threshold):  # a bare 0.05 failed at the first status()
            raise InvalidArgumentError(
                f"threshold must be a Threshold (Threshold(relative=x) or Threshold(absolute=x)), "
                f"got {threshold!r} ({type(threshold).__name__})"
            )
        if len(weights) != 2:
            raise InvalidArgumentError(f"weights: one per arm (control, candidate), got {list(weights)}")
        # checked here, not at the first request or look: both arms must get traffic to be compared
        for arm, w in zip(("control", "candidate"), weights, strict=True):
            if not (is_finite_number(w) and w > 0):
                raise InvalidArgumentError(f"weight of the {arm} must be a finite number > 0, got {w!r}")
        if not 0 < srm_alpha < 1:
            raise InvalidArgumentError(f"srm_alpha must lie strictly between 0 and 1, got {srm_alpha!r}")
        self._test = SequentialTest(
            higher_is_better=higher_is_better, alpha=alpha, tuning_n=tuning_n, min_samples=min_samples
        )
        if max_samples is not None:  # NaN compared false with every count: it never stopped
            if isinstance(max_samples, bool) or not isinstance(max_samples, (int, np.integer)):
                raise InvalidArgumentError(
                    f"max_samples must be an integer (a count of observations) or None, got {max_samples!r}"
                )
            if max_samples < 2 * min_samples:
                raise InvalidArgumentError(
                    f"max_samples must be at least 2 × min_samples = {2 * min_samples}, got {max_samples}"
                )
            max_samples = int(max_samples)
        self.control, self.candidate = control, candidate
        self.threshold = threshold
        self.weights = tuple(float(w) for w in weights)
        self.srm_alpha, self.max_samples, self.salt = srm_alpha, max_samples, salt
        self._pending: dict[str, list[float]] = {control: [], candidate: []}
        self._count = {control: 0, candidate: 0}
        self._control_sum = 0.0
        self._srm_p: float | None = None  # the running minimum over looks
        self._lock = threading.Lock()

    def assign(self, unit_id: str) -> str:
        """The arm for `unit_id` (a request or user id): the same on every call and process."""
        return assign(unit_id, [self.control, self.candidate], self.weights, self.salt)

    def observe(self, variant: str, value: float) -> None:
        self.observe_many(variant, [value])

    def observe_many(self, variant: str, values: Iterable[float]) -> None:
        if variant not in self._pending:
            raise InvalidArgumentError(
                f"unknown variant {variant!r}; this monitor compares {self.candidate!r} with {self.control!r}"
            )
        # a generator is read once, here; the check names the variant, the index and the value
        array = _checks.sample(
            values if isinstance(values, np.ndarray) else list(values),
            variant,
            min_size=0,
        )
        huge = np.flatnonzero(np.abs(array) > MAX_MAGNITUDE)
        if huge.size:
            raise InvalidArgumentError(
                f"observations of {variant!r} must lie within ± {MAX_MAGNITUDE:g}; index {huge[0]} is "
                f"{float(array[huge[0]])!r}"
            )
        batch = array.tolist()
        with self._lock:
            self._pending[variant] += batch
            self._count[variant] += len(batch)
            if variant == self.control:
                self._control_sum += sum(batch)

    def status(self) -> MonitorStatus:
        """Feed what arrived since the last look to the sequential test, and decide."""
        with self._lock:
            a, b = self._pending[self.candidate], self._pending[self.control]
            if a or b:  # taken out first: a look that raised fed them again at the next one
                self._pending = {self.control: [], self.candidate: []}
                self._test.update(a, b)
            state = self._test.state
            n_control, n_candidate = self._count[self.control], self._count[self.candidate]
            control_mean = self._control_sum / n_control if n_control else math.nan
            srm = self._srm(n_control, n_candidate)
        threshold, undefined = math.nan, None
        if n_control and self.threshold.relative and control_mean == 0.0:
            undefined = (
                f"the relative effect is undefined while the control's mean is 0: the threshold is "
                f"{self.threshold.relative:g} of it, judged once that mean moves off 0"
            )
        elif n_control:
            threshold = self.threshold.absolute_for(control_mean, f"monitor of {self.candidate!r}")
        why = "; ".join(r for r in (state.waiting, undefined) if r) or None
        decision, reason = self._decide(state.decision, state.difference, state.interval, threshold, srm, why)
        status = MonitorStatus(
            decision,
            reason,
            state.difference,
            state.interval,
            state.p_value,
            threshold,
            n_control,
            n_candidate,
            srm,
        )
        if decision is not MonitorDecision.CONTINUE:
            log.info("monitor decision", decision=decision.value, reason=reason, candidate=self.candidate)
        return status

    def _srm(self, n_control: int, n_candidate: int) -> float | None:
        """The anytime-valid sample-ratio p-value: the smallest p = 1/BF of any look so far (the
        Bayes factor depends on the counts only; its running maximum is what Ville's inequality
        bounds). An arm with no units counts too. Called under the lock."""
        if n_control + n_candidate > 0:
            look = sequential_sample_ratio_mismatch([n_control, n_candidate], self.weights).p_value
            self._srm_p = look if self._srm_p is None else min(self._srm_p, look)
        return self._srm_p

    def _decide(
        self,
        sequential: Decision,
        difference: float,
        interval: tuple[float, float],
        threshold: float,
        srm: float | None,
        why: str | None,
    ) -> tuple[MonitorDecision, str]:
        """`why` says why the effect is not judged yet: the sequential test has not looked (too
        few values, or both arms constant), or a relative threshold scales a control mean of 0."""
        if srm is not None and srm < self.srm_alpha:
            return MonitorDecision.ROLL_BACK, (
                f"sample ratio mismatch (p = {srm:.3g} < {self.srm_alpha:g}): the split departs from "
                f"{self.weights}, so the comparison cannot be trusted"
            )
        beyond = math.isfinite(difference) and abs(difference) > threshold
        if sequential is Decision.REGRESSED and beyond:
            return MonitorDecision.ROLL_BACK, (
                f"regressed: difference {difference:+.4g} beyond the threshold {threshold:.4g}, "
                f"always-valid interval {interval[0]:.4g} .. {interval[1]:.4g}"
            )
        if sequential is Decision.IMPROVED and beyond:
            return MonitorDecision.STOP, (
                f"improved: difference {difference:+.4g} beyond the threshold {threshold:.4g}, "
                f"always-valid interval {interval[0]:.4g} .. {interval[1]:.4g}"
            )
        if math.isfinite(threshold) and -threshold < interval[0] and interval[1] < threshold:
            return MonitorDecision.STOP, (
                f"equivalent: the always-valid interval {interval[0]:.4g} .. {interval[1]:.4g} lies "
                f"within ± {threshold:.4g}"
            )
        seen = self._count[self.control] + self._count[self.candidate]
        if self.max_samples is not None and seen >= self.max_samples:
            return (
                MonitorDecision.STOP,
                f"inconclusive: {seen} observations reached max_samples without a decision"
                + (f" ({why})" if why else ""),
            )
        return MonitorDecision.CONTINUE, f"no decision yet: {why}" if why else "no decision yet"
