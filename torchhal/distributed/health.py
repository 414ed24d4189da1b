"""A health monitor beside the collectives: heartbeats, non-finite losses, stragglers.

A hung or dead peer shows up inside the collectives as a wait that ends only at the process
group's timeout, or as an error that names no rank ("Connection closed by peer"). The monitor
runs a thread outside the collectives that writes this rank's heartbeat to the rendezvous store
every `interval` seconds (`hb/<rank>`: wall time, steps done, median step time) and reads its
peers'. When a collective fails, `diagnose()` (or `guard()`) turns the failure into a
`CollectiveError` that says which rank is dead (its heartbeat older than `deadline`, with the
age) or hung (alive, but it never reported the failure its peers saw), within `deadline`
seconds. Where no peer reported the failure at all, the error may be this rank's own (a bug,
not a collective's failure: torch's collective errors are plain RuntimeErrors too), and the
message says so. A failure report names its failure: the steps done when it was diagnosed and
its ordinal among the failures diagnosed at that count, carried in the heartbeat; a peer counts
as reporting it only with a report of that failure or a later one, so one survived failure's
reports never vouch for the next. Ranks agree on the steps when each calls `observe()` every
step (`train(on_step=...)` does). Heartbeats are read with one `multi_get` for every rank.
Pair it with a short process-group timeout so a hang surfaces in seconds. `observe()`
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
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
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
    failure: tuple[int, int] | None = None
    """The last collective failure the rank diagnosed: (steps done then, its ordinal at that count)."""

    def age(self, now: float) -> float:
        return max(0.0, now - self.time)

    @classmethod
    def parse(cls, raw: bytes | str) -> Heartbeat:
        value = json.loads(raw)
        failure = value.get("failure")
        return cls(
            float(value["time"]),
            int(value["steps"]),
            value["median_s"],
            None if failure is None else (int(failure[0]), int(failure[1])),
        )


def check_timing(interval: float, deadline: float, *, owner: str = "HealthMonitor") -> None:
    """Refuse heartbeat timing the monitor cannot work with (`owner` names who was given it)."""
    # comparisons with NaN or inf are never true: an infinite deadline made diagnose() wait for a
    # hung peer forever
    if not (0 < interval < deadline and math.isfinite(deadline)):
        raise InvalidArgumentError(
            f"{owner}: need 0 < interval < deadline, got interval {interval}, deadline "
            f"{deadline} (both finite)"
        )


def stragglers(medians: Mapping[int, float], factor: float) -> dict[int, float]:
    """Ranks whose median (forward) time exceeds `factor` x the median of the other ranks' medians,
    mapped to that ratio. Needs at least two ranks."""
    # the median of the others is the median of the sorted values with one left out: read off by
    # position, so rank 0's check every step costs n log n, not n^2 (73 ms at 1024 ranks)
    ordered = sorted(medians.values())
    n = len(ordered)
    if n < 2:
        return {}
    first_at: dict[float, int] = {}
    for i, value in enumerate(ordered):
        first_at.setdefault(value, i)

    def without(i: int, j: int) -> float:  # element j of `ordered` with element i removed
        return ordered[j] if j < i else ordered[j + 1]

    slow = {}
    half = (n - 1) // 2
    for rank, mine in medians.items():
        i = first_at[mine]  # equal values are interchangeable: leaving out any one leaves the same list
        typical = without(i, half) if (n - 1) % 2 else (without(i, half - 1) + without(i, half)) / 2
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
        check_timing(interval, deadline)
        if not 0 <= rank < world_size:
            raise InvalidArgumentError(f"HealthMonitor: rank {rank} outside world of size {world_size}")
        # a NaN factor or skip limit compares false and turned the check off
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
        # every torch this runs on (2.1 on) has it; a store without it is read key by key
        self._multi_get = callable(getattr(store, "multi_get", None))
        self._seen: set[int] = set()  # ranks whose heartbeat key exists (never deleted)
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
        self._failure_id: tuple[int, int] | None = None  # the last failure diagnose() saw here
        self._flagged: set[int] = set()
        self.max_scaler_skips = max_scaler_skips
        self._scaler_skips = 0  # in a row

    # -- lifetime ------------------------------------------------------------------------------

    def start(self) -> HealthMonitor:
        """Beat now, then every `interval` on a thread. A stopped monitor can start again; a running
        one (or one whose thread outlived `stop()`) is refused: two threads would beat for it."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            state = (
                "still in a store call after stop(); call stop() again until it ends"
                if self._stop.is_set()
                else "running; stop() it first"
            )
            raise TorchHALError(
                f"HealthMonitor rank {self.rank}: start() while its heartbeat thread {thread.name} is {state}"
            )
        self._stop.clear()  # set by the last stop(): the new thread would end at once
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
        return self._read_beats(range(self.world_size))

    def diagnose(self, exc: BaseException) -> CollectiveError:
        """The clear error behind a failed collective: waits up to `deadline` for a dead peer's
        heartbeat to go stale, or for every live peer to report this failure too. Peers that never
        do while others did are hung; where none did, the error may be this rank's own."""
        with self._lock:
            steps = self._steps
            last = self._failure_id
            failure = (steps, last[1] + 1 if last is not None and last[0] == steps else 1)
            self._failure_id = failure
        self._publish_failure()
        give_up = time.time() + self.deadline + self.interval
        dead: dict[int, float] = {}
        silent: list[int] = []
        while True:
            now = time.time()
            try:
                beats = self._read_beats(self._others())
            except (RuntimeError, ValueError) as store_exc:
                return self._store_failure(store_exc, exc)
            dead = self._dead_in(beats, now)
            silent = [r for r, beat in beats.items() if r not in dead and not _reported(beat, failure)]
            if dead or not silent or now >= give_up:
                break
            time.sleep(self.interval / 2)
        alive = f"alive (heartbeats under {self.deadline:g} s old)"
        if dead:
            error = self._dead_error(dead, steps)
        elif silent and len(silent) < self.world_size - 1:
            reported = sorted(set(self._others()) - set(silent))
            error = CollectiveError(
                f"rank {self.rank} at step {steps}: a collective failed ({exc}), and rank(s) {reported} "
                f"reported it too; rank(s) {silent} are {alive} but did not reach the failure within "
                f"{self.deadline:g} s: they are hung"
            )
            telemetry.count("torchhal.health.hung_peer")
        elif silent:
            error = CollectiveError(
                f"rank {self.rank} at step {steps}: an error ({type(exc).__name__}: {exc}); rank(s) "
                f"{silent} are {alive} and none reported a failure within {self.deadline:g} s: the error "
                "may be local to this rank (a bug or fault here, not a collective's failure), or they "
                "are hung"
            )
            telemetry.count("torchhal.health.unreported_failure")
        elif self.world_size == 1:
            error = CollectiveError(
                f"rank 0 at step {steps}: an error in a world of one rank, so no peer's failure: {exc}"
            )
        else:
            error = CollectiveError(
                f"rank {self.rank} at step {steps}: a collective failed on every rank, and every rank is "
                f"alive: {exc}"
            )
        log.error("collective failure diagnosed", rank=self.rank, failure=list(failure), error=str(error))
        return error

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Run training inside: a failed collective comes out as `diagnose()`'s CollectiveError.
        An out-of-memory error passes through unchanged: it is this rank's own."""
        try:
            yield
        except torch.OutOfMemoryError:  # a RuntimeError, but no peer's doing
            raise
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
        """Record the first failure the thread finds: `check()` raises it, `on_failure` hears it once.
        A callback that raises is logged and counted; the thread beats on (the rank is alive)."""
        self._failure = error
        log.error("health monitor: peer failure", rank=self.rank, error=str(error))
        if self.on_failure is None:
            return
        try:
            self.on_failure(error)
        except Exception as exc:  # ending the thread here would make peers call this live rank dead
            telemetry.count("torchhal.health.on_failure_raised")
            log.error(
                "health monitor: the on_failure callback raised; the heartbeat goes on",
                rank=self.rank,
                callback=repr(self.on_failure),
                error=f"{type(exc).__name__}: {exc}",
            )

    def _beat(self) -> None:
        with self._lock:
            median = statistics.median(self._times) if self._times else None
            failure = None if self._failure_id is None else list(self._failure_id)
            beat = {"time": time.time(), "steps": self._steps, "median_s": median, "failure": failure}
        self.store.set(f"hb/{self.rank}", json.dumps(beat))

    # -- store reads ---------------------------------------------------------------------------

    def _read(self, rank: int) -> Heartbeat | None:
        """One rank's heartbeat, key by key (two store calls): for a store without `multi_get`."""
        key = f"hb/{rank}"
        if not self.store.check([key]):
            return None
        return Heartbeat.parse(self.store.get(key))

    def _read_beats(self, ranks: Iterable[int]) -> dict[int, Heartbeat | None]:
        """The heartbeats of `ranks` in one `multi_get` (which waits for a missing key, so only keys
        known to exist are read: a rank is checked until its first heartbeat, all of them in one
        call once every one has beaten)."""
        ranks = list(ranks)
        if not self._multi_get:
            return {r: self._read(r) for r in ranks}
        new = [r for r in ranks if r not in self._seen]
        if new:
            if self.store.check([f"hb/{r}" for r in new]):
                self._seen.update(new)
            elif len(new) > 1:
                self._seen.update(r for r in new if self.store.check([f"hb/{r}"]))
        present = [r for r in ranks if r in self._seen]
        beats: dict[int, Heartbeat | None] = dict.fromkeys(ranks)
        if present:
            raws = self.store.multi_get([f"hb/{r}" for r in present])
            beats.update((r, Heartbeat.parse(raw)) for r, raw in zip(present, raws, strict=True))
        return beats

    def _others(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def _dead_peers(self, now: float) -> dict[int, float]:
        return self._dead_in(self._read_beats(self._others()), now)

    def _dead_in(self, beats: Mapping[int, Heartbeat | None], now: float) -> dict[int, float]:
        """Peers whose heartbeat (before their first: this monitor's start) is older than the deadline."""
        dead = {}
        for r, beat in beats.items():
            age = beat.age(now) if beat is not None else now - self._started_at
            if age > self.deadline:
                dead[r] = age
        return dead

    def _publish_failure(self) -> None:
        """Beat now, with this failure's report (peers read it in the heartbeat)."""
        try:
            self._beat()
        except (RuntimeError, ValueError) as exc:
            log.warning(
                "could not publish the collective failure to the store", rank=self.rank, error=str(exc)
            )

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


def _reported(beat: Heartbeat | None, failure: tuple[int, int]) -> bool:
    """Whether `beat` reports `failure` or a later one (a peer that reached a later failure passed
    this one). An earlier report is an earlier failure's, however long it stays in the store."""
    return beat is not None and beat.failure is not None and beat.failure >= failure
