"""measure(): time callables on HAL devices with each device's own timer.

The timer is `device.timer()`: timing events on devices whose adapter offers them,
synchronize-then-perf-counter otherwise, simulated time on a simulated device. Around it:

* warm-up calls (untimed), then `repetitions` samples per variant, each the time of `inner`
  back-to-back calls divided by `inner`;
* an order across variants: "interleaved" (every round runs each variant once, the first
  variant rotating round to round, A B / B A / A B ...: slow drift of the machine falls on
  every variant alike), "random" (a seeded permutation per round) or "blocked" (all of A,
  then all of B: for showing what interleaving protects against). The order is recorded;
* rotation of inputs: call c of a variant uses its argument set c mod n (see `Inputs`);
* marks are read in batches of `flush_every` samples, so a device with timing events is not
  synchronised between samples (the host queues ahead, as `triton.testing.do_bench` lets it);
  after each batch one untimed call refills the queue before the next sample;
* optional cache clearing (`clear_cache=True`): before each sample, untimed, a write over twice
  the device's declared L2, as `triton.testing.do_bench` does before every call, so each sample
  starts from a cache holding none of its operands (and, like do_bench's, full of dirty lines);
* optional memory tracking: `used_bytes` from `device.memory_info()` after a sample's last
  call, while its result is still held, minus before the sample: the bytes the call left
  allocated (its output, caches it grew). It is not the transient peak inside the call, which
  `MemoryInfo` does not report. A device whose runtime does not give `used_bytes` (it is in
  `MemoryInfo.unknown`) is refused before anything runs: its 0 would read as "allocates nothing";
* outliers flagged with Tukey fences per variant, never dropped;
* the environment fingerprint in every result, and, given a `SampleStore`, every finished
  sample on disk as soon as its batch is read, so an interrupted run resumes where it stopped;
* a variant whose callable raises stops the measurement: the exception propagates with a note
  naming the variant and input set, after the samples finished before it are saved. So does a
  sample whose elapsed time is refused (0: the timer did not resolve it), after every other
  sample of its batch is saved;
* samples are resumed only for the same variant code (`Variant.key_data`), and resuming while
  the git tree is dirty or unknown is warned about and counted (`fingerprint.warn_resumed`).
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from torchhal.evaluation.fingerprint import code_digest, digest, environment_fingerprint, warn_resumed
from torchhal.evaluation.inputs import Inputs
from torchhal.evaluation.outliers import Fences, tukey_fences
from torchhal.hal_core import Device, DeviceTimer, InvalidArgumentError, UnsupportedError, telemetry

if TYPE_CHECKING:
    from torchhal.evaluation.store import SampleStore
    from torchhal.hal_core.hal import HardwareAbstractionLayer

log = telemetry.get_logger("torchhal.evaluation.harness")

ORDERS = ("interleaved", "random", "blocked")

VARIANT_NOTE = "in variant "
"""How the PEP 678 note `Variant.call` adds to an exception of the variant's code begins."""


def raised_in_variant(exc: BaseException) -> bool:
    """Whether `exc` came out of a variant's own code (it carries `Variant.call`'s note)."""
    return any(isinstance(n, str) and n.startswith(VARIANT_NOTE) for n in getattr(exc, "__notes__", ()))


Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Variant:
    """One thing to measure: `fn` called on `device` with `inputs`.

    `hal`: when given, calls run inside `hal.use(device)`, so `torchhal.ops` inside `fn`
    dispatch to `device` (needed for devices reached through `use`, such as a simulated ASIC).
    `items_per_call`: work items one call processes (rows, tokens, images), for throughput.
    `description`: what this variant is, for experiment keys and reports (default: `fn`'s name).
    """

    name: str
    fn: Callable[..., Any]
    device: Device
    inputs: Inputs = field(default_factory=Inputs.fixed)
    hal: HardwareAbstractionLayer | None = None
    items_per_call: float = 1.0
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise InvalidArgumentError(f"variant name must be a non-empty string, got {self.name!r}")
        if not callable(self.fn):
            raise InvalidArgumentError(f"variant {self.name!r}: fn must be callable, got {self.fn!r}")
        if not isinstance(self.device, Device):
            raise InvalidArgumentError(
                f"variant {self.name!r}: device must be a HAL Device (hal.device(...)), got {self.device!r}"
            )
        if not isinstance(self.inputs, Inputs):
            raise InvalidArgumentError(
                f"variant {self.name!r}: inputs must be an Inputs, got {type(self.inputs).__name__}"
            )
        items = self.items_per_call
        if (
            isinstance(items, bool)
            or not isinstance(items, (int, float))
            or not (math.isfinite(items) and items > 0)
        ):
            raise InvalidArgumentError(
                f"variant {self.name!r}: items_per_call must be a finite number > 0, got {items!r}"
            )
        if not self.description:
            module = getattr(self.fn, "__module__", None) or "?"
            qualname = getattr(self.fn, "__qualname__", None) or type(self.fn).__qualname__
            object.__setattr__(self, "description", f"{module}.{qualname}")

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Where this variant's calls run: inside `hal.use(device)` when a HAL was given."""
        if self.hal is None:
            yield
        else:
            with self.hal.use(self.device):
                yield

    def call(self, index: int) -> Any:
        """Call `fn` once with argument set `index` mod n (no timing; caller holds `active()`).

        An exception of `fn` goes on as it is, with a note (PEP 678) naming this variant and the
        input set: the measurement stops there, its finished samples kept (see `measure`)."""
        try:
            return self.fn(*self.inputs.for_call(index), **self.inputs.kwargs)
        except Exception as exc:
            note = f"{VARIANT_NOTE}{self.name!r} ({self.description}) on input set {index % len(self.inputs)}"
            # add_note() from Python 3.11; typeshed declares __notes__ from 3.11 on too
            exc.__notes__ = [*getattr(exc, "__notes__", ()), note]  # type: ignore[attr-defined]
            raise

    def key_data(self) -> dict[str, Any]:
        """What must match for samples of two runs to be pooled: its own code included, so an
        edited body is measured anew (see `fingerprint.code_digest` for what that misses)."""
        return {
            "name": self.name,
            "description": self.description,
            "code": code_digest(self.fn),
            "device": self.device.id,
            "items_per_call": self.items_per_call,
            "inputs": self.inputs.signature(),
        }


@dataclass(frozen=True, slots=True)
class Slot:
    """One sample's place in the schedule: its round, its position within the round, its variant."""

    round: int
    position: int
    variant: str


@dataclass(frozen=True, slots=True)
class Sample:
    variant: str
    round: int
    position: int
    latency_ms: float  # per call: the sample's elapsed time / calls
    calls: int
    memory_bytes: int | None
    session: str  # the process that measured it ("" without a store)

    def as_row(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "position": self.position,
            "latency_ms": self.latency_ms,
            "calls": self.calls,
            "memory_bytes": self.memory_bytes,
            "session": self.session,
        }

    @classmethod
    def from_row(cls, variant: str, row: dict[str, Any]) -> Sample:
        return cls(
            variant,
            int(row["round"]),
            int(row["position"]),
            float(row["latency_ms"]),
            int(row["calls"]),
            None if row["memory_bytes"] is None else int(row["memory_bytes"]),
            str(row["session"]),
        )


@dataclass(frozen=True)
class VariantResult:
    """One variant's samples in round order, with their outlier flags."""

    name: str
    description: str
    device: str
    simulated: bool
    timer: str
    items_per_call: float
    latency_ms: np.ndarray
    memory_bytes: np.ndarray | None
    rounds: np.ndarray
    sessions: tuple[str, ...]
    fences: Fences | None  # None with fewer than 4 samples

    @property
    def throughput(self) -> np.ndarray:
        """Items per second of every sample."""
        return self.items_per_call * 1e3 / self.latency_ms


@dataclass(frozen=True)
class Measurement:
    variants: dict[str, VariantResult]
    order: tuple[Slot, ...]  # the schedule, in the order it runs
    settings: dict[str, Any]
    fingerprint: dict[str, Any]
    experiment: str  # key of these samples in a SampleStore
    resumed: int  # samples loaded from the store instead of measured

    def samples(self, variant: str, metric: str) -> np.ndarray:
        """Per-sample values of `metric` ("latency", "throughput", "memory") for `variant`."""
        result = self.variants.get(variant)
        if result is None:
            raise InvalidArgumentError(f"unknown variant {variant!r}; measured: {sorted(self.variants)}")
        if metric == "latency":
            return result.latency_ms
        if metric == "throughput":
            return result.throughput
        if metric == "memory":
            if result.memory_bytes is None:
                raise InvalidArgumentError(
                    f"metric 'memory' of {variant!r}: not tracked (measure(..., track_memory=True))"
                )
            return result.memory_bytes
        raise InvalidArgumentError(
            f"unknown timing metric {metric!r}; the harness measures 'latency', 'throughput', 'memory'"
        )


def schedule(names: Sequence[str], repetitions: int, order: str, seed: int) -> tuple[Slot, ...]:
    """The samples to take, in the order they run."""
    if order not in ORDERS:
        raise InvalidArgumentError(f"order must be one of {ORDERS}, got {order!r}")
    k = len(names)
    if order == "blocked":
        return tuple(Slot(r, i, name) for i, name in enumerate(names) for r in range(repetitions))
    slots = []
    for r in range(repetitions):
        if order == "interleaved":
            names_r = [names[(r + i) % k] for i in range(k)]
        else:
            names_r = list(names)
            random.Random(f"{seed}:{r}").shuffle(names_r)
        slots += [Slot(r, i, name) for i, name in enumerate(names_r)]
    return tuple(slots)


def measure(
    variants: Variant | Sequence[Variant],
    *,
    warmup: int = 5,
    repetitions: int = 30,
    inner: int = 1,
    order: str = "interleaved",
    seed: int = 0,
    track_memory: bool = False,
    flush_every: int = 8,
    clear_cache: bool = False,
    store: SampleStore | None = None,
    progress: Progress | None = None,
) -> Measurement:
    """Time every variant `repetitions` times in `order`; see the module docstring."""
    group = [variants] if isinstance(variants, Variant) else list(variants)
    check_group(group)
    for name, value, minimum in (
        ("warmup", warmup, 0),
        ("repetitions", repetitions, 1),
        ("inner", inner, 1),
        ("flush_every", flush_every, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise InvalidArgumentError(f"measure: {name} must be an integer >= {minimum}, got {value!r}")
    settings = {
        "warmup": warmup,
        "repetitions": repetitions,
        "inner": inner,
        "order": order,
        "seed": seed,
        "track_memory": track_memory,
        "flush_every": flush_every,
        "clear_cache": clear_cache,
    }
    if track_memory:
        for v in group:
            _used_bytes(v.device)
    slots = schedule([v.name for v in group], repetitions, order, seed)
    fingerprint = environment_fingerprint(v.device for v in group)
    experiment = digest(
        {
            "kind": "timing",
            "variants": [v.key_data() for v in group],
            "settings": settings,
            "environment": fingerprint["digest"],
        }
    )
    done: dict[tuple[str, int], Sample] = {}
    if store is not None:
        store.register(experiment, {"variants": [v.key_data() for v in group], "settings": settings})
        for (variant, key), row in store.load(experiment).items():
            if key.startswith("round:"):
                done[(variant, int(key.removeprefix("round:")))] = Sample.from_row(variant, row)
    resumed = len(done)
    if resumed:
        log.info("resuming measurement", experiment=experiment, finished=resumed, total=len(slots))
        warn_resumed(fingerprint, experiment, resumed)
    todo = [s for s in slots if (s.variant, s.round) not in done]
    with telemetry.span(
        "torchhal.evaluation.measure",
        variants=[v.name for v in group],
        repetitions=repetitions,
        order=order,
        resumed=resumed,
    ):
        if todo:
            clearers = {v.name: _cache_clearer(v.device) if clear_cache else None for v in group}
            _Runner(group, inner, track_memory, flush_every, clearers, store, experiment, progress).run(
                todo, warmup, done, len(slots)
            )
    by_variant = {v.name: [done[(v.name, s.round)] for s in slots if s.variant == v.name] for v in group}
    results = {v.name: _result(v, by_variant[v.name], track_memory) for v in group}
    return Measurement(results, slots, settings, fingerprint, experiment, resumed)


def _cache_clearer(device: Device) -> Callable[[], object] | None:
    """A call that overwrites twice the device's declared L2; None (logged) where none is declared."""
    l2 = device.capabilities.l2_cache_bytes
    if l2 is None:
        log.info("device declares no L2 size: clear_cache does nothing there", device=device.id)
        return None
    import torch

    # bytes: storage every adapter takes, where fp32 is a format a device may not declare (an
    # int8-only ASIC refused the buffer, and with it every measurement asking to clear the cache)
    buffer = device.empty((2 * l2,), torch.uint8)
    return buffer.zero_


class _Runner:
    """Takes the samples still to do, reading marks in batches and saving each batch."""

    def __init__(
        self,
        group: list[Variant],
        inner: int,
        track_memory: bool,
        flush_every: int,
        clearers: dict[str, Callable[[], object] | None],
        store: SampleStore | None,
        experiment: str,
        progress: Progress | None,
    ) -> None:
        self.by_name = {v.name: v for v in group}
        self.timers: dict[str, DeviceTimer] = {v.name: v.device.timer() for v in group}
        self.inner, self.track_memory, self.flush_every = inner, track_memory, flush_every
        self.clearers = clearers
        self.store, self.experiment, self.progress = store, experiment, progress
        self.pending: list[tuple[Slot, object, object, int | None]] = []

    def run(self, todo: list[Slot], warmup: int, done: dict[tuple[str, int], Sample], total: int) -> None:
        for w in range(warmup):
            for variant in self.by_name.values():
                with variant.active():
                    variant.call(w)
        try:
            for i, slot in enumerate(todo):
                self.pending.append(self._take(slot))
                if len(self.pending) >= self.flush_every or i == len(todo) - 1:
                    refused = self._flush(done, total)
                    if refused is not None:
                        raise InvalidArgumentError(refused)
                    if i < len(todo) - 1:
                        nxt = self.by_name[todo[i + 1].variant]
                        with nxt.active():
                            nxt.call(0)  # untimed: refill the device queue after the read
        except BaseException:
            pending = len(self.pending)
            if pending:
                try:
                    refused = self._flush(done, total)
                    if refused is not None:  # the failure above goes on; this sample is not saved
                        log.warning("a sample pending at the failure was refused", reason=refused)
                except Exception as exc:  # the device may be unusable after the failure
                    log.warning(
                        "could not save the samples pending at the failure", error=repr(exc), samples=pending
                    )
                    telemetry.count("torchhal.evaluation.samples_lost", value=pending)
            raise

    def _take(self, slot: Slot) -> tuple[Slot, object, object, int | None]:
        variant = self.by_name[slot.variant]
        timer = self.timers[slot.variant]
        before = _used_bytes(variant.device) if self.track_memory else 0
        first_call = slot.round * self.inner
        clear = self.clearers.get(slot.variant)
        with variant.active():
            if clear is not None:
                clear()
            start = timer.mark()
            for j in range(self.inner):
                out = variant.call(first_call + j)
            end = timer.mark()
        memory = _used_bytes(variant.device) - before if self.track_memory else None
        del out
        return slot, start, end, memory

    def _flush(self, done: dict[tuple[str, int], Sample], total: int) -> str | None:
        """Read the pending marks and save every valid sample; the first refusal of an elapsed
        time is returned, for the caller to raise once the others are saved (raised at once,
        it lost the good samples read before it). The pending list is cleared only once saved:
        after a failed write, the caller's handler tries once more, and counts a loss."""
        session = self.store.session if self.store is not None else ""
        batch, refused = [], None
        for slot, start, end, memory in self.pending:
            elapsed = self.timers[slot.variant].elapsed_ms(start, end)
            why = _elapsed_refusal(self.by_name[slot.variant], elapsed, self.inner)
            if why is not None:
                refused = refused or why
                continue
            batch.append(
                Sample(
                    slot.variant, slot.round, slot.position, elapsed / self.inner, self.inner, memory, session
                )
            )
        if self.store is not None:
            self.store.put_many(self.experiment, [(s.variant, f"round:{s.round}", s.as_row()) for s in batch])
        self.pending = []
        for s in batch:
            done[(s.variant, s.round)] = s
        if self.progress is not None:
            self.progress(len(done), total)
        return refused


def _used_bytes(device: Device) -> int:
    """The device's `used_bytes`; refused where its runtime does not give it, since a 0 standing
    for "unknown" would be tracked as a variant that allocates nothing."""
    used = device.memory_info().known("used")
    if used is None:
        raise UnsupportedError(
            f"track_memory needs used_bytes, which {device.id}'s adapter reports as unknown "
            "(MemoryInfo.unknown names 'used'); measure without tracking memory there"
        )
    return used


def _elapsed_refusal(variant: Variant, elapsed: float, inner: int) -> str | None:
    """Why a sample's elapsed time cannot be used (None when it can)."""
    if math.isfinite(elapsed) and elapsed > 0:
        return None
    if variant.device.simulated:
        why = (
            "the simulated clock did not advance: the callable ran no simulated op (ops run on a "
            "simulated device only inside hal.use(device): give the Variant its hal)"
        )
    else:
        why = "below the timer's resolution; raise `inner` to time more calls per sample"
    return (
        f"variant {variant.name!r} on {variant.device.id}: the timer measured {elapsed!r} ms over "
        f"{inner} call(s): {why}"
    )


def check_group(group: list[Variant]) -> None:
    """At least one Variant, each a Variant, their names distinct (results are kept by name)."""
    if not group:
        raise InvalidArgumentError("measure needs at least one Variant, got none")
    bad = [type(v).__name__ for v in group if not isinstance(v, Variant)]
    if bad:
        raise InvalidArgumentError(f"measure takes Variant objects, got {bad[0]}")
    names = [v.name for v in group]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise InvalidArgumentError(f"variant names must be distinct; repeated: {repeated}")


def _result(variant: Variant, samples: list[Sample], track_memory: bool) -> VariantResult:
    latency = np.array([s.latency_ms for s in samples], dtype=np.float64)
    memory = None
    if track_memory:
        memory = np.array([s.memory_bytes for s in samples], dtype=np.float64)
    return VariantResult(
        name=variant.name,
        description=variant.description,
        device=variant.device.id,
        simulated=variant.device.simulated,
        timer=type(variant.device.timer()).__name__,
        items_per_call=float(variant.items_per_call),
        latency_ms=latency,
        memory_bytes=memory,
        rounds=np.array([s.round for s in samples], dtype=np.int64),
        sessions=tuple(s.session for s in samples),
        fences=tukey_fences(latency) if latency.size >= 4 else None,
    )
