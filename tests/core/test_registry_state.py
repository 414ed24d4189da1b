"""What the registry holds on to and when it lets go: the memo's hold on tuple arguments, the
`disabled` names assigned after selections, and `clear_cache` against measured winners."""

from __future__ import annotations

import gc
import math
import shutil
import weakref
from pathlib import Path

import pytest
import torch

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import KernelRegistry, RejectionReason
from torchhal.hal_core.errors import ConfigurationError
from torchhal.kernels import rms_norm


@pytest.fixture
def hal(settings) -> HardwareAbstractionLayer:
    return HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1"))


def test_tensors_inside_a_tuple_argument_are_not_kept_alive_by_the_memo(hal):
    """The memo keyed a tuple argument by its items, and a tensor hashes by identity: each call was
    a new entry whose key held the caller's tensors (100 MiB after 50 calls of two 1 MiB parts)."""
    validated = []

    def signature(x, parts):
        validated.append(1)
        return tuple((p.dtype, tuple(p.shape[1:])) for p in (x, *parts))

    hal.kernels.define_op("cat_rows", lambda x, parts: torch.cat((x, *parts)), signature=signature)
    refs = []
    for _ in range(5):
        x, parts = torch.randn(1, 64), (torch.randn(16, 64), torch.randn(8, 64))
        torch.testing.assert_close(hal.dispatch("cat_rows", x, parts), torch.cat((x, *parts)))
        refs += [weakref.ref(p) for p in parts]
        del parts
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    assert len(validated) == 5  # not memoised: validated every call
    assert hal.kernels._seen["cat_rows"].entries == {}


def test_a_tuple_of_scalars_is_still_memoised_by_value_and_item_types(hal):
    """Plain scalars and tuples of them stay in the key (nothing to keep alive), item types
    included at every depth: ((True, 0),) is not taken for ((1, 0),)."""
    validated = []

    def signature(x, spec):
        validated.append(spec)
        if type(spec[0][0]) is not int:
            raise TypeError(f"probe: spec must hold ints, got {spec!r}")
        return (x.dtype, spec)

    hal.kernels.define_op("probe", lambda x, spec: x * spec[0][0], signature=signature)
    x = torch.randn(4)
    for _ in range(3):
        torch.testing.assert_close(hal.dispatch("probe", x, ((2, 0), "a")), x * 2)
    assert validated == [((2, 0), "a")]
    with pytest.raises(TypeError, match=r"spec must hold ints, got \(\(True, 0\), 'a'\)"):
        hal.dispatch("probe", x, ((True, 0), "a"))


def test_assigning_disabled_drops_the_selections_and_memo_made_before(hal):
    """Assigning `disabled` after selections were made changed none of them: the disabled
    candidate kept serving every signature selected before."""
    ran: list[str] = []
    hal.kernels.define_op("probe", lambda x: x + 1, signature=lambda x: (x.dtype, tuple(x.shape)))
    for priority, name in enumerate("BA"):
        hal.kernels.register(
            "probe", name, lambda x, name=name: ran.append(name) or x + 1, provider="p", priority=priority
        )
    cpu, x = hal.device("cpu"), torch.randn(4)
    for _ in range(2):  # selected, then found by the memo
        torch.testing.assert_close(hal.dispatch("probe", x), x + 1)
    assert ran == ["A", "A"]
    hal.kernels.disabled = frozenset({"p/A"})
    assert hal.kernels.disabled == frozenset({"p/A"})
    ran.clear()
    torch.testing.assert_close(hal.dispatch("probe", x), x + 1)
    assert ran == ["B"]
    selection = hal.kernels.select("probe", cpu, x)
    assert selection.candidate.qualified_name == "p/B"
    assert {r.candidate: r.reason for r in selection.rejected}["p/A"] is RejectionReason.DISABLED
    hal.kernels.disabled = (name for name in ["B"])  # any collection of names, as the GPU tests assign
    ran.clear()
    torch.testing.assert_close(hal.dispatch("probe", x), x + 1)
    assert ran == ["A"]


@pytest.mark.parametrize("names", [{"reference"}, {"p/A", "torchhal/reference"}])
def test_disabled_refuses_the_reference_as_settings_does(hal, names):
    before = hal.kernels.disabled
    with pytest.raises(
        ConfigurationError, match=r"names '[a-z/]*reference': the reference implementation cannot"
    ):
        hal.kernels.disabled = frozenset(names)
    assert hal.kernels.disabled == before
    with pytest.raises(ConfigurationError, match="the reference implementation cannot be disabled"):
        KernelRegistry(disabled=frozenset(names))


def test_disabled_refuses_a_lone_string_naming_its_type(hal):
    with pytest.raises(ConfigurationError, match=r"must be a collection of candidate names .* got 'p/A'"):
        hal.kernels.disabled = "p/A"
    assert hal.kernels.disabled == frozenset()


def test_clear_cache_measures_again_once_the_selections_file_is_gone(settings, tmp_path: Path, monkeypatch):
    """clear_cache dropped the selections but not the tuner's winners in memory: after deleting the
    selections file (as the user guide says to after editing a kernel) and clearing, the old winner
    was recalled unmeasured."""
    hal = HardwareAbstractionLayer(
        settings=settings(disable_plugin_autoload="1", autotune="on", cache_dir=str(tmp_path))
    )
    hal.kernels.register("rms_norm", "twin", rms_norm.reference, provider="t", priority=1000)
    measured = []
    measure = hal.kernels.tuner.measure
    monkeypatch.setattr(hal.kernels.tuner, "measure", lambda *a: measured.append(1) or measure(*a))
    cpu, x, w = hal.device("cpu"), torch.randn(8, 64), torch.randn(64)
    first = hal.kernels.select("rms_norm", cpu, x, w, 1e-6)
    assert len(first.timings_ms) == 2 and measured == [1]
    assert all(math.isfinite(ms) for _, ms in first.timings_ms), first.explain()
    hal.kernels.clear_cache()  # the file kept: its winner is read again, not measured
    recalled = hal.kernels.select("rms_norm", cpu, x, w, 1e-6)
    assert recalled.candidate == first.candidate and recalled.timings_ms == () and measured == [1]
    shutil.rmtree(tmp_path / "selections")
    hal.kernels.clear_cache()
    again = hal.kernels.select("rms_norm", cpu, x, w, 1e-6)
    assert len(again.timings_ms) == 2 and measured == [1, 1]
