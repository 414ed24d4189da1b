"""Measured selection's two timings (TORCHHAL_SELECTION_TIMING): eager, calls back to back (host
launch cost included), and graph, replays of a captured device graph (device time alone).

A fake device that "captures graphs": a candidate's device work either runs now (the host waits it
out, as an eager caller pays) or, while a capture is recording, is recorded, and the replay runs
only the recorded work. One candidate is host-heavy and device-light, the other the reverse, so the
two timings must choose differently.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.core.adapters import FakeAdapter, fake_caps
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import telemetry
from torchhal.hal_core.capabilities import Feature

OP = "timing_probe"
HOST_HEAVY = "test/host_heavy"
DEVICE_HEAVY = "test/device_heavy"


class _Capture:
    recording: list[float] | None = None


def _device_work(ms: float) -> None:
    """Work of `ms` milliseconds on the fake device: recorded while a graph is captured, else
    waited out by the host."""
    if _Capture.recording is not None:
        _Capture.recording.append(ms)
    else:
        time.sleep(ms / 1000)


class GraphAdapter(FakeAdapter):
    """Host tensors, a device that declares graphs: a replay runs the device work its capture
    recorded, none of the host's."""

    def __init__(self, graphs: bool = True) -> None:
        features = {Feature.GRAPHS} if graphs else set()
        super().__init__([fake_caps(features=frozenset(features))])
        self.in_capture = False  # a caller's graph capture under way on the device's stream

    def capturing(self, index):
        return self.in_capture

    def graph_replay(self, index, work):
        recorded: list[float] = []
        _Capture.recording = recorded
        try:
            work()
        finally:
            _Capture.recording = None
        return lambda: _device_work(sum(recorded))


def _reference(x):
    return x * 2


def _host_heavy(x):
    time.sleep(0.004)  # launch cost on the host
    _device_work(0.5)
    return x * 2


def _device_heavy(x):
    _device_work(2.0)
    return x * 2


def _hal(settings, tmp_path, timing, graphs=True):
    hal = HardwareAbstractionLayer(
        adapters=[GraphAdapter(graphs)],
        settings=settings(
            disable_plugin_autoload="1", autotune="on", cache_dir=str(tmp_path), selection_timing=timing
        ),
    )
    hal.kernels.define_op(OP, _reference, signature=lambda x: (x.dtype, x.dim()))
    hal.kernels.register(OP, "host_heavy", _host_heavy, provider="test", priority=10)
    hal.kernels.register(OP, "device_heavy", _device_heavy, provider="test", priority=5)
    return hal


def _select(hal):
    import torch

    return hal.kernels.select(OP, hal.device("acme:0"), torch.randn(4, 4))


def test_graph_timing_times_replays_and_eager_timing_calls(settings, tmp_path):
    eager = _select(_hal(settings, tmp_path / "eager", "eager"))
    assert eager.candidate.qualified_name == DEVICE_HEAVY
    assert dict(eager.timings_ms)[HOST_HEAVY] >= 4.0  # its host cost is in the eager figure
    graph = _select(_hal(settings, tmp_path / "graph", "graph"))
    assert graph.candidate.qualified_name == HOST_HEAVY
    times = dict(graph.timings_ms)
    assert times[HOST_HEAVY] < 2.0 <= times[DEVICE_HEAVY]  # device time alone


def test_graph_and_eager_winners_are_kept_apart(settings, tmp_path):
    """One cache directory: each timing recalls its own winner, never the other's."""
    assert _select(_hal(settings, tmp_path, "graph")).candidate.qualified_name == HOST_HEAVY
    eager = _select(_hal(settings, tmp_path, "eager"))
    assert eager.candidate.qualified_name == DEVICE_HEAVY and eager.timings_ms  # measured, not recalled
    graph_again = _select(_hal(settings, tmp_path, "graph"))
    assert graph_again.candidate.qualified_name == HOST_HEAVY and graph_again.timings_ms == ()
    (saved,) = (tmp_path / "selections").glob("*.json")
    winners = json.loads(saved.read_text())["winners"]
    assert {key.endswith("|graph"): entry["winner"] for key, entry in winners.items()} == {
        True: HOST_HEAVY,
        False: DEVICE_HEAVY,
    }


def test_graph_timing_on_a_device_without_graphs_is_eager_and_says_so(settings, tmp_path, capsys):
    telemetry.configure(log_level="warning")
    capsys.readouterr()
    before = telemetry.counts().get("torchhal.tuning.graph_timing_unavailable", 0)
    selection = _select(_hal(settings, tmp_path, "graph", graphs=False))
    assert selection.candidate.qualified_name == DEVICE_HEAVY  # timed as an eager caller pays
    assert "the device captures no graphs: eager timing" in capsys.readouterr().err
    assert telemetry.counts()["torchhal.tuning.graph_timing_unavailable"] == before + 1


def test_a_candidate_that_cannot_be_captured_is_measured_last(settings, tmp_path):
    """A caller replaying graphs would fail with it: it gets no finite time, and stays a fallback."""

    def uncapturable(x):
        if _Capture.recording is not None:
            raise RuntimeError("operation not permitted when stream is capturing")
        return x * 2

    hal = _hal(settings, tmp_path, "graph")
    hal.kernels.register(OP, "uncapturable", uncapturable, provider="test", priority=99)
    selection = _select(hal)
    assert selection.candidate.qualified_name == HOST_HEAVY
    assert dict(selection.timings_ms)["test/uncapturable"] == float("inf")


def test_the_setting_reads_its_variable(settings):
    from torchhal.hal_core.settings import Settings

    assert Settings.from_env({"TORCHHAL_SELECTION_TIMING": "Graph"}).selection_timing == "graph"
    assert Settings.from_env({}).selection_timing == "eager"
    with pytest.raises(Exception, match="TORCHHAL_SELECTION_TIMING='replay'"):
        Settings.from_env({"TORCHHAL_SELECTION_TIMING": "replay"})


@pytest.mark.parametrize("timing", ["eager", "graph"])
def test_selection_inside_a_callers_capture_measures_nothing_until_after_it(settings, tmp_path, timing):
    """The first call of a signature inside a caller's graph capture: timing would synchronise and
    invalidate the capture. The candidates go in priority order for that call, uncached and
    unmemoised, so the first call after the capture measures them."""
    import torch

    hal = _hal(settings, tmp_path, timing)
    adapter = hal.device("acme:0").adapter
    x = torch.randn(4, 4)
    before = telemetry.counts().get("torchhal.kernel.unmeasured_in_capture,op=timing_probe", 0)
    adapter.in_capture = True
    try:
        for _ in range(2):
            during = hal.kernels.select(OP, hal.device("acme:0"), x)
            assert during.provisional and during.timings_ms == ()
            assert "provisional: priority order" in during.explain()
            assert during.candidate.qualified_name == HOST_HEAVY  # the higher priority
            torch.testing.assert_close(hal.kernels.call(OP, hal.device("acme:0"), x), x * 2)
    finally:
        adapter.in_capture = False
    assert telemetry.counts()["torchhal.kernel.unmeasured_in_capture,op=timing_probe"] == before + 4
    after = hal.kernels.select(OP, hal.device("acme:0"), x)
    assert not after.provisional and dict(after.timings_ms).keys() == {HOST_HEAVY, DEVICE_HEAVY}


def test_inside_a_capture_a_remembered_winner_is_used(settings, tmp_path):
    """Recalling a winner reads a file, which a capture allows: the graph gets the measured
    winner, and that selection is cached like any other."""
    import torch

    measured = _select(_hal(settings, tmp_path, "eager"))
    assert measured.candidate.qualified_name == DEVICE_HEAVY and measured.timings_ms
    hal = _hal(settings, tmp_path, "eager")
    adapter = hal.device("acme:0").adapter
    adapter.in_capture = True
    try:
        during = _select(hal)
    finally:
        adapter.in_capture = False
    assert during.candidate.qualified_name == DEVICE_HEAVY and not during.provisional
    assert hal.kernels.select(OP, hal.device("acme:0"), torch.randn(4, 4)) is during
