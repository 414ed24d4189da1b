"""A refused reading, or a failed write to the store, no longer loses the good samples of its batch:
they are saved before the error goes on, and a rerun resumes them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pytest
import torch

import torchhal
from tests.evaluation.helpers import sim_hal
from torchhal.evaluation.harness import Variant, measure
from torchhal.evaluation.inputs import Inputs
from torchhal.evaluation.store import SampleStore
from torchhal.hal_core import telemetry
from torchhal.hal_core.errors import InvalidArgumentError

REPETITIONS, FLUSH_EVERY = 10, 8


class Flaky:
    """A matmul on the simulated device, except that call `idle_at` (1-based) runs no simulated op,
    so its elapsed time is 0 and the harness refuses it."""

    def __init__(self, idle_at: int | None) -> None:
        self.idle_at, self.calls = idle_at, 0

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.idle_at:
            return torch.empty(0)
        return torchhal.ops.matmul(a, b)


def _variant(fn: Flaky, seed: int) -> Variant:
    hal = sim_hal("edge")
    sim = hal.device("simasic:0")
    generator = torch.Generator().manual_seed(seed)
    sets = [
        (torch.randn(32, 64, generator=generator), torch.randn(64, 32, generator=generator)) for _ in range(2)
    ]
    return Variant("v", fn, sim, Inputs([tuple(sim.to_device(t) for t in s) for s in sets]), hal=hal)


def _rows(store: SampleStore) -> int:
    return int(store._db.execute("SELECT COUNT(*) FROM samples").fetchone()[0])


@pytest.mark.parametrize("idle_at", [1, 4, 7, 8])
def test_the_good_samples_of_a_batch_with_a_refused_one_are_saved(tmp_path, idle_at: int) -> None:
    """warmup 0, one variant: calls 1..8 are rounds 0..7, read as one batch. The batch held 7 good
    samples and one refused; none were saved (the store stayed empty)."""
    path = tmp_path / "samples.sqlite"
    with SampleStore(path) as store:
        with pytest.raises(InvalidArgumentError, match="the simulated clock did not advance"):
            measure(
                _variant(Flaky(idle_at), idle_at),
                warmup=0,
                repetitions=REPETITIONS,
                flush_every=FLUSH_EVERY,
                store=store,
            )
        assert _rows(store) == FLUSH_EVERY - 1
    with SampleStore(path) as store:  # the same code, running fine now: only the missing rounds run
        fixed = Flaky(None)
        m = measure(
            _variant(fixed, idle_at), warmup=0, repetitions=REPETITIONS, flush_every=FLUSH_EVERY, store=store
        )
    assert m.resumed == FLUSH_EVERY - 1
    assert fixed.calls == REPETITIONS - m.resumed  # one batch, read last: no refill call
    assert sorted(m.variants["v"].rounds) == list(range(REPETITIONS))
    assert (m.variants["v"].latency_ms > 0).all()


class FailingStore(SampleStore):
    """A store whose first `failures` writes raise, as a full disk or a locked file would."""

    def __init__(self, path: Any, failures: int) -> None:
        super().__init__(path)
        self.failures = failures

    def put_many(self, experiment: str, rows: Iterable[tuple[str, str, Mapping[str, Any]]]) -> None:
        if self.failures:
            self.failures -= 1
            raise OSError("planted write failure")
        super().put_many(experiment, rows)


def test_a_failed_write_is_tried_again_and_a_lost_batch_is_counted(tmp_path) -> None:
    """The batch was dropped before its write: a failed write lost it silently, uncounted."""
    with FailingStore(tmp_path / "once.sqlite", failures=1) as store:
        with pytest.raises(OSError, match="planted write failure"):
            measure(
                _variant(Flaky(None), 1),
                warmup=0,
                repetitions=REPETITIONS,
                flush_every=FLUSH_EVERY,
                store=store,
            )
        assert _rows(store) == FLUSH_EVERY  # the second try of the handler saved the batch
    before = telemetry.counts().get("torchhal.evaluation.samples_lost", 0)
    with FailingStore(tmp_path / "never.sqlite", failures=2) as store:
        with pytest.raises(OSError, match="planted write failure"):
            measure(
                _variant(Flaky(None), 2),
                warmup=0,
                repetitions=REPETITIONS,
                flush_every=FLUSH_EVERY,
                store=store,
            )
        assert _rows(store) == 0
    assert telemetry.counts().get("torchhal.evaluation.samples_lost", 0) == before + FLUSH_EVERY
