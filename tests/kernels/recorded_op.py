"""A kernel plugin that records which HAL ran an op, and on which thread: the tests of where
backward and recompute run (a HAL of the test's own, its candidate above every other)."""

from __future__ import annotations

import threading

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import hookimpl
from torchhal.hal_core.settings import Settings


class RecordedOp:
    """Registers a candidate for `op` that computes the reference's numbers and appends the name of
    the calling thread to `calls`."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.calls: list[str] = []

    @hookimpl
    def torchhal_register_kernels(self, registry) -> None:
        reference = registry.op(self.op).reference

        def recorded(*args):
            self.calls.append(threading.current_thread().name)
            return reference(*args)

        registry.register(self.op, "recorded", recorded, provider="test", priority=1e9)


def recording_hal(op: str, settings: Settings | None = None) -> tuple[HardwareAbstractionLayer, RecordedOp]:
    """A HAL whose `op` is recorded; by default with no plugin but the recorder (the CPU device)."""
    recorder = RecordedOp(op)
    settings = settings or Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    return HardwareAbstractionLayer(plugins=[recorder], settings=settings), recorder
