"""What the NVIDIA adapter's SDPA training pair must check itself, since it calls ATen's private
ops and not `scaled_dot_product_attention`: flash's head-dim multiple of 8 (SDPA pads to it) and
cuDNN's refusals under deterministic algorithms and for key/value length 1 (torch's sdp_utils.cpp).

On the CPU: the predicates are judged against a recorded H100, and the calls run on meta tensors,
where ATen's private ops go through their schemas and meta functions (the CUDA checks do not run:
a candidate that relied on them would pass here and fail, or silently misbehave, on the GPU)."""

from __future__ import annotations

import pytest
import torch
from torchhal_nvidia import sdpa
from torchhal_nvidia.adapter import NvidiaAdapter
from torchhal_nvidia.recorded import RecordedCudaProbe

from tests.plugins.facts import load
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import CallDeclined, RejectionReason
from torchhal.hal_core.settings import Settings

# no autotuning: it would time candidates with CUDA events on the recorded device
SETTINGS = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1", "TORCHHAL_AUTOTUNE": "off"})


def h100_hal() -> HardwareAbstractionLayer:
    """A HAL with one recorded H100 offering both SDPA backends (and no Triton)."""
    facts = load("nvidia-h100-sxm")
    facts["libraries"] = {"cudnn": 91900, "triton": False, "flash_attention": True}
    return HardwareAbstractionLayer(adapters=[NvidiaAdapter(RecordedCudaProbe(facts))], settings=SETTINGS)


def meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.bfloat16, device="meta")


@pytest.fixture
def restore_determinism():
    """Puts torch's deterministic-algorithms mode back as it was (it is process-global)."""
    was, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn_only)


# -- flash: the direct ATen calls take head dims that are multiples of 8 only ----------------------


@pytest.mark.parametrize("head_dim", [100, 36, 4, 255])
def test_flash_training_pair_declines_head_dims_aten_refuses_unpadded(head_dim):
    hal = h100_hal()
    caps = hal.device("cuda:0").capabilities
    q = torch.empty(1, 2, 16, head_dim, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 16)
    for op, args in (
        ("attention", (q, q, q)),
        ("attention_forward", (q, q, q)),
        ("attention_backward", (out, q, q, q, out, lse)),
    ):
        (flash,) = [c for c in hal.kernels.candidates(op) if c.qualified_name == "nvidia/sdpa_flash"]
        verdict = flash.supports(caps, hal.kernels.signature(op, *args))
        if op == "attention":  # through SDPA, which pads the head dim to a multiple of 8
            assert verdict is None
            continue
        assert verdict is not None, op
        assert verdict.reason is RejectionReason.SHAPE
        assert f"head dim {head_dim}" in verdict.detail and "multiples of 8" in verdict.detail


@pytest.mark.parametrize("head_dim", [8, 64, 96, 256])
def test_flash_training_pair_accepts_head_dims_that_are_multiples_of_8(head_dim):
    hal = h100_hal()
    caps = hal.device("cuda:0").capabilities
    q = torch.empty(1, 2, 16, head_dim, dtype=torch.bfloat16)
    (flash,) = [c for c in hal.kernels.candidates("attention_forward") if c.name == "sdpa_flash"]
    assert flash.supports(caps, hal.kernels.signature("attention_forward", q, q, q)) is None


# -- cuDNN: refused under deterministic algorithms and for key/value length 1 ------------------------


@pytest.mark.parametrize("warn_only", [False, True])
def test_cudnn_direct_calls_refuse_to_run_under_deterministic_algorithms(warn_only, restore_determinism):
    q = meta(1, 2, 16, 64)
    out, lse = sdpa.sdpa_cudnn_forward(q, q, q)  # allowed while the mode is off
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    for name, call in (
        ("sdpa_cudnn_forward", lambda: sdpa.sdpa_cudnn_forward(q, q, q)),
        ("sdpa_cudnn_backward", lambda: sdpa.sdpa_cudnn_backward(out, q, q, q, out, lse)),
    ):
        with pytest.raises(CallDeclined, match="not deterministic") as caught:
            call()
        assert str(caught.value).startswith(name)
        assert "are_deterministic_algorithms_enabled() is True" in str(caught.value)


def test_cudnn_direct_calls_refuse_a_key_value_length_of_1():
    q, k = meta(1, 2, 16, 64), meta(1, 2, 1, 64)
    out, lse = meta(1, 2, 16, 64), torch.empty(1, 2, 16, device="meta")
    with pytest.raises(CallDeclined, match="key/value sequence length other than 1, got 1"):
        sdpa.sdpa_cudnn_forward(q, k, k)
    with pytest.raises(CallDeclined, match="key/value sequence length other than 1, got 1"):
        sdpa.sdpa_cudnn_backward(out, q, k, k, out, lse)


def test_registry_leaves_cudnn_for_a_layout_it_chose_cudnn_for_before_deterministic_mode(restore_determinism):
    """The selection and the dispatch memo are made per signature and argument layout with the mode
    off; a later call of the same layout with it on must not run cuDNN."""
    hal = h100_hal()
    device = hal.device("cuda:0")
    q = meta(1, 2, 16, 64)
    assert hal.kernels.select("attention_forward", device, q, q, q).candidate.name == "sdpa_cudnn"
    hal.kernels.call("attention_forward", device, q, q, q)  # selected, memoised, ran: no fallback
    assert hal.kernels.fallback_counts == {}
    torch.use_deterministic_algorithms(True)
    for _ in range(2):  # declined by each call: cuDNN is not demoted
        out, lse = hal.kernels.call("attention_forward", device, q, q, q)
        assert (out.shape, lse.shape) == (q.shape, (1, 2, 16))
    assert hal.kernels.fallback_counts == {"attention_forward:nvidia/sdpa_cudnn": 2}
    torch.use_deterministic_algorithms(False)  # the mode off again: cuDNN serves the layout again
    hal.kernels.call("attention_forward", device, q, q, q)
    assert hal.kernels.fallback_counts == {"attention_forward:nvidia/sdpa_cudnn": 2}
    assert hal.kernels.select("attention_forward", device, q, q, q).candidate.name == "sdpa_cudnn"


def test_registry_falls_back_from_cudnn_for_a_key_value_length_of_1():
    hal = h100_hal()
    device = hal.device("cuda:0")
    q, k = meta(1, 2, 16, 64), meta(1, 2, 1, 64)
    assert hal.kernels.select("attention_forward", device, q, k, k).candidate.name == "sdpa_cudnn"
    out, _ = hal.kernels.call("attention_forward", device, q, k, k)
    assert out.shape == q.shape
    assert hal.kernels.fallback_counts == {"attention_forward:nvidia/sdpa_cudnn": 1}
    # the signature buckets key/value lengths: the next length of its bucket still gets cuDNN
    k8 = meta(1, 2, 8, 64)
    assert hal.kernels.select("attention_forward", device, q, k8, k8).candidate.name == "sdpa_cudnn"
    hal.kernels.call("attention_forward", device, q, k8, k8)
    assert hal.kernels.fallback_counts == {"attention_forward:nvidia/sdpa_cudnn": 1}
