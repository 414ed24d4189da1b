"""hal_core.LiveProbe and torch_properties: what every vendor probe reads from a torch device
module, on a stand-in module (the real ones need their hardware; the adapters' recorded tests
replay what those answered)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import pytest
import torch

from torchhal.hal_core import LiveProbe
from torchhal.hal_core.live import torch_properties

RAW_UUID = bytes(range(16))


class _CudaUuid:
    """What torch.cuda gives: an object whose str() is the canonical text."""

    def __str__(self) -> str:
        return "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


class _Properties:
    def __init__(self, device_uuid: object) -> None:
        self.name = "Stand-in"
        self.total_memory = 123
        self.is_integrated = False
        self.clock_ghz = 1.5
        self.sub_group_sizes = (8, 16, 32)
        self.uuid = device_uuid
        self.nested = object()  # not JSON: left out
        self._private = 1


@pytest.mark.parametrize(
    ("device_uuid", "text"),
    [
        (RAW_UUID, str(uuid.UUID(bytes=RAW_UUID))),  # XPU: 16 raw bytes
        (list(RAW_UUID), str(uuid.UUID(bytes=RAW_UUID))),  # as some torch releases list them
        (_CudaUuid(), "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"),
    ],
)
def test_properties_keep_json_values_and_the_uuid_as_text(device_uuid, text):
    assert torch_properties(_Properties(device_uuid)) == {
        "name": "Stand-in",
        "total_memory": 123,
        "is_integrated": False,
        "clock_ghz": 1.5,
        "sub_group_sizes": [8, 16, 32],
        "uuid": text,
    }


class _DeviceModule:
    """A torch device module (torch.cuda, torch.xpu) reduced to what LiveProbe reads."""

    def __init__(self, *, peer_query: bool) -> None:
        if peer_query:
            self.can_device_access_peer = lambda index, peer: (index, peer) == (0, 1)

    def mem_get_info(self, index: int) -> tuple[int, int]:
        return 100 + index, 1000

    def memory_allocated(self, index: int) -> int:
        return 7


@pytest.mark.parametrize("peer_query", [True, False])
def test_live_probe_reads_the_named_torch_module(monkeypatch, peer_query):
    monkeypatch.setattr(torch, "standin", _DeviceModule(peer_query=peer_query), raising=False)

    class StandinProbe(LiveProbe):
        DEVICE_MODULE = "standin"

    probe = StandinProbe()
    assert probe.memory(1) == {"free": 101, "total": 1000, "allocated": 7}
    # a torch release without the peer query reports no peer access rather than failing
    assert probe.can_access_peer(0, 1) is peer_query
    assert probe.can_access_peer(1, 0) is False


def test_a_module_without_graph_queries_captures_none(monkeypatch):
    """A device module without is_current_stream_capturing is never capturing; one without
    CUDAGraph and graph cannot capture: NotImplementedError, which measured selection's graph
    timing relies on the graphs feature to avoid."""
    monkeypatch.setattr(torch, "standin", _DeviceModule(peer_query=False), raising=False)

    class StandinProbe(LiveProbe):
        DEVICE_MODULE = "standin"

    probe = StandinProbe()
    assert probe.capturing(0) is False
    with pytest.raises(NotImplementedError, match=r"torch\.standin captures no graphs"):
        probe.graph_replay(0, lambda: None)


class _Stream:
    def wait_stream(self, other: object) -> None:
        pass


class _GraphModule:
    """A device module with graphs whose capture fails at its end, as torch's does when the
    captured work synchronised: its context leaves its own stream current."""

    def __init__(self) -> None:
        self.current = self.caller = _Stream()
        self.captured_on: list[object] = []

    def device(self, index: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def current_stream(self) -> _Stream:
        return self.current

    def set_stream(self, stream: _Stream) -> None:
        self.current = stream

    Stream = _Stream

    @contextlib.contextmanager
    def stream(self, stream: _Stream) -> Iterator[None]:
        saved, self.current = self.current, stream
        yield
        self.current = saved

    class XGraph:
        def replay(self) -> None:
            pass

    @contextlib.contextmanager
    def graph(self, graph: object, stream: _Stream) -> Iterator[None]:
        self.captured_on.append(stream)
        self.current = stream  # torch enters its stream context, then capture_end raises
        yield
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_restores_the_callers_stream(monkeypatch):
    module = _GraphModule()
    monkeypatch.setattr(torch, "standin", module, raising=False)

    class StandinProbe(LiveProbe):
        DEVICE_MODULE = "standin"
        GRAPH_CLASS = "XGraph"

    with pytest.raises(RuntimeError, match="capturing"):
        StandinProbe().graph_replay(0, lambda: None)
    assert module.current is module.caller
    assert module.captured_on and module.captured_on[0] is not module.caller  # on its own side stream
