"""What a decline (CallDeclined), a failure while measured and a failure during a capture leave
behind in the registry: which candidates are demoted, counted and measured again."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import CallDeclined, KernelFailedError, RejectionReason


@pytest.fixture
def plain(settings) -> HardwareAbstractionLayer:
    return HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1", autotune="off"))


@pytest.fixture
def tuned(settings, tmp_path: Path) -> HardwareAbstractionLayer:
    return HardwareAbstractionLayer(
        settings=settings(disable_plugin_autoload="1", autotune="on", cache_dir=str(tmp_path))
    )


def _probe(hal: HardwareAbstractionLayer, behaviour: dict[str, str], ran: list[str], names: str) -> None:
    """Op `probe` (x + 1) with candidates named by the letters of `names`, the first the highest
    priority, that record their calls; each raises while `behaviour` maps it to "decline"
    (CallDeclined) or "fail" (RuntimeError)."""
    hal.kernels.define_op("probe", lambda x: x + 1, signature=lambda x: (x.dtype, tuple(x.shape)))
    for priority, name in enumerate(reversed(names)):

        def fn(x: torch.Tensor, name: str = name) -> torch.Tensor:
            ran.append(name)
            if behaviour.get(name) == "decline":
                raise CallDeclined(f"{name}: declined while the mode is on")
            if behaviour.get(name) == "fail":
                raise RuntimeError(f"{name} broke")
            return x + 1

        hal.kernels.register("probe", name, fn, provider="p", priority=priority)


def _order(selection) -> list[str]:
    return [c.qualified_name for c in (selection.candidate, *selection.fallbacks)]


def test_a_decline_while_measured_keeps_the_decliner_first_once_the_mode_is_off(tuned):
    """A candidate that declined the call it was measured on was timed as raising (inf), ranked
    last and cached so: a refusal of one call demoted it for the signature."""
    behaviour = {"F": "decline"}
    ran: list[str] = []
    _probe(tuned, behaviour, ran, "FS")  # F (fast, declining) outranks S by priority
    cpu, x = tuned.device("cpu"), torch.randn(4)
    torch.testing.assert_close(tuned.dispatch("probe", x), x + 1)
    assert tuned.kernels.fallback_counts == {"probe:p/F": 1}  # the call's own decline, once
    selection = tuned.kernels.select("probe", cpu, x)
    assert _order(selection) == ["p/F", "p/S", "torchhal/reference"]
    assert [name for name, _ in selection.timings_ms] == ["p/S"]  # F unmeasured, not inf
    reasons = {r.candidate: (r.reason, r.detail) for r in selection.rejected}
    assert reasons["p/S"][0] is RejectionReason.OUTRANKED
    assert "p/F declined the call it was to be measured on" in reasons["p/S"][1]
    # not remembered as beaten: the next process measures both again
    assert tuned.kernels.tuner.recall(cpu, "probe", selection.signature, ["p/F", "p/S"]) is None
    behaviour.clear()
    ran.clear()
    torch.testing.assert_close(tuned.dispatch("probe", x), x + 1)
    assert ran == ["F"]
    assert tuned.kernels.fallback_counts == {"probe:p/F": 1}


def test_a_decliner_keeps_its_place_by_priority_among_the_measured(tuned, monkeypatch):
    """B declines the measured call; A and C are measured, C the faster. B keeps the second place
    (its place by priority), C and A fill the others fastest first."""
    ran: list[str] = []
    _probe(tuned, {}, ran, "ABC")
    timings = [("p/C", 0.01), ("p/A", 0.5)]  # what the tuner returns where B declined: B left out
    monkeypatch.setattr(tuned.kernels.tuner, "measure", lambda *args: timings)
    selection = tuned.kernels.select("probe", tuned.device("cpu"), torch.randn(4))
    assert _order(selection) == ["p/C", "p/B", "p/A", "torchhal/reference"]
    assert selection.timings_ms == tuple(timings) and not selection.provisional
    detail = {r.candidate: r.detail for r in selection.rejected}
    assert detail["p/B"] == "declined the call it was to be measured on: unmeasured, in its place by priority"
    assert detail["p/A"] == "measured 0.5 ms a call against 0.01"


def test_a_decline_then_a_failure_demotes_only_the_failure(plain):
    """A declines the call, B raises, C runs: the selection stored for the signature dropped A too,
    so A never ran again once it stopped declining."""
    behaviour = {"A": "decline", "B": "fail"}
    ran: list[str] = []
    _probe(plain, behaviour, ran, "ABC")
    cpu, x = plain.device("cpu"), torch.randn(4)
    torch.testing.assert_close(plain.dispatch("probe", x), x + 1)
    assert ran == ["A", "B", "C"]
    assert plain.kernels.fallback_counts == {"probe:p/A": 1, "probe:p/B": 1}
    selection = plain.kernels.select("probe", cpu, x)
    assert _order(selection) == ["p/A", "p/C", "torchhal/reference"]
    failed = [r.candidate for r in selection.rejected if r.reason is RejectionReason.FAILED]
    assert failed == ["p/B"]
    behaviour.pop("A")
    ran.clear()
    torch.testing.assert_close(plain.dispatch("probe", x), x + 1)
    assert ran == ["A"]


def test_a_keyword_tensor_without_storage_demotes_nothing(plain):
    """The "tensors without storage demote nothing" rule read the positional arguments only: a
    torch.func-wrapped tensor passed by keyword to `call` demoted the memory-reading kernel for
    every later plain call."""

    def raw(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y.untyped_storage()  # raises for torch.func's batched tensors
        return x + y

    plain.kernels.define_op(
        "probe", lambda x, y: x + y, signature=lambda x, y: (x.dtype, tuple(x.shape[-1:]))
    )
    plain.kernels.register("probe", "raw", raw, provider="p", priority=1)
    cpu, x, rows = plain.device("cpu"), torch.randn(4), torch.randn(3, 4)
    out = torch.func.vmap(lambda r: plain.kernels.call("probe", cpu, x, y=r))(rows)
    torch.testing.assert_close(out, x + rows)
    assert plain.kernels.fallback_counts == {"probe:p/raw": 1}  # counted, not demoted
    assert plain.kernels.select("probe", cpu, x, torch.randn(4)).candidate.qualified_name == "p/raw"


def test_bad_arguments_while_measured_count_nothing_and_keep_the_selection_provisional(tuned):
    """An index out of range raised in every contender while measured: each was counted as a
    fallback and the all-inf order cached, so the signature's valid calls were never measured."""
    kernels = tuned.kernels
    kernels.define_op("pick", lambda x, i: x[i], signature=lambda x, i: (x.dtype,))
    kernels.register("pick", "fast", lambda x, i: x[i], provider="p", priority=1)
    kernels.register("pick", "other", lambda x, i: x[i] + 0, provider="p", priority=0)
    cpu, x = tuned.device("cpu"), torch.randn(5)
    with pytest.raises(KernelFailedError, match=r"every candidate failed \(so no kernel was demoted"):
        kernels.call("pick", cpu, x, 7)
    assert kernels.fallback_counts == {} and kernels._cache["pick"] == {}
    bad = kernels.select("pick", cpu, x, 7)
    assert bad.provisional and all(math.isinf(ms) for _, ms in bad.timings_ms)
    assert "provisional: priority order (every contender raised while measured)" in bad.explain()
    assert kernels.fallback_counts == {}
    good = kernels.select("pick", cpu, x, 2)
    assert not good.provisional and len(good.timings_ms) == 2
    assert all(math.isfinite(ms) for _, ms in good.timings_ms), good.explain()
    assert kernels.call("pick", cpu, x, 2).item() == x[2].item()


def test_contenders_that_all_raise_while_measured_are_demoted_once_the_reference_runs(tuned, monkeypatch):
    """Where every contender raises on arguments the reference runs, the contenders are at fault:
    demoted and counted once, as a call's fallback does, and not measured again every call."""
    behaviour = {"A": "fail", "B": "fail"}
    ran: list[str] = []
    _probe(tuned, behaviour, ran, "AB")
    measured = []
    measure = tuned.kernels.tuner.measure
    monkeypatch.setattr(tuned.kernels.tuner, "measure", lambda *a: measured.append(1) or measure(*a))
    cpu, x = tuned.device("cpu"), torch.randn(4)
    for _ in range(3):
        torch.testing.assert_close(tuned.dispatch("probe", x), x + 1)
    assert len(measured) == 1
    assert tuned.kernels.fallback_counts == {"probe:p/A": 1, "probe:p/B": 1}
    selection = tuned.kernels.select("probe", cpu, x)
    assert selection.candidate.qualified_name == "torchhal/reference" and not selection.provisional
    failed = {r.candidate for r in selection.rejected if r.reason is RejectionReason.FAILED}
    assert failed == {"p/A", "p/B"}


def test_a_candidate_whose_bind_raises_is_counted_once_in_one_fallback_chain(plain):
    """A raises, B's bind raises, C raises, D runs: B was bound, and counted, again at each step."""

    def boom(name: str):
        def fn(x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError(f"{name} broke")

        return fn

    def bad_bind(caps):
        raise RuntimeError("B's bind broke")

    kernels = plain.kernels
    kernels.define_op("probe", lambda x: x, signature=lambda x: (x.dtype, tuple(x.shape)))
    kernels.register("probe", "A", boom("A"), provider="p", priority=4)
    kernels.register("probe", "B", lambda x: x, provider="p", priority=3, bind=bad_bind)
    kernels.register("probe", "C", boom("C"), provider="p", priority=2)
    kernels.register("probe", "D", lambda x: x * 2, provider="p", priority=1)
    x = torch.randn(3)
    torch.testing.assert_close(plain.dispatch("probe", x), x * 2)
    assert kernels.fallback_counts == {"probe:p/A": 1, "probe:p/B": 1, "probe:p/C": 1}
    assert plain.kernels.select("probe", plain.device("cpu"), x).candidate.qualified_name == "p/D"


def test_a_cached_selection_failing_during_a_capture_is_not_demoted(plain, monkeypatch):
    """A selection cached outside a capture whose kernel then fails inside one ("operation not
    permitted when stream is capturing"): the next candidate serves that call, nothing is demoted."""
    behaviour: dict[str, str] = {}
    ran: list[str] = []
    _probe(plain, behaviour, ran, "CB")
    cpu, x = plain.device("cpu"), torch.randn(4)
    torch.testing.assert_close(plain.dispatch("probe", x), x + 1)
    assert ran == ["C"] and _order(plain.kernels.select("probe", cpu, x))[0] == "p/C"
    monkeypatch.setattr(cpu.adapter, "capturing", lambda index: True)
    behaviour["C"] = "fail"
    ran.clear()
    torch.testing.assert_close(plain.dispatch("probe", x), x + 1)
    assert ran == ["C", "B"]
    assert plain.kernels.fallback_counts == {"probe:p/C": 1}
    monkeypatch.setattr(cpu.adapter, "capturing", lambda index: False)
    behaviour.clear()
    ran.clear()
    torch.testing.assert_close(plain.dispatch("probe", x), x + 1)
    assert ran == ["C"]
    assert plain.kernels.select("probe", cpu, x).candidate.qualified_name == "p/C"


def test_every_contender_declining_while_measured_leaves_the_selection_to_be_measured(tuned):
    """With nothing timed and nothing raised there is nothing to rank by: the priority order was
    cached as final, and once the declines ended the candidates were never measured."""
    behaviour = {"F": "decline", "S": "decline"}
    ran: list[str] = []
    _probe(tuned, behaviour, ran, "FS")
    cpu, x = tuned.device("cpu"), torch.randn(4)
    torch.testing.assert_close(tuned.dispatch("probe", x), x + 1)  # the reference computes it
    selection = tuned.kernels.select("probe", cpu, x)
    assert selection.provisional and selection.timings_ms == ()
    assert "every contender declined the call" in selection.explain()
    behaviour.clear()
    torch.testing.assert_close(tuned.dispatch("probe", x), x + 1)
    measured = tuned.kernels.select("probe", cpu, x)
    assert not measured.provisional
    assert sorted(name for name, _ in measured.timings_ms) == ["p/F", "p/S"]
