"""Activation checkpointing recomputes through the HAL and device of the forward (the `hal.use`
block active at it), wherever autograd runs the recompute: after the block on the caller's
thread, or on another thread, as autograd runs a CUDA or XPU backward on the device's own
thread. With torch.utils.checkpoint alone the recomputed forward went through the default HAL,
and a simulated ASIC's recompute ran on the CPU device."""

from __future__ import annotations

import io

import pytest
import torch

import torchhal
import torchhal.kernels
from tests.kernels.recorded_op import recording_hal
from tests.kernels.test_backward_follows_forward import _in_another_thread
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core.settings import Settings
from torchhal.kernels import rms_norm


@pytest.fixture
def recorder():
    return recording_hal("rms_norm")


def _block(x, weight):
    return torchhal.ops.rms_norm(torch.tanh(x), weight) * 1.5


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("where", ["after the block", "another thread"])
def test_the_recompute_runs_on_the_hal_of_the_forward(recorder, where, use_reentrant):
    hal, recorded = recorder
    x = torch.randn(9, 80, requires_grad=True)
    weight = torch.randn(80, requires_grad=True)
    grad = torch.randn(9, 80)
    with hal.use("cpu"):
        out = torchhal.kernels.checkpoint(_block, x, weight, use_reentrant=use_reentrant)
        if where == "another thread":
            _in_another_thread(lambda: out.backward(grad))
    if where == "after the block":
        out.backward(grad)
    thread = "autograd-like" if where == "another thread" else "MainThread"
    assert recorded.calls == ["MainThread", thread]  # the forward, then its recompute
    x_ref, weight_ref = x.detach().requires_grad_(), weight.detach().requires_grad_()
    (rms_norm.reference(torch.tanh(x_ref), weight_ref) * 1.5).backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(weight.grad, weight_ref.grad)


def test_keywords_reach_torchs_checkpoint(recorder):
    """determinism_check and the like are torch's, passed through; the default is non-reentrant."""
    hal, recorded = recorder
    x = torch.randn(4, 32, requires_grad=True)
    with hal.use("cpu"):
        out = torchhal.kernels.checkpoint(_block, x, torch.randn(32), determinism_check="none")
    out.sum().backward()
    assert recorded.calls == ["MainThread", "MainThread"]
    with pytest.raises(ValueError, match="determinism_check"):
        torchhal.kernels.checkpoint(_block, x, torch.randn(32), determinism_check="sometimes")


def test_a_simulated_asics_recompute_runs_on_the_asic():
    """Its tensors live on the CPU: without the forward's block, the recompute ran on the CPU device
    and the ASIC's clock was not charged for it. The cost model is deterministic: the checkpointed
    backward costs the plain backward plus one forward."""
    hal = HardwareAbstractionLayer(settings=Settings.from_env({"TORCHHAL_PLUGINS": "simasic"}))
    clock = hal.device("simasic:0").adapter.state(0).clock
    x, weight = torch.randn(8, 64, requires_grad=True), torch.randn(64)

    def charged(run):
        before = clock.now()
        result = run()
        return clock.now() - before, result

    with hal.use("simasic:0"):
        forward, out = charged(lambda: _block(x, weight))
        _, checkpointed = charged(lambda: torchhal.kernels.checkpoint(_block, x, weight))
    backward, _ = charged(lambda: out.sum().backward())
    plain_grad, x.grad = x.grad, None
    recompute_and_backward, _ = charged(lambda: checkpointed.sum().backward())
    assert forward > 0 and backward > 0
    assert recompute_and_backward == pytest.approx(forward + backward, rel=1e-9)
    torch.testing.assert_close(x.grad, plain_grad)


transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face checkpointing tests need transformers (pip install torchhal[hf])"
)
from tests.kernels.test_patch import LAYERS, make_model  # noqa: E402


def _enable_checkpointing(model, use_reentrant: bool) -> None:
    """transformers 5.2x names it activation_checkpointing_enable; gradient_checkpointing_enable
    (4.57 and 5.0) is deprecated there."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


@pytest.mark.parametrize("enabled", ["before the patch", "after the patch"])
def test_a_patched_models_gradient_checkpointing_recomputes_on_the_hal_of_the_forward(recorder, enabled):
    hal, recorded = recorder
    model = make_model("llama")
    if enabled == "before the patch":
        _enable_checkpointing(model, use_reentrant=False)
    report = torchhal.kernels.patch(model)
    assert report.count("gradient_checkpointing") == 1
    if enabled == "after the patch":
        _enable_checkpointing(model, use_reentrant=False)
    ids = torch.randint(0, 128, (2, 11))
    with hal.use("cpu"):
        loss = model(ids, labels=ids).loss
    assert len(recorded.calls) == 2 * LAYERS + 1  # two norms per layer and the final one
    _in_another_thread(loss.backward)
    assert recorded.calls[2 * LAYERS + 1 :] == ["autograd-like"] * 2 * LAYERS
    again = torchhal.kernels.patch(model)
    assert [(x.kind, x.reason) for x in again.left if x.kind == "gradient_checkpointing"] == [
        ("gradient_checkpointing", "already patched")
    ]


def test_a_patched_model_with_checkpointing_still_pickles_whole(recorder):
    """The model's wrapped setter is an object, not a closure: `torch.save(model)` keeps working,
    and the loaded model recomputes on the block's HAL once checkpointing is enabled (transformers'
    own input hook makes a model with checkpointing enabled unpicklable, so it is enabled after)."""
    hal, recorded = recorder
    model = make_model("llama")
    torchhal.kernels.patch(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _enable_checkpointing(loaded, use_reentrant=True)
    ids = torch.randint(0, 128, (1, 7))
    with hal.use("cpu"):
        loss = loaded(ids, labels=ids).loss
    loss.backward()
    recomputed = recorded.calls[2 * LAYERS + 1 :]
    assert recomputed == ["MainThread"] * 2 * LAYERS


class Wrapped(torch.nn.Module):
    """A wrapper that forwards attribute lookups to the model it holds, as PEFT's PeftModel does."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.base = model

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.base, name)

    def forward(self, *args, **kwargs):
        return self.base(*args, **kwargs)


def test_a_wrapped_models_later_checkpointing_recomputes_on_the_hal_of_the_forward(recorder):
    """The setter found through the wrapper belongs to the model inside: it was left unwrapped and
    the patch reported "already patched"."""
    hal, recorded = recorder
    model = Wrapped(make_model("llama"))
    report = torchhal.kernels.patch(model)
    assert report.count("gradient_checkpointing") == 1
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 128, (2, 9))
    with hal.use("cpu"):
        loss = model(ids, labels=ids).loss
    _in_another_thread(loss.backward)
    assert recorded.calls[2 * LAYERS + 1 :] == ["autograd-like"] * 2 * LAYERS


def test_the_setters_default_function_is_wrapped_too(recorder):
    """`_set_gradient_checkpointing(enable=True)` without a function sets torch's checkpoint."""
    hal, recorded = recorder
    model = make_model("llama")
    torchhal.kernels.patch(model)
    model._set_gradient_checkpointing(enable=True)
    model.enable_input_require_grads()  # the default, torch's checkpoint, is reentrant
    ids = torch.randint(0, 128, (1, 7))
    with hal.use("cpu"):
        loss = model(ids, labels=ids).loss
    _in_another_thread(loss.backward)
    assert recorded.calls[2 * LAYERS + 1 :] == ["autograd-like"] * 2 * LAYERS
