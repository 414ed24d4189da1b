"""HealthMonitor in one process: two monitors (ranks 0 and 1) share a store, as two processes would.

Dead peer (heartbeats stop), hung peer (alive but never reaches the failure), NaN/inf, and
stragglers. The multi-process hang test is in test_health_multiprocess.py; the killed rank in
test_resume.py.
"""

from __future__ import annotations

import io
import math
import random
import threading
import time

import pytest
import torch.distributed as dist

from torchhal.distributed.health import HealthMonitor, NonFiniteError, stragglers
from torchhal.distributed.loop import StepStats
from torchhal.hal_core import CollectiveError, InvalidArgumentError, telemetry

INTERVAL, DEADLINE = 0.05, 0.4


def monitors(tmp_path, **kw) -> list[HealthMonitor]:
    store = dist.FileStore(str(tmp_path / "store"), 2)
    return [
        HealthMonitor(store, rank=r, world_size=2, interval=INTERVAL, deadline=DEADLINE, **kw) for r in (0, 1)
    ]


def stats(step: int, *, loss: float = 1.0, grad_norm: float | None = 0.5, seconds: float = 0.01) -> StepStats:
    return StepStats(step, loss, seconds, 64, 64 / seconds, grad_norm)


def test_dead_peer_is_named_with_its_heartbeat_age(tmp_path):
    seen: list[CollectiveError] = []
    zero, one = monitors(tmp_path)
    zero.on_failure = seen.append
    with zero, one:
        zero.observe(stats(0))
        time.sleep(3 * INTERVAL)
        zero.check()  # both alive
        assert set(zero.peers()) == {0, 1} and zero.peers()[1].age(time.time()) < DEADLINE
        one.stop()
        stopped = time.time()
        while not seen and time.time() - stopped < 10 * DEADLINE:
            time.sleep(INTERVAL)
        with pytest.raises(
            CollectiveError, match=r"rank 0 at step 1: peer\(s\) dead.*rank 1: last heartbeat"
        ):
            zero.check()
    assert seen and time.time() - stopped < DEADLINE + 4 * INTERVAL + 1.0
    age = float(str(seen[0]).split("last heartbeat ")[1].split(" s")[0])
    assert DEADLINE <= age < DEADLINE + 1.0  # printed to 0.1 s


def test_diagnose_names_a_dead_peer(tmp_path):
    zero, one = monitors(tmp_path)
    with zero:
        one.start()
        one.stop()  # one heartbeat, then nothing: a killed process
        error = zero.diagnose(RuntimeError("Connection closed by peer"))
    assert "peer(s) dead" in str(error) and "rank 1" in str(error)


def test_diagnose_names_a_hung_peer(tmp_path):
    zero, one = monitors(tmp_path)
    with zero, one:  # rank 1 keeps beating but never reaches the failed collective
        start = time.time()
        error = zero.diagnose(RuntimeError("Timed out waiting 3000ms"))
        took = time.time() - start
    assert "rank(s) [1] are alive" in str(error) and "hung" in str(error), error
    assert DEADLINE <= took < DEADLINE + 1.0


def test_diagnose_when_every_rank_saw_the_failure(tmp_path):
    zero, one = monitors(tmp_path)
    with zero, one:
        other = threading.Thread(target=one.diagnose, args=(RuntimeError("bad"),))
        other.start()
        error = zero.diagnose(RuntimeError("bad"))
        other.join()
    assert "failed on every rank" in str(error)


def test_guard_turns_collective_failures_into_diagnosed_errors(tmp_path):
    zero, one = monitors(tmp_path)
    with zero:
        one.start()
        one.stop()
        with pytest.raises(CollectiveError, match="peer\\(s\\) dead") as info, zero.guard():
            raise RuntimeError("[gloo] Connection closed by peer")
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(NonFiniteError), zero.guard():  # not a collective failure: passes through
        zero.observe(stats(4, loss=math.nan))


@pytest.mark.parametrize(
    ("loss", "grad_norm", "what"), [(math.nan, 0.5, "loss nan"), (1.0, math.inf, "norm inf")]
)
def test_non_finite_values_name_the_step(tmp_path, loss, grad_norm, what):
    zero, _ = monitors(tmp_path)
    step = random.randrange(1, 1000)
    before = telemetry.counts().get("torchhal.health.non_finite", 0)
    with pytest.raises(NonFiniteError, match=f"step {step} on rank 0: .*{what}"):
        zero.observe(stats(step, loss=loss, grad_norm=grad_norm))
    assert telemetry.counts()["torchhal.health.non_finite"] == before + 1


def skipped_step(step: int, *, loss: float, grad_norm: float | None) -> StepStats:
    """A step record as `train` writes it when the fp16 gradient scaler skipped the optimizer step."""
    return StepStats(step, loss, 0.01, 64, 6400.0, grad_norm, scale=2.0**15, scaler_skipped=True)


def test_skips_in_a_row_up_to_the_limit_raise_and_a_good_step_resets_the_run(tmp_path):
    """Gradients that stay non-finite however far the scale falls are a diverged run, not noise."""
    limit = random.randint(3, 6)
    zero, _ = monitors(tmp_path, max_scaler_skips=limit)
    for step in range(limit - 1):
        zero.observe(skipped_step(step, loss=1.0, grad_norm=math.inf))
    zero.observe(stats(limit - 1))  # a step that went through: the run starts over
    for step in range(limit, 2 * limit - 1):
        zero.observe(skipped_step(step, loss=1.0, grad_norm=math.inf))
    with pytest.raises(
        NonFiniteError, match=rf"step {2 * limit - 1} on rank 0: .* skipped {limit} steps in a row"
    ):
        zero.observe(skipped_step(2 * limit - 1, loss=1.0, grad_norm=math.inf))
    with pytest.raises(InvalidArgumentError, match="max_scaler_skips must be >= 1, got 0"):
        monitors(tmp_path, max_scaler_skips=0)


@pytest.mark.parametrize("grad_norm", [math.nan, math.inf])
def test_a_step_the_scaler_skipped_is_counted_and_logged_not_raised(tmp_path, grad_norm):
    telemetry.configure(log_level="info", log_stream=(stream := io.StringIO()))
    zero, _ = monitors(tmp_path)
    step = random.randrange(1, 1000)
    skips, faults = "torchhal.health.scaler_skipped", "torchhal.health.non_finite"
    before = telemetry.counts()
    zero.observe(skipped_step(step, loss=random.uniform(0.5, 5.0), grad_norm=grad_norm))
    after = telemetry.counts()
    assert after.get(skips, 0) == before.get(skips, 0) + 1
    assert after.get(faults, 0) == before.get(faults, 0)
    (line,) = [x for x in stream.getvalue().splitlines() if "scaler skipped" in x]
    assert f"step={step}" in line and f"grad_norm={grad_norm}" in line and "rank=0" in line
    assert zero._steps == step + 1  # a skipped step is still a step done (the heartbeat reports it)


def test_the_same_non_finite_norm_without_a_scaler_skip_raises(tmp_path):
    zero, _ = monitors(tmp_path)
    step = random.randrange(1, 1000)
    before = telemetry.counts().get("torchhal.health.scaler_skipped", 0)
    not_skipped = StepStats(step, 1.5, 0.01, 64, 6400.0, math.nan, scale=2.0**15, scaler_skipped=False)
    with pytest.raises(NonFiniteError, match=f"step {step} on rank 0: gradient norm nan"):
        zero.observe(not_skipped)
    with pytest.raises(NonFiniteError, match=f"step {step + 1} on rank 0: gradient norm nan"):
        zero.observe(stats(step + 1, grad_norm=math.nan))  # no scaler at all
    assert telemetry.counts().get("torchhal.health.scaler_skipped", 0) == before


@pytest.mark.parametrize("loss", [math.nan, math.inf])
def test_a_non_finite_loss_raises_even_when_the_scaler_skipped(tmp_path, loss):
    zero, _ = monitors(tmp_path)
    step = random.randrange(1, 1000)
    with pytest.raises(NonFiniteError, match=f"step {step} on rank 0: loss {loss}"):
        zero.observe(skipped_step(step, loss=loss, grad_norm=math.nan))


def test_stragglers_function():
    base = random.uniform(0.01, 1.0)
    medians = {0: base, 1: base * 1.1, 2: base * 0.9, 3: base * 2.5}
    slow = stragglers(medians, factor=2.0)
    assert list(slow) == [3] and slow[3] == pytest.approx(2.5 / 1.0, rel=0.15)
    assert stragglers(medians, factor=3.0) == {}
    assert stragglers({0: base}, factor=2.0) == {}


def test_straggler_is_warned_counted_and_traced(tmp_path):
    telemetry.configure(exporter="memory", log_level="warning", log_stream=(stream := io.StringIO()))
    zero, one = monitors(tmp_path)
    before = telemetry.counts().get("torchhal.health.straggler,rank=1", 0)
    with zero, one:
        for step in range(5):
            one.observe(stats(step, seconds=0.3))
        for step in range(4):
            zero.observe(stats(step, seconds=0.05))
        time.sleep(3 * INTERVAL)  # both heartbeats carry their medians
        zero.observe(stats(4, seconds=0.05))
        zero.observe(stats(5, seconds=0.05))  # reported once, not per step
    assert telemetry.counts()["torchhal.health.straggler,rank=1"] == before + 1
    assert "straggler" in stream.getvalue()
    (span,) = [
        s for s in telemetry.memory_exporter().get_finished_spans() if s.name == "torchhal.health.straggler"
    ]
    (event,) = span.events
    assert event.name == "straggler" and event.attributes["rank"] == 1
    assert event.attributes["ratio"] == pytest.approx(6.0)


def test_bad_arguments(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    with pytest.raises(InvalidArgumentError, match="interval < deadline, got interval 2, deadline 1"):
        HealthMonitor(store, rank=0, world_size=1, interval=2, deadline=1)
    with pytest.raises(InvalidArgumentError, match="rank 3 outside world of size 2"):
        HealthMonitor(store, rank=3, world_size=2)
    with pytest.raises(InvalidArgumentError, match="straggler_factor must be > 1, got 1"):
        HealthMonitor(store, rank=0, world_size=1, straggler_factor=1)


class BlockingStore(dist.Store):
    """A store whose `set` waits for `release` once `block` is set: a slow or unreachable store."""

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, bytes] = {}
        self.block, self.release = False, threading.Event()

    def set(self, key, value) -> None:
        if self.block:
            self.release.wait()
        self.data[key] = value if isinstance(value, bytes) else value.encode()

    def get(self, key) -> bytes:
        return self.data[key]

    def check(self, keys) -> bool:
        return all(k in self.data for k in keys)


def test_a_thread_still_in_a_store_call_after_stop_is_said_and_waited_for_again():
    """stop() joined the thread for four intervals and then forgot it, silently, while it sat in a
    store call."""
    store = BlockingStore()
    monitor = HealthMonitor(store, rank=0, world_size=1, interval=INTERVAL, deadline=DEADLINE).start()
    store.block = True
    time.sleep(3 * INTERVAL)  # the thread's next beat now waits in the store
    telemetry.configure(log_level="warning", log_stream=(stream := io.StringIO()))
    before = telemetry.counts().get("torchhal.health.thread_outlived_stop", 0)
    monitor.stop()
    assert telemetry.counts().get("torchhal.health.thread_outlived_stop", 0) == before + 1
    assert "still in a store call after stop()" in stream.getvalue()
    assert monitor._thread is not None and monitor._thread.is_alive()
    store.release.set()
    monitor.stop()  # waits for it again: the store call returns, the thread ends
    assert telemetry.counts().get("torchhal.health.thread_outlived_stop", 0) == before + 1
    assert monitor._thread is None
