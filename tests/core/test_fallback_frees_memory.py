"""What a failing kernel held is freed when its error is handled, without the garbage collector.

`_fall_back` re-raised the kernel's error held in a local: the traceback then held the frame that
held the error, a cycle that kept every frame of the failed call (its tensors included) alive until
a collection. On a device that accounts memory, the usual "catch out-of-memory, retry smaller"
then ran out again on memory that nothing used.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import torch

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import DeviceOutOfMemoryError


@pytest.fixture
def hal(settings):
    return HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1"))


@pytest.fixture
def no_automatic_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _held_by_kernel(hal, error: Callable[[], Exception]) -> weakref.ref:
    """Register a top-priority rms_norm kernel that allocates a scratch tensor and raises a new
    `error()` (one made outside would hold its traceback, and so the kernel's frame, itself); call
    it; return a weak reference to the scratch."""
    held: list[weakref.ref] = []

    def failing(x, weight, eps=1e-6):
        scratch = torch.empty(1 << 16)
        held.append(weakref.ref(scratch))
        raise error()

    hal.kernels.register("rms_norm", "failing", failing, provider="test", priority=100)
    raised = None
    try:  # not pytest.raises: its ExceptionInfo keeps the traceback, and so the frames, alive
        hal.kernels.call("rms_norm", hal.device("cpu"), torch.randn(2, 4), torch.randn(4))
    except Exception as exc:
        raised = type(exc)
    assert raised is not None and issubclass(raised, MemoryError)
    return held[0]


def test_an_out_of_memory_kernels_tensors_are_freed_once_handled(hal, no_automatic_gc):
    scratch = _held_by_kernel(
        hal, lambda: DeviceOutOfMemoryError("cpu", requested=2**30, used=2**32, capacity=2**32)
    )
    assert scratch() is None, "the failed kernel's tensor outlived its handled error (a reference cycle)"


def test_a_failed_kernels_tensors_are_freed_after_the_fallback_ran(hal, no_automatic_gc):
    held: list[weakref.ref] = []

    def failing(x, weight, eps=1e-6):
        scratch = torch.empty(1 << 16)
        held.append(weakref.ref(scratch))
        raise RuntimeError("kernel broken")

    hal.kernels.register("rms_norm", "failing", failing, provider="test", priority=100)
    x = torch.randn(2, 4)
    assert (
        hal.kernels.call("rms_norm", hal.device("cpu"), x, torch.randn(4)).shape == x.shape
    )  # the reference
    assert held[0]() is None, "the failed kernel's tensor outlived the fallback (a reference cycle)"
