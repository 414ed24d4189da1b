"""A health monitor beside the collectives: heartbeats, non-finite losses, stragglers.

A hung or dead peer shows up inside the collectives as a wait that ends only at the process
group's timeout, or as an error that names no rank ("Connection closed by peer"). The monitor
runs a thread outside the collectives that writes this rank's heartbeat to the rendezvous store
every `interval` seconds (`hb/<rank>`: wall time, steps done, median step time) and reads its
peers'. When a collective fails, `diagnose()` (or `guard()`) turns the failure into a
`CollectiveError` that says which rank is dead (its heartbeat older than `deadline`, with the
age) or hung (alive, but it never reported the failure its peers saw), within `deadline`
seconds. Pair it with a short process-group timeout so a hang surfaces in seconds. `observe()`
checks each step's loss and gradient norm for NaN/inf (a non-finite gradient norm on a step the
fp16 gradient scaler skipped is counted, not raised) and, on rank 0, flags stragglers: ranks
whose median step time exceeds the median of the others' by `straggler_factor`. The step time it
compares is the forward's (`StepStats.forward_s`) where `train` recorded it: a synchronous step
lasts as long as the slowest rank's on every rank, so whole-step times cannot tell the straggler
apart, while the forward runs no collective under DDP, local or heterogeneous training (under
FSDP it waits on parameter all-gathers, so a straggler shows only in part).
Heartbeats carry wall-clock time: hosts must agree on it to well under `deadline` (NTP does).
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from torchhal.hal_core import CollectiveError, InvalidArgumentError, TorchHALError, telemetry

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

    from torchhal.distributed.loop import StepStats

log = telemetry.get_logger("torchhal.distributed.health")


class NonFiniteError(TorchHALError, FloatingPointError):
    """A training step produced a NaN or infinite loss or gradient norm."""


@dataclass(frozen=True)
class Heartbeat:
    """What a rank last published: when, how many steps it had done, and the median of its per-step
    times (`StepStats.forward_s` where recorded, else `step_time_s`)."""

    time: float
    steps: int
    median_s: float | None

    def age(self, now: float) -> float:
        return max(0.0, now - self.time)


def stragglers(medians: Mapping[int, float], factor: float) -> dict[int, float]:
    """Ranks whose median (forward) time exceeds `factor` x the median of the other ranks' medians,
    mapped to that ratio. Needs at least two ranks."""
    slow = {}
    for rank, mine in medians.items():
        others = [m for r, m in medians.items() if r != rank]
        if not others:
            continue
        typical = statistics.median(others)
        if typical > 0 and mine > factor * typical:
            slow[rank] = mine / typical
    return slow


class HealthMonitor:
    """Heartbeats through `store` for rank `rank` of `world_size`; start with `start()` or `with`."""

    def __init__(
        self,
        store: Store,
        *,
        rank: int,
        world_size: int,
        interval: float = 0.5,
        deadline: float = 5.0,
        straggler_factor: float = 2.0,
        window: int = 20,
        max_scaler_skips: int = 20,
        on_failure: Callable[[CollectiveError], None] | None = None,
    ) -> None:
        # comparisons with NaN or inf are never true: a NaN factor or skip limit turned the check
        # off, and an infinite deadline made diagnose() wait for a hung peer forever
        if not (0 < interval < deadline and math.isfinite(deadline)):
            raise InvalidArgumentError(
                f"HealthMonitor: need 0 < interval < deadline, got interval {interval}, deadline "
                f"{deadline} (both finite)"
            )
        if not 0 <= rank < world_size:
            raise InvalidArgumentError(f"HealthMonitor: rank {rank} outside world of size {world_size}")
        if not (math.isfinite(straggler_factor) and straggler_factor > 1):
            raise InvalidArgumentError(
                f"HealthMonitor: straggler_factor must be > 1, got {straggler_factor} (and finite)"
            )
        for name, value in (("window", window), ("max_scaler_skips", max_scaler_skips)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(
                    f"HealthMonitor: {name} must be >= 1, got {value!r} (a whole number of steps)"
                )
        self.store = dist.PrefixStore("torchhal_health/", store)
        self.rank, self.world_size = rank, world_size
        self.interval, self.deadline = interval, deadline
        self.straggler_factor = straggler_factor
        self.on_failure = on_failure
        self._times: deque[float] = deque(maxlen=window)
        self._steps = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_at = time.time()
        self._failure: CollectiveError | None = None
        self._flagged: set[int] = set()
        self.max_scaler_skips = max_scaler_skips
        self._scaler_skips = 0  # in a row

    # -- lifetime ------------------------------------------------------------------------------

    def start(self) -> HealthMonitor:
        self._started_at = time.time()
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"torchhal-health-{self.rank}", daemon=True)
        self._thread.start()
        log.info("health monitor started", rank=self.rank, interval=self.interval, deadline=self.deadline)
        return self

    def stop(self) -> None:
        """Stop beating, waiting four intervals for the thread. A thread still inside a store call
        after that (a slow or unreachable store) is logged and counted, not forgotten: a later
        `stop()` waits for it again. As a daemon it ends with its store call or with the process."""
        self._stop.set()
        thread = self._thread
        if thread is None:
            return
        waited = self.interval * 4
        thread.join(timeout=waited)
        if thread.is_alive():
            telemetry.count("torchhal.health.thread_outlived_stop")
            log.warning(
                "health monitor: its thread is still in a store call after stop() waited for it",
                rank=self.rank,
                waited_s=waited,
            )
            return
        self._thread = None

    def __enter__(self) -> HealthMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what the training loop calls ----------------------------------------------------------

    def observe(self, stats: StepStats) -> None:
        """Record a finished step (pass it as `train(on_step=...)`): non-finite values raise
        NonFiniteError naming the step; rank 0 also checks the ranks' step times for stragglers.

        A step the fp16 gradient scaler skipped is not an error: the scaler found inf/nan
        gradients, left the weights alone and lowered its scale. Its non-finite gradient norm is
        counted (`torchhal.health.scaler_skipped`) and logged instead; a non-finite loss still
        raises, and so do `max_scaler_skips` skips in a row (gradients that stay non-finite
        however far the scale falls).
        """
        bad = {
            name: value
            for name, value in (("loss", stats.loss), ("gradient norm", stats.grad_norm))
            if value is not None and not math.isfinite(value)
        }
        if stats.scaler_skipped:
            bad.pop("gradient norm", None)
        if bad:
            telemetry.count("torchhal.health.non_finite")
            detail = ", ".join(f"{name} {value}" for name, value in bad.items())
            raise NonFiniteError(f"step {stats.step} on rank {self.rank}: {detail}")
        self._scaler_skips = self._scaler_skips + 1 if stats.scaler_skipped else 0
        if self._scaler_skips >= self.max_scaler_skips:  # the scale only falls: this run diverged
            telemetry.count("torchhal.health.non_finite")
            raise NonFiniteError(
                f"step {stats.step} on rank {self.rank}: the gradient scaler skipped {self._scaler_skips} "
                f"steps in a row (max_scaler_skips {self.max_scaler_skips}; scale now {stats.scale}), "
                f"gradient norm {stats.grad_norm}"
            )
        if stats.scaler_skipped:
            telemetry.count("torchhal.health.scaler_skipped")
            log.info(
                "gradient scaler skipped the optimizer step",
                rank=self.rank,
                step=stats.step,
                grad_norm=stats.grad_norm,
                scale=stats.scale,
            )
        with self._lock:  # a synchronous step lasts as long as the slowest rank's on every rank
            self._times.append(stats.forward_s if stats.forward_s is not None else stats.step_time_s)
            self._steps = stats.step + 1
        if self.rank == 0:
            self._check_stragglers(stats.step)

    def check(self) -> None:
        """Raise the failure the monitor thread found (a dead peer, an unreachable store), if any."""
        if self._failure is not None:
            raise self._failure

    def peers(self) -> dict[int, Heartbeat | None]:
        """Every rank's latest heartbeat (None for a rank that never published one)."""
        return {r: self._read(r) for r in range(self.world_size)}

    def diagnose(self, exc: BaseException) -> CollectiveError:
        """The clear error behind a failed collective: waits up to `deadline` for a dead peer's
        heartbeat to go stale, or for every live peer to report the failure too (those that never
        do are hung)."""
        with self._lock:
            steps = self._steps
        self._publish_failure(steps)
        give_up = time.time() + self.deadline + self.interval
        dead: dict[int, float] = {}
        silent: list[int] = []
        while True:
            now = time.time()
            try:
                dead = self._dead_peers(now)
                silent = [r for r in self._others() if r not in dead and not self._reported_failure(r)]
            except (RuntimeError, ValueError) as store_exc:
                return self._store_failure(store_exc, exc)
            if dead or not silent or now >= give_up:
                break
            time.sleep(self.interval / 2)
        if dead:
            error = self._dead_error(dead, steps)
        elif silent:
            error = CollectiveError(
                f"rank {self.rank} at step {steps}: a collective failed ({exc}); rank(s) {silent} are "
                f"alive (heartbeats under {self.deadline:g} s old) but did not reach the failure within "
                f"{self.deadline:g} s: they are hung"
            )
            telemetry.count("torchhal.health.hung_peer")
        else:
            error = CollectiveError(
                f"rank {self.rank} at step {steps}: a collective failed on every rank, and every rank is "
                f"alive: {exc}"
            )
        log.error("collective failure diagnosed", rank=self.rank, error=str(error))
        return error

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Run training inside: a failed collective comes out as `diagnose()`'s CollectiveError."""
        try:
            yield
        except RuntimeError as exc:  # torch.distributed's errors, and the Communicator's CollectiveError
            if isinstance(exc, TorchHALError) and not isinstance(exc, CollectiveError):
                raise  # a checkpoint or kernel error is not a peer's failure
            raise self.diagnose(exc) from exc

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        """Beat and watch until stopped; after a failure keep beating, so peers see this rank alive."""
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                dead = self._dead_peers(time.time()) if self._failure is None else {}
            except (RuntimeError, ValueError) as exc:
                if self._failure is None:
                    self._fail(self._store_failure(exc, None))
                continue
            if dead:
                with self._lock:
                    steps = self._steps
                self._fail(self._dead_error(dead, steps))

    def _fail(self, error: CollectiveError) -> None:
        """Record the first failure the thread finds: `check()` raises it, `on_failure` hears it once."""
        self._failure = error
        log.error("health monitor: peer failure", rank=self.rank, error=str(error))
        if self.on_failure is not None:
            self.on_failure(error)

    def _beat(self) -> None:
        with self._lock:
            median = statistics.median(self._times) if self._times else None
            beat = {"time": time.time(), "steps": self._steps, "median_s": median}
        self.store.set(f"hb/{self.rank}", json.dumps(beat))

    # -- store reads ---------------------------------------------------------------------------

    def _read(self, rank: int) -> Heartbeat | None:
        key = f"hb/{rank}"
        if not self.store.check([key]):
            return None
        raw = json.loads(self.store.get(key))
        return Heartbeat(float(raw["time"]), int(raw["steps"]), raw["median_s"])

    def _others(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def _dead_peers(self, now: float) -> dict[int, float]:
        """Peers whose heartbeat (before their first: this monitor's start) is older than the deadline."""
        dead = {}
        for r in self._others():
            beat = self._read(r)
            age = beat.age(now) if beat is not None else now - self._started_at
            if age > self.deadline:
                dead[r] = age
        return dead

    def _publish_failure(self, steps: int) -> None:
        try:
            self.store.set(f"failed/{self.rank}", str(steps))
        except (RuntimeError, ValueError) as exc:
            log.warning(
                "could not publish the collective failure to the store", rank=self.rank, error=str(exc)
            )

    def _reported_failure(self, rank: int) -> bool:
        return bool(self.store.check([f"failed/{rank}"]))

    def _dead_error(self, dead: Mapping[int, float], steps: int) -> CollectiveError:
        telemetry.count("torchhal.health.dead_peer", value=len(dead))
        ages = ", ".join(f"rank {r}: last heartbeat {age:.1f} s ago" for r, age in sorted(dead.items()))
        return CollectiveError(
            f"rank {self.rank} at step {steps}: peer(s) dead, heartbeat older than the "
            f"{self.deadline:g} s deadline ({ages})"
        )

    def _store_failure(self, store_exc: BaseException, cause: BaseException | None) -> CollectiveError:
        telemetry.count("torchhal.health.store_unreachable")
        after = f" after a collective failed ({cause})" if cause is not None else ""
        return CollectiveError(
            f"rank {self.rank}: the rendezvous store is unreachable{after}: {store_exc}; the rank that "
            "hosts it (rank 0 under torchrun without an agent store) is probably dead"
        )

    # -- stragglers ----------------------------------------------------------------------------

    def _check_stragglers(self, step: int) -> None:
        medians = {
            r: beat.median_s
            for r, beat in self.peers().items()
            if beat is not None and beat.median_s is not None
        }
        if len(medians) < 2:
            return
        slow = stragglers(medians, self.straggler_factor)
        for rank in sorted(set(slow) - self._flagged):
            self._report_straggler(rank, slow[rank], medians, step)
        self._flagged = set(slow)

    def _report_straggler(self, rank: int, ratio: float, medians: Mapping[int, float], step: int) -> None:
        attributes: dict[str, Any] = {
            "rank": rank,
            "ratio": ratio,
            "median_s": medians[rank],
            "factor": self.straggler_factor,
            "step": step,
        }
        log.warning("straggler", **attributes, medians={str(r): m for r, m in medians.items()})
        telemetry.count("torchhal.health.straggler", rank=str(rank))
        with telemetry.span("torchhal.health.straggler", rank=rank, step=step) as span:
            span.add_event("straggler", attributes)
