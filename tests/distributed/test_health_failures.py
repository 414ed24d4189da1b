"""HealthMonitor after a failure, in one process (monitors of several ranks share a store, as
processes would): failure reports that name their failure, an on_failure callback that raises,
a monitor started again after stop() (or twice), guard() on an error of this rank's own, and
heartbeats read in one store call for every rank."""

from __future__ import annotations

import io
import json
import random
import statistics
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchhal.distributed.health import HealthMonitor, stragglers
from torchhal.distributed.loop import StepStats
from torchhal.hal_core import CollectiveError, TorchHALError, telemetry

INTERVAL, DEADLINE = 0.05, 0.4


def monitors(tmp_path, world: int, **kw) -> list[HealthMonitor]:
    store = dist.FileStore(str(tmp_path / "store"), world)
    return [
        HealthMonitor(store, rank=r, world_size=world, interval=INTERVAL, deadline=DEADLINE, **kw)
        for r in range(world)
    ]


def stats(step: int) -> StepStats:
    return StepStats(step, 1.0, 0.01, 64, 6400.0, 0.5)


def diagnose_together(failing: list[HealthMonitor], message: str) -> list[str]:
    """Every monitor in `failing` diagnoses the same failure at once, as its rank would."""
    found: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda m=m: found.__setitem__(m.rank, str(m.diagnose(RuntimeError(message)))))
        for m in failing
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [found[m.rank] for m in failing]


# -- a failure report names its failure ------------------------------------------------------------


def test_an_earlier_failures_report_does_not_vouch_for_a_peer_in_the_next(tmp_path):
    """failed/<rank> keys were never cleared and their step never compared: after one failure
    every rank survived, a later hang of rank 2 read as 'failed on every rank'."""
    zero, one, two = monitors(tmp_path, 3)
    with zero, one, two:
        first = diagnose_together([zero, one, two], "first")
        assert all("failed on every rank" in text for text in first), first
        for m in (zero, one, two):
            for step in range(3):
                m.observe(stats(step))
        # rank 2 hangs: alive, but never reaches the second failure its peers saw
        second = diagnose_together([zero, one], "Timed out waiting 3000ms")
        beats = zero.peers()
    for text in second:
        assert "failed on every rank" not in text, text
        assert "rank(s) [2] are alive" in text and "they are hung" in text, text
    assert "rank(s) [1] reported it too" in second[0] and "rank(s) [0] reported it too" in second[1]
    # each report is (steps done, its ordinal at that count): rank 2's is the first failure's
    assert [beats[r].failure for r in range(3)] == [(3, 1), (3, 1), (0, 1)]


def test_a_second_failure_at_the_same_step_is_told_from_the_first(tmp_path):
    zero, one = monitors(tmp_path, 2)
    with zero, one:
        diagnose_together([zero, one], "first")
        alone = str(zero.diagnose(RuntimeError("again")))  # same step: ordinal 2, rank 1 still at 1
        assert "failed on every rank" not in alone and "rank(s) [1] are alive" in alone, alone
        late = str(one.diagnose(RuntimeError("again")))  # rank 1 catches up with the second failure
        assert "failed on every rank" in late, late
        assert zero.peers()[1].failure == zero.peers()[0].failure == (0, 2)


# -- on_failure that raises ------------------------------------------------------------------------


def test_an_on_failure_callback_that_raises_is_logged_and_the_rank_beats_on(tmp_path):
    telemetry.configure(log_level="error", log_stream=(stream := io.StringIO()))
    token = f"hook failed {random.randrange(10**6)}"

    heard: list[CollectiveError] = []

    def abort(error: CollectiveError) -> None:
        heard.append(error)
        raise RuntimeError(token)

    zero, one, two = monitors(tmp_path, 3)
    zero.on_failure = abort
    key = "torchhal.health.on_failure_raised"
    before = telemetry.counts().get(key, 0)
    with zero, one:
        two.start()
        two.stop()  # rank 2 dies
        waited = time.time()
        while not heard and time.time() - waited < 10 * DEADLINE:
            time.sleep(INTERVAL)
        assert heard, "rank 0's monitor never found rank 2 dead"
        time.sleep(2 * DEADLINE)  # long enough for rank 0 to look dead, had its thread ended
        assert zero.peers()[0].age(time.time()) < DEADLINE
        verdict = str(one.diagnose(RuntimeError("Connection closed by peer")))
    assert "peer(s) dead" in verdict and "rank 2: last heartbeat" in verdict, verdict
    assert "rank 0: last heartbeat" not in verdict, verdict
    assert telemetry.counts().get(key, 0) == before + 1
    (line,) = [x for x in stream.getvalue().splitlines() if "on_failure callback raised" in x]
    assert token in line and "rank=0" in line
    with pytest.raises(CollectiveError, match=r"rank 2: last heartbeat"):
        zero.check()  # the failure itself is still recorded


# -- start after stop, start twice -----------------------------------------------------------------


def test_a_stopped_monitor_started_again_beats_again(tmp_path):
    """stop() set the stop event and start() never cleared it: the second thread ended at once."""
    zero, one = monitors(tmp_path, 2)
    with zero:
        with one:
            time.sleep(2 * INTERVAL)
        with one:  # a second phase of training, the same monitor
            time.sleep(2 * DEADLINE)
            age = zero.peers()[1].age(time.time())
            zero.check()
    assert age < DEADLINE, f"rank 1's heartbeat is {age:.2f} s old after its second start()"


def test_starting_a_running_monitor_is_refused_naming_its_thread(tmp_path):
    (zero,) = monitors(tmp_path, 1)
    zero.start()
    try:
        with pytest.raises(
            TorchHALError, match=r"rank 0: start\(\) while its heartbeat thread torchhal-health-0 is running"
        ):
            zero.start()
        alive = [t for t in threading.enumerate() if t.name == "torchhal-health-0"]
        assert len(alive) == 1
    finally:
        zero.stop()
    assert not [t for t in threading.enumerate() if t.name == "torchhal-health-0"]


# -- guard on an error of this rank's own ----------------------------------------------------------


def test_guard_says_an_error_no_peer_reported_may_be_local(tmp_path):
    """A shape bug on rank 0 came out, after the deadline, as 'rank 1 is hung'."""
    zero, one = monitors(tmp_path, 2)
    with zero, one, pytest.raises(CollectiveError) as info, zero.guard():
        nn.Linear(4, 3)(torch.randn(2, 5))
    text = str(info.value)
    assert "may be local to this rank" in text and "rank(s) [1] are alive" in text, text
    assert "mat1 and mat2 shapes cannot be multiplied (2x5 and 4x3)" in text
    assert isinstance(info.value.__cause__, RuntimeError)


def test_guard_passes_an_out_of_memory_error_through_at_once(tmp_path):
    zero, one = monitors(tmp_path, 2)
    oom = torch.OutOfMemoryError(f"Tried to allocate {random.randint(1, 80)}.00 GiB")
    with zero, one:
        began = time.monotonic()
        with pytest.raises(torch.OutOfMemoryError) as info, zero.guard():
            raise oom
        took = time.monotonic() - began
    assert info.value is oom and took < DEADLINE / 2
    assert zero.peers()[0].failure is None  # no failure was reported to the peers


# -- one store call for every rank's heartbeat -----------------------------------------------------


class CountingStore(dist.Store):
    """A store that counts the calls it serves, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, bytes] = {}
        self.calls: list[tuple[str, int]] = []  # (method, keys)

    def set(self, key, value) -> None:
        self.calls.append(("set", 1))
        self.data[key] = value if isinstance(value, bytes) else value.encode()

    def get(self, key) -> bytes:
        self.calls.append(("get", 1))
        return self.data[key]

    def check(self, keys) -> bool:
        self.calls.append(("check", len(keys)))
        return all(k in self.data for k in keys)

    def multi_get(self, keys) -> list[bytes]:
        self.calls.append(("multi_get", len(keys)))
        return [self.data[k] for k in keys]


class StoreWithoutMultiGet(CountingStore):
    """What a store of a torch without `multi_get` offers."""

    multi_get = None  # type: ignore[assignment]


def publish(store: dist.Store, world: int) -> dict[int, float]:
    """Heartbeats of `world` ranks as their monitors write them; each rank's median step time."""
    medians = {r: random.uniform(0.05, 0.1) for r in range(world)}
    prefixed = dist.PrefixStore("torchhal_health/", store)
    for r, median in medians.items():
        beat = {"time": time.time(), "steps": 7, "median_s": median, "failure": None}
        prefixed.set(f"hb/{r}", json.dumps(beat))
    return medians


def test_rank_zeros_straggler_check_reads_every_heartbeat_in_one_call():
    """It read each rank's key with check then get: 2 x world store calls every step."""
    world = random.randint(40, 80)
    store = CountingStore()
    medians = publish(store, world)
    zero = HealthMonitor(store, rank=0, world_size=world, interval=5, deadline=10)
    zero.observe(stats(0))  # the first read also checks that every key exists, in one call
    store.calls.clear()
    for step in range(1, 4):
        zero.observe(stats(step))
    assert store.calls == [("multi_get", world)] * 3
    beats = zero.peers()
    assert {r: b.median_s for r, b in beats.items()} == medians
    assert {b.steps for b in beats.values()} == {7}


def test_a_store_without_multi_get_is_read_key_by_key_to_the_same_heartbeats():
    world = random.randint(3, 8)
    plain, old = CountingStore(), StoreWithoutMultiGet()
    medians = publish(plain, world)
    old.data = dict(plain.data)
    read = HealthMonitor(plain, rank=0, world_size=world, interval=5, deadline=10).peers()
    old.calls.clear()
    fallback = HealthMonitor(old, rank=0, world_size=world, interval=5, deadline=10).peers()
    assert fallback == read and {r: b.median_s for r, b in read.items()} == medians
    assert sorted(old.calls) == sorted([("check", 1), ("get", 1)] * world)


def test_a_rank_that_has_not_beaten_yet_is_read_as_none_without_waiting(tmp_path):
    """multi_get waits for a missing key (up to the store's timeout): only keys known to exist go in."""
    zero, one, two = monitors(tmp_path, 3)
    with zero, one:
        began = time.monotonic()
        beats = zero.peers()
        took = time.monotonic() - began
        assert beats[2] is None and beats[0] is not None and beats[1] is not None
        assert took < DEADLINE
        with two:
            assert zero.peers()[2] is not None


def test_stragglers_match_the_median_of_the_others_rank_by_rank():
    """stragglers() reads the median of the other ranks off one sorted list (n log n, not n^2)."""
    for _ in range(300):
        n = random.randint(2, 12)
        pool = [random.uniform(0.01, 1.0) for _ in range(3)]
        medians = {
            r: random.choice(pool) if random.random() < 0.5 else random.uniform(0.01, 3.0) for r in range(n)
        }
        factor = random.choice([1.2, 2.0, 3.0])
        expected = {}
        for r, mine in medians.items():
            typical = statistics.median([m for q, m in medians.items() if q != r])
            if mine > factor * typical:
                expected[r] = mine / typical
        assert stragglers(medians, factor) == expected
