"""LiveProbe: the base of the vendor probes that read a torch device module (torch.cuda, ...).

The live counterpart of RecordedProbe: the readings every such runtime answers the same way
(count, properties, peer access, memory) and the actions a replay refuses (synchronize, timing
events) live here once, as does `record_probe`, which writes the JSON a RecordedProbe replays.
Subclasses name `DEVICE_MODULE` and add their build facts, libraries and management-library
readers. Torch is imported on first use, never when this module is.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any, ClassVar


def torch_properties(props: object) -> dict[str, Any]:
    """A torch device-properties object as a JSON-able dict, under torch's own field names."""
    out: dict[str, Any] = {}
    for key in dir(props):
        if key.startswith("_"):
            continue
        value = getattr(props, key)
        if key == "uuid":  # CUDA: a _CUuuid, whose str() is canonical; XPU: its 16 raw bytes
            raw = isinstance(value, (bytes, list))
            out[key] = str(uuid.UUID(bytes=bytes(value))) if raw else str(value)
        elif isinstance(value, (bool, int, float, str)):
            out[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
            out[key] = list(value)  # e.g. XPU's sub-group sizes
    return out


class LiveProbe:
    DEVICE_MODULE: ClassVar[str]  # the torch attribute this vendor's runtime answers through
    GRAPH_CLASS: ClassVar[str | None] = None  # its graph class (CUDAGraph, XPUGraph); None: no graphs
    # "thread_local": other threads' unsafe calls stay legal during a capture (torch.xpu.graph
    # takes no mode: None)
    CAPTURE_ERROR_MODE: ClassVar[str | None] = None

    def _torch_device(self) -> Any:
        import torch

        return getattr(torch, self.DEVICE_MODULE)

    def available(self) -> bool:
        return bool(self._torch_device().is_available())

    def device_count(self) -> int:
        return int(self._torch_device().device_count())

    def properties(self, index: int) -> dict[str, Any]:
        return torch_properties(self._torch_device().get_device_properties(index))

    def can_access_peer(self, index: int, peer: int) -> bool:
        """Peer access as torch reports it; a torch release without the query reports none."""
        query = getattr(self._torch_device(), "can_device_access_peer", None)
        return bool(query(index, peer)) if query is not None else False

    def memory(self, index: int) -> dict[str, int]:
        """Device-wide free and total bytes, and this process's live allocations (not the allocator cache)."""
        module = self._torch_device()
        free, total = module.mem_get_info(index)
        return {"free": int(free), "total": int(total), "allocated": int(module.memory_allocated(index))}

    # -- actions on the device (not facts; a recorded probe refuses them) -------------------
    def synchronize(self, index: int) -> None:
        self._torch_device().synchronize(index)

    def record_event(self, index: int) -> Any:
        """A timing event recorded on the device's current stream."""
        module = self._torch_device()
        event = module.Event(enable_timing=True)
        event.record(module.current_stream(index))
        return event

    def capturing(self, index: int) -> bool:
        """Whether device `index`'s current stream is capturing a graph (a runtime without the
        query captures none)."""
        module = self._torch_device()
        query = getattr(module, "is_current_stream_capturing", None)
        if query is None:
            return False
        with module.device(index):
            return bool(query())

    def graph_replay(self, index: int, work: Callable[[], object]) -> Callable[[], None]:
        """`work`'s device work captured once as a graph on device `index`, and the graph's replay
        (`GRAPH_CLASS` of the device module: torch.cuda's CUDA graphs, HIP on ROCm builds;
        torch.xpu's). Run once on a side stream first, as capture requires (lazy initialisation
        stays out of the graph), then captured on that stream, on device `index` whichever device
        is current (torch's default capture stream belongs to the device current at its first
        capture), in `CAPTURE_ERROR_MODE`. A capture that fails leaves torch's capture stream
        current: the caller's is restored. A runtime without graphs raises NotImplementedError.
        torch's capture synchronises the device and empties its allocator's cache first."""
        module = self._torch_device()
        graph_type = getattr(module, self.GRAPH_CLASS, None) if self.GRAPH_CLASS else None
        capture = getattr(module, "graph", None)
        if graph_type is None or capture is None:
            raise NotImplementedError(f"torch.{self.DEVICE_MODULE} captures no graphs")
        with module.device(index):
            caller = module.current_stream()
            side = module.Stream()
            side.wait_stream(caller)
            with module.stream(side):
                work()
            graph = graph_type()
            mode = {} if self.CAPTURE_ERROR_MODE is None else {"capture_error_mode": self.CAPTURE_ERROR_MODE}
            try:
                with capture(graph, stream=side, **mode):
                    work()
            finally:
                module.set_stream(caller)
        return graph.replay  # type: ignore[no-any-return]


def record_probe(
    probe: Any,
    source: str,
    *,
    system: Mapping[str, Callable[[], Any]] | None = None,
    device: Mapping[str, Callable[[int], Any]] | None = None,
) -> dict[str, Any]:
    """Every fact `probe` reports, in the shape RecordedProbe replays; `system` and `device` add
    a vendor's own readers under their keys (e.g. its management library's)."""
    facts: dict[str, Any] = {"source": source, "runtime": probe.runtime(), "available": probe.available()}
    if not facts["available"]:
        return facts
    count = probe.device_count()
    facts["libraries"] = probe.libraries()
    facts.update({key: read() for key, read in (system or {}).items()})
    facts["devices"] = [
        {
            "properties": probe.properties(i),
            "memory": probe.memory(i),
            **{key: read(i) for key, read in (device or {}).items()},
        }
        for i in range(count)
    ]
    facts["peer_access"] = [
        [i, j] for i in range(count) for j in range(count) if i != j and probe.can_access_peer(i, j)
    ]
    return facts
