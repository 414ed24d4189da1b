"""An op's backward runs through the HAL and device its forward ran on (the `hal.use(device)`
block active at the forward), wherever autograd runs it: on the thread that calls `backward()`
after the block ended, or on another thread, as autograd runs a CUDA or XPU backward on the
device's own thread, where the block (a context variable) is not active. Before, those backward
ops went through the default HAL: its settings, its kernels, and for a simulated ASIC's tensors
the CPU device."""

from __future__ import annotations

import contextvars
import threading

import pytest
import torch

import torchhal
from tests.kernels.recorded_op import recording_hal
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core.settings import Settings
from torchhal.kernels import rms_norm


@pytest.fixture
def recorder():
    return recording_hal("rms_norm_backward")


def _in_another_thread(run) -> None:
    """`run` on a new thread in an empty context, as autograd's device threads run (a new thread
    starts with one up to Python 3.13; free-threaded 3.14 builds may inherit the caller's)."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            contextvars.Context().run(run)
        except BaseException as error:  # re-raised below, in the test's thread
            errors.append(error)

    thread = threading.Thread(target=target, name="autograd-like")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("where", ["after the block", "another thread"])
def test_the_backward_runs_on_the_hal_of_the_forward(recorder, where):
    hal, recorded = recorder
    x = torch.randn(7, 96, requires_grad=True)
    weight = torch.randn(96, requires_grad=True)
    grad = torch.randn(7, 96)
    with hal.use("cpu"):
        out = torchhal.ops.rms_norm(x, weight)
        if where == "another thread":
            _in_another_thread(lambda: out.backward(grad))
    if where == "after the block":
        out.backward(grad)
    assert recorded.calls == ["autograd-like" if where == "another thread" else "MainThread"]
    x_ref, weight_ref = x.detach().requires_grad_(), weight.detach().requires_grad_()
    rms_norm.reference(x_ref, weight_ref).backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(weight.grad, weight_ref.grad)


def test_a_backward_inside_another_block_still_runs_where_its_forward_ran(recorder):
    """The forward's HAL, not the one active where backward() is called: the backward kernel
    goes with the forward's choices (the statistics it saved, its settings)."""
    hal, recorded = recorder
    other = HardwareAbstractionLayer(settings=Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"}))
    x = torch.randn(5, 64, requires_grad=True)
    with hal.use("cpu"):
        out = torchhal.ops.rms_norm(x, torch.randn(64))
    with other.use("cpu"):
        out.sum().backward()
    assert len(recorded.calls) == 1


def test_a_forward_outside_any_block_keeps_its_backward_out_of_one(recorder):
    """A forward on the default HAL: a backward called inside a block of another HAL still goes
    through the default one, not the block's."""
    hal, recorded = recorder
    x = torch.randn(5, 64, requires_grad=True)
    out = torchhal.ops.rms_norm(x, torch.randn(64))
    with hal.use("cpu"):
        out.sum().backward()
    assert recorded.calls == []
    assert x.grad is not None


def test_a_simulated_asics_backward_called_after_its_block_runs_on_the_asic():
    """Its tensors live on the CPU: without the forward's block, the backward ran on the CPU device."""
    hal = HardwareAbstractionLayer(settings=Settings.from_env({"TORCHHAL_PLUGINS": "simasic"}))
    x = torch.randn(8, 64, requires_grad=True)
    with hal.use("simasic:0"):
        out = torchhal.ops.rms_norm(x, torch.randn(64))
    out.sum().backward()
    ran_on = {device for device, _ in hal.kernels._cache["rms_norm_backward"]}
    assert ran_on == {"simasic:0"}
    assert x.grad is not None and torch.isfinite(x.grad).all()
