"""A third-party plugin of kernels only: the diagnostic that shows it loaded,
and the reasons selection gives when a winner measured by an earlier HAL is recalled."""

from __future__ import annotations

import types

import torch

from tests.core.adapters import FakeAdapter
from tests.core.test_registry import _select_rms_norm, _slow, _tuned_hal
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import RejectionReason, hookimpl
from torchhal.hal_core.plugins import Status
from torchhal.kernels import rms_norm

KERNELS_ONLY = """
from torchhal.hal_core import hookimpl
from torchhal.kernels import rms_norm


@hookimpl
def torchhal_register_kernels(registry):
    registry.register("rms_norm", "quick", rms_norm.reference, provider="{provider}", priority=3)
    registry.define_op("{op}", rms_norm.reference, signature=rms_norm.signature)
    registry.register("{op}", "quick", rms_norm.reference, provider="{provider}", priority=3)
"""


def outranked(selection) -> dict[str, str]:
    return {r.candidate: r.detail for r in selection.rejected if r.reason is RejectionReason.OUTRANKED}


def test_a_plugin_of_kernels_only_is_listed_loaded_with_what_it_added(plugin_dist, settings, tmp_path):
    """It had no diagnostic at all (only adapters had one), so `torchhal info` did not show it."""
    provider, op = f"p{torch.randint(10**6, ()).item()}", f"op{torch.randint(10**6, ()).item()}"
    plugin_dist("kern", KERNELS_ONLY.format(provider=provider, op=op))
    hal = HardwareAbstractionLayer(settings=settings(plugins="kern", cache_dir=str(tmp_path)))
    (diag,) = [d for d in hal.diagnostics if d.name == "kern"]
    assert (diag.status, diag.stage, diag.distribution) == (Status.LOADED, "kernels", "torchhal-test-kern")
    added = f"added {op}/{provider}/quick, rms_norm/{provider}/quick"
    assert diag.reason == f"kernels only, no adapter: defined op(s) {op}; {added}"
    assert diag.as_dict() in hal.report()["diagnostics"]  # what `torchhal info` lists


def test_a_plugin_object_of_kernels_only_says_when_it_added_nothing(settings):
    plugin = types.SimpleNamespace(__name__="idle", torchhal_register_kernels=hookimpl(lambda registry: None))
    hal = HardwareAbstractionLayer(plugins=[plugin], settings=settings(disable_plugin_autoload="1"))
    (diag,) = [d for d in hal.diagnostics if d.name == "idle"]
    assert (diag.status, diag.stage, diag.distribution) == (Status.LOADED, "kernels", None)
    assert diag.reason == "kernels only, no adapter: added no kernel candidate"


def test_a_failing_kernels_only_plugin_is_listed_failed_only(plugin_dist, settings, tmp_path):
    plugin_dist("kern", KERNELS_ONLY.format(provider="p", op="rms_norm"))  # rms_norm: taken
    hal = HardwareAbstractionLayer(settings=settings(plugins="kern", cache_dir=str(tmp_path)))
    (diag,) = [d for d in hal.diagnostics if d.name == "kern"]
    assert (diag.status, diag.stage) == (Status.FAILED, "kernels")
    assert diag.reason.startswith("TorchHALError: op 'rms_norm' is already defined")
    assert all(c.provider != "p" for c in hal.kernels.candidates("rms_norm"))  # its first one undone


def test_a_plugin_with_an_adapter_gets_no_kernels_diagnostic(settings):
    adapter = FakeAdapter()
    plugin = types.SimpleNamespace(
        __name__="vendor",
        torchhal_adapters=hookimpl(lambda: [adapter]),
        torchhal_register_kernels=hookimpl(lambda registry: None),
    )
    hal = HardwareAbstractionLayer(plugins=[plugin], settings=settings(disable_plugin_autoload="1"))
    assert [d for d in hal.diagnostics if d.name == "vendor" or d.stage == "kernels"] == []
    assert any(d.name == adapter.name for d in hal.diagnostics)  # its adapter's says how it loaded


def test_a_remembered_winner_says_the_others_were_measured_slower(settings, tmp_path):
    """A HAL that recalled a winner from the cache (an earlier process) explained the losers by
    priority: the priority-1000 loser was "priority 1000, as torchhal/aten's: ranked after it by
    name and provider", false of a priority-10 winner chosen by measurement."""
    x = torch.randn(8, int(torch.randint(100, 300, ())))
    w = torch.randn(x.shape[1])
    first = _select_rms_norm(_tuned_hal(settings, tmp_path), x, w)
    assert dict(first.timings_ms)["test/slow-but-preferred"] >= 2.0
    winner = first.candidate.qualified_name
    again = _select_rms_norm(_tuned_hal(settings, tmp_path), x, w)
    assert again.candidate.qualified_name == winner and again.timings_ms == ()  # recalled
    losers = outranked(again)
    assert losers.pop("torchhal/reference") == f"priority -inf < {again.candidate.priority}"
    assert losers and set(losers) == {c.qualified_name for c in again.fallbacks} - {"torchhal/reference"}
    assert all(d == f"measured slower than {winner} in an earlier run (remembered)" for d in losers.values())
    out = again.fn(x, w)
    torch.testing.assert_close(out.double(), rms_norm.reference(x.double(), w.double()), atol=1e-5, rtol=1e-5)


def test_when_the_remembered_winner_cannot_bind_the_rest_are_ranked_by_priority(settings, tmp_path):
    """Nothing says how the losers compared with each other: the next by priority runs, and the
    others must not be said "measured slower" than it (the earlier run may have found the opposite)."""
    x = torch.randn(8, int(torch.randint(100, 300, ())))
    w = torch.randn(x.shape[1])

    def make_hal(bind_fails: bool) -> HardwareAbstractionLayer:
        """The two slow candidates against quick (aten left out), measured once for both HALs."""

        def bind(caps):
            if bind_fails:
                raise RuntimeError("the device's kernel cache is gone")
            return rms_norm.reference

        hal = HardwareAbstractionLayer(
            settings=settings(
                disable_plugin_autoload="1", autotune="on", cache_dir=str(tmp_path), disable_kernels="aten"
            )
        )
        for name, priority, fn in (("slow-but-preferred", 1000, _slow), ("middle", 500, _slow)):
            hal.kernels.register("rms_norm", name, fn, provider="test", priority=priority)
        hal.kernels.register("rms_norm", "quick", rms_norm.reference, provider="test", priority=-5, bind=bind)
        return hal

    assert _select_rms_norm(make_hal(bind_fails=False), x, w).candidate.qualified_name == "test/quick"
    hal = make_hal(bind_fails=True)
    again = _select_rms_norm(hal, x, w)
    assert again.candidate.qualified_name == "test/slow-but-preferred" and again.timings_ms == ()
    failed = {r.candidate: r.reason for r in again.rejected}
    assert failed["test/quick"] is RejectionReason.FAILED
    assert outranked(again) == {
        "test/middle": "priority 500 < 1000",
        "torchhal/reference": "priority -inf < 1000",
    }
    expected = rms_norm.reference(x.double(), w.double())
    torch.testing.assert_close(again.fn(x, w).double(), expected, atol=1e-5, rtol=1e-5)
