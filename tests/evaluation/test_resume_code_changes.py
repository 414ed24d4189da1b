"""Resuming from a store after the code changed: an edited variant body is a new experiment, and
samples resumed while the git tree is dirty or unknown (where an edit elsewhere would not show in
the key) are warned about and counted."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.evaluation.helpers import cpu_hal
from torchhal.evaluation import fingerprint
from torchhal.evaluation.fingerprint import code_digest
from torchhal.evaluation.harness import Variant, measure
from torchhal.evaluation.inputs import Inputs
from torchhal.evaluation.quality import measure_quality
from torchhal.evaluation.store import SampleStore
from torchhal.hal_core import telemetry

COUNTER = "torchhal.evaluation.resumed_with_unversioned_code"


def _define(body: str, closure_value: float = 1.0):
    """A function `work` of module `variants_under_edit`: the same name and description each time,
    as a script edited between two runs gives."""
    namespace = {"__name__": "variants_under_edit"}
    exec(  # the test's own source, standing for an edited file
        f"def make(k):\n    def work(x):\n        return {body}\n    return work\n", namespace
    )
    return namespace["make"](closure_value)


def _variant(fn) -> Variant:
    return Variant("v", fn, cpu_hal().device("cpu"), Inputs.fixed(torch.ones(4)))


def _git(monkeypatch: pytest.MonkeyPatch, dirty: bool | None) -> None:
    state = {"commit": None if dirty is None else "0" * 40, "dirty": dirty}
    monkeypatch.setattr(fingerprint, "git_state", lambda cwd=None: state)


def test_an_edited_variant_body_is_measured_anew(tmp_path, monkeypatch) -> None:
    """The rerun after an edit was answered entirely from the store: the new code never ran."""
    _git(monkeypatch, dirty=None)
    path = tmp_path / "samples.sqlite"
    with SampleStore(path) as store:
        first = measure(_variant(_define("x + k")), warmup=0, repetitions=5, store=store)
    with SampleStore(path) as store:
        again = measure(_variant(_define("x + k")), warmup=0, repetitions=5, store=store)
        edited = measure(_variant(_define("x * k + 1")), warmup=0, repetitions=5, store=store)
    assert first.resumed == 0 and again.resumed == 5
    assert edited.resumed == 0 and edited.experiment != first.experiment


def test_code_digest_follows_wrappers_and_ignores_where_the_code_sits() -> None:
    add, mul = _define("x + k"), _define("x * k")
    assert code_digest(add) == code_digest(_define("x + k")) != code_digest(mul)
    assert (
        code_digest(functools.partial(add, 1)) == code_digest(functools.partial(add, 1)) != code_digest(add)
    )
    assert code_digest(functools.wraps(add)(lambda x: add(x))) != code_digest(lambda x: add(x))

    class Model:
        def __call__(self, x):
            return x + 1

        def method(self, x):
            return x - 1

    assert code_digest(Model()) == code_digest(Model.__call__) != code_digest(Model().method)
    assert code_digest(torch.add) is None  # no Python code to hash


@pytest.mark.parametrize(("dirty", "warned"), [(None, True), (True, True), (False, False)])
def test_resuming_with_unversioned_code_is_warned_and_counted(
    tmp_path, monkeypatch, capsys, dirty, warned
) -> None:
    """A change the key cannot see (here a value the variant closes over) was resumed silently."""
    _git(monkeypatch, dirty)
    path = tmp_path / "samples.sqlite"
    with SampleStore(path) as store:
        measure(_variant(_define("x + k", 1.0)), warmup=0, repetitions=5, store=store)
    capsys.readouterr()
    before = telemetry.counts().get(COUNTER, 0)
    with SampleStore(path) as store:
        m = measure(_variant(_define("x + k", 2.0)), warmup=0, repetitions=5, store=store)
    assert m.resumed == 5
    assert telemetry.counts().get(COUNTER, 0) == before + (5 if warned else 0)
    assert ("resumed samples may be stale" in capsys.readouterr().err) == warned


def test_resumed_quality_errors_are_warned_about_too(tmp_path, monkeypatch) -> None:
    _git(monkeypatch, dirty=True)
    cpu = cpu_hal().device("cpu")
    generator = torch.Generator().manual_seed(11)
    inputs = Inputs([(torch.randn(6, generator=generator),) for _ in range(4)])
    variants = [
        Variant("ref", torch.sin, cpu, inputs),
        Variant("new", _define("x.sin() + 1e-3 * k"), cpu, inputs),
    ]
    with SampleStore(tmp_path / "samples.sqlite") as store:
        measure_quality(variants, "ref", store=store)
        before = telemetry.counts().get(COUNTER, 0)
        measure_quality(variants, "ref", store=store)
    assert telemetry.counts().get(COUNTER, 0) == before + 2 * len(inputs)


def test_code_digest_tells_modules_by_their_forward_and_partials_by_their_arguments() -> None:
    """Every torch Module hashed torch's own __call__, so an edited forward resumed stale samples;
    partials binding other arguments (block=64, block=128) hashed alike."""

    class Doubles(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    class Triples(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 3 * x

    assert code_digest(Doubles()) != code_digest(Triples())
    assert code_digest(Doubles()) == code_digest(Doubles())

    def tiled(x: torch.Tensor, block: int) -> torch.Tensor:
        return x * block

    digests = {code_digest(functools.partial(tiled, block=b)) for b in (64, 128)}
    assert len(digests) == 2
    assert code_digest(functools.partial(tiled, block=64)) == code_digest(functools.partial(tiled, block=64))
