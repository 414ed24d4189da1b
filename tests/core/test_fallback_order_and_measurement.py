"""Which candidate a fallback runs, what measurement does with failures and unreadable tensors,
how `call` and `use` keep their layouts apart, and how shared selection files merge."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.core.adapters import FakeAdapter, fake_caps
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import CallDeclined, InvalidArgumentError, RejectionReason, Unsupported
from torchhal.hal_core.kernels import UNMEASURED
from torchhal.hal_core.tuning import Tuner


@pytest.fixture
def tuned(settings, tmp_path: Path) -> HardwareAbstractionLayer:
    return HardwareAbstractionLayer(
        settings=settings(disable_plugin_autoload="1", autotune="on", cache_dir=str(tmp_path))
    )


def _probe(hal: HardwareAbstractionLayer, fails: set[str], ran: list[str]) -> None:
    """Op `probe` with candidates A, B and C (C the highest priority) that record their calls and
    raise while named in `fails`."""
    hal.kernels.define_op("probe", lambda x: x, signature=lambda x: (x.dtype, tuple(x.shape)))
    for priority, name in enumerate("ABC"):

        def fn(x: torch.Tensor, name: str = name) -> torch.Tensor:
            ran.append(name)
            if name in fails:
                raise RuntimeError(f"{name} broke")
            return x

        hal.kernels.register("probe", name, fn, provider="p", priority=priority)


def test_a_fallback_takes_the_next_candidate_in_the_measured_order(tuned, monkeypatch):
    """It re-selected by priority: after the fastest raised, the slowest (highest priority) ran
    and was cached for good, though the selection listed the second fastest next."""
    fails: set[str] = set()
    ran: list[str] = []
    _probe(tuned, fails, ran)
    measured = [("p/A", 0.01), ("p/B", 0.1), ("p/C", 20.0)]
    monkeypatch.setattr(tuned.kernels.tuner, "measure", lambda *args: measured)
    x = torch.randn(4)
    tuned.dispatch("probe", x)
    assert ran == ["A"]
    fails.add("A")
    ran.clear()
    tuned.dispatch("probe", x)
    tuned.dispatch("probe", x)
    assert ran == ["A", "B", "B"]
    selection = tuned.kernels.select("probe", tuned.device("cpu"), x)
    assert selection.candidate.qualified_name == "p/B" and selection.timings_ms == tuple(measured)
    assert [c.qualified_name for c in selection.fallbacks] == ["p/C", "torchhal/reference"]
    assert tuned.kernels.fallback_counts == {"probe:p/A": 1}


def test_a_failure_during_a_graph_capture_demotes_nothing(tuned, monkeypatch):
    """A kernel that cannot run while the stream captures ("operation not permitted when stream is
    capturing") was demoted for every later call of its signature."""
    fails = {"C"}
    ran: list[str] = []
    _probe(tuned, fails, ran)
    cpu = tuned.device("cpu")
    monkeypatch.setattr(cpu.adapter, "capturing", lambda index: True)
    x = torch.randn(4)
    tuned.dispatch("probe", x)
    assert ran == ["C", "B"]
    assert tuned.kernels._cache["probe"] == {}  # provisional: neither cached nor demoted
    monkeypatch.setattr(cpu.adapter, "capturing", lambda index: False)
    fails.clear()
    monkeypatch.setattr(
        tuned.kernels.tuner, "measure", lambda *args: [("p/C", 0.01), ("p/B", 0.1), ("p/A", 1.0)]
    )
    ran.clear()
    tuned.dispatch("probe", x)
    assert ran == ["C"]


def test_a_candidate_that_raises_while_measured_is_counted(tuned):
    """It was ranked last without a count, a log line of the registry's or a trace."""
    ran: list[str] = []
    _probe(tuned, {"C"}, ran)
    tuned.dispatch("probe", torch.randn(4))
    selection = tuned.kernels.select("probe", tuned.device("cpu"), torch.randn(4))
    assert dict(selection.timings_ms)["p/C"] == math.inf
    assert selection.candidate.qualified_name in ("p/A", "p/B")
    assert tuned.kernels.fallback_counts == {"probe:p/C": 1}


def test_arguments_without_storage_are_not_measured(tuned, monkeypatch):
    """A first call under torch.func.vmap measured a kernel that reads memory as raising, and so
    ranked it last for every later plain call of the signature."""
    tuned.kernels.define_op("probe", lambda x: x * 2, signature=lambda x: (x.dtype, tuple(x.shape[-1:])))

    def raw(x: torch.Tensor) -> torch.Tensor:
        x.untyped_storage()  # raises for torch.func's batched tensors
        return x * 2

    tuned.kernels.register("probe", "raw", raw, provider="p", priority=1)
    tuned.kernels.register("probe", "plain", lambda x: x * 2, provider="p", priority=0)
    judged = []
    judge = tuned.kernels._judge_all
    monkeypatch.setattr(tuned.kernels, "_judge_all", lambda *a: judged.append(1) or judge(*a))
    for _ in range(3):  # selected once, unmeasured, and kept apart from plain calls' selection
        torch.testing.assert_close(
            torch.func.vmap(lambda r: tuned.dispatch("probe", r))(torch.ones(3, 4)), 2 * torch.ones(3, 4)
        )
    assert len(judged) == 1 and [key[2:] for key in tuned.kernels._cache["probe"]] == [(UNMEASURED,)]
    selection = tuned.kernels.select("probe", tuned.device("cpu"), torch.randn(4))
    assert all(math.isfinite(ms) for _, ms in selection.timings_ms), selection.explain()


def test_call_on_a_device_and_use_of_it_keep_their_layouts_apart(settings):
    """`call(op, dev)` runs on dev; under `use(dev)` a tensor of another device type runs on its
    own device. Both keyed their memo by the same Device, so one's selection served the other."""
    hal = HardwareAbstractionLayer(
        adapters=[FakeAdapter([fake_caps(device_type="meta")])],
        settings=settings(disable_plugin_autoload="1"),
    )
    hal.kernels.define_op("probe", lambda x: "reference", signature=lambda x: (x.dtype, tuple(x.shape)))

    def acme_only(caps, sig):
        return None if caps.adapter == "acme" else Unsupported(RejectionReason.DEVICE, "not acme")

    hal.kernels.register("probe", "acme", lambda x: "acme", provider="p", supports=acme_only, priority=1)
    acme, x = hal.device("acme:0"), torch.randn(3)
    for _ in range(2):
        with hal.use(acme):
            assert hal.dispatch("probe", x) == "reference"  # a CPU tensor stays on the CPU
        assert hal.kernels.call("probe", acme, x) == "acme"
    assert hal.kernels.fallback_counts == {}


def test_a_shared_selection_file_keeps_winners_measured_since_by_others(tmp_path, settings):
    """A process wrote back winners it had only read, over one another process measured since."""
    cpu = HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1")).device("cpu")
    code = lambda: {"torchhal": "1"}  # noqa: E731
    Tuner(tmp_path, "on", code).remember(cpu, "op", "K", "p/X", ["p/X", "p/Y"])
    first = Tuner(tmp_path, "on", code)
    assert first.recall(cpu, "op", "K", ["p/X", "p/Y"]) == "p/X"  # read
    Tuner(tmp_path, "on", code).remember(cpu, "op", "K", "p/Z", ["p/X", "p/Y", "p/Z"])  # measured since
    first.remember(cpu, "op", "K2", "p/X", ["p/X"])
    (path,) = (tmp_path / "selections").glob("*.json")
    winners = json.loads(path.read_text())["winners"]
    assert winners["op|'K'"]["winner"] == "p/Z" and winners["op|'K2'"]["winner"] == "p/X"
    first.remember(cpu, "op", "K", "p/Y", ["p/X", "p/Y"])  # what a Tuner measures itself, it writes
    assert json.loads(path.read_text())["winners"]["op|'K'"]["winner"] == "p/Y"


def test_arguments_that_do_not_fit_the_op_are_refused_naming_it(settings):
    hal = HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1"))
    cpu, x = hal.device("cpu"), torch.randn(2, 8)
    with pytest.raises(InvalidArgumentError, match=r"^op 'rms_norm' takes \(.*missing .*'weight'"):
        hal.kernels.call("rms_norm", cpu, x)
    with pytest.raises(
        InvalidArgumentError, match=r"^op 'rms_norm' takes .*unexpected keyword argument 'epsilon'"
    ):
        hal.kernels.call("rms_norm", cpu, x, torch.ones(8), epsilon=1e-6)


def test_a_declined_call_falls_back_for_that_call_only(settings):
    """A candidate that declines one call (CallDeclined: a process-wide mode, a size its signature
    buckets with others) was demoted for the signature for good."""
    hal = HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1"))
    declining = {"on": True}

    def picky(x: torch.Tensor) -> torch.Tensor:
        if declining["on"]:
            raise CallDeclined("picky: declined while the mode is on")
        return x + 1

    hal.kernels.define_op("probe", lambda x: x + 1, signature=lambda x: (x.dtype, tuple(x.shape)))
    hal.kernels.register("probe", "picky", picky, provider="p", priority=1)
    cpu, x = hal.device("cpu"), torch.randn(4)
    for _ in range(2):
        torch.testing.assert_close(hal.kernels.call("probe", cpu, x), x + 1)
    assert hal.kernels.fallback_counts == {"probe:p/picky": 2}
    declining["on"] = False
    assert hal.kernels.select("probe", cpu, x).candidate.qualified_name == "p/picky"
    torch.testing.assert_close(hal.kernels.call("probe", cpu, x), x + 1)
    assert hal.kernels.fallback_counts == {"probe:p/picky": 2}


def test_a_fallback_from_a_selection_older_than_a_registration_is_not_cached(settings):
    """A selection read before a candidate was registered holds the old order: caching its fallback
    hid the new candidate until the next clear."""
    hal = HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1"))
    ran: list[str] = []
    _probe(hal, {"C"}, ran)
    cpu, x = hal.device("cpu"), torch.randn(4)
    stale = hal.kernels.select("probe", cpu, x)  # C, then B
    hal.kernels.register("probe", "D", lambda x: ran.append("D") or x, provider="p", priority=1.5)
    hal.kernels._fall_back(stale, cpu, RuntimeError("C broke"), (x,), {})
    assert ran == ["B"] and hal.kernels._cache["probe"] == {}
    ran.clear()
    hal.kernels.call("probe", cpu, x)
    assert ran == ["C", "D"]
