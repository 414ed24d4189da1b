"""On a GPU, autograd runs the backward, and with it activation checkpointing's recompute, on the
device's own thread, where the `hal.use` block of the forward is not active: the recompute must
still go through the block's HAL (`torchhal.kernels.checkpoint`, and a patched Hugging Face
model's gradient checkpointing)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import torchhal
import torchhal.kernels
from tests.kernels.recorded_op import recording_hal
from torchhal.hal_core.settings import Settings
from torchhal.kernels import rms_norm

pytestmark = pytest.mark.gpu


@pytest.fixture
def recorder():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return recording_hal("rms_norm", Settings(autotune="off"))


def _block(x, weight):
    return torchhal.ops.rms_norm(torch.tanh(x), weight) * 1.5


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_the_recompute_on_the_devices_thread_runs_on_the_hal_of_the_forward(recorder, use_reentrant):
    hal, recorded = recorder
    x = torch.randn(64, 4096, device="cuda", requires_grad=True)
    weight = torch.randn(4096, device="cuda", requires_grad=True)
    grad = torch.randn(64, 4096, device="cuda")
    with hal.use("cuda:0"):
        out = torchhal.kernels.checkpoint(_block, x, weight, use_reentrant=use_reentrant)
        out.backward(grad)
    assert len(recorded.calls) == 2 and recorded.calls[0] == threading.current_thread().name
    assert recorded.calls[1] != recorded.calls[0]  # autograd's device thread: the case that needs it
    x_ref, weight_ref = x.detach().requires_grad_(), weight.detach().requires_grad_()
    (rms_norm.reference(torch.tanh(x_ref), weight_ref) * 1.5).backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(weight.grad, weight_ref.grad)


def test_a_patched_llamas_gradient_checkpointing_recomputes_on_the_hal_of_the_forward(recorder):
    transformers = pytest.importorskip("transformers", reason="needs transformers (pip install torchhal[hf])")
    hal, recorded = recorder
    layers = 2
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=128,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).cuda().train()
    torchhal.kernels.patch(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 512, (2, 64), device="cuda")
    with hal.use("cuda:0"):
        model(ids, labels=ids).loss.backward()
    forward, recompute = recorded.calls[: 2 * layers + 1], recorded.calls[2 * layers + 1 :]
    assert set(forward) == {threading.current_thread().name}
    assert len(recompute) == 2 * layers and threading.current_thread().name not in recompute


class KeywordDropout(torch.nn.Module):
    """A block with dropout whose tensor comes by keyword, as many transformer blocks take theirs
    (alone, or inside a tuple, as a Llama layer's `position_embeddings`)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.dropout = torch.nn.Linear(512, 512), torch.nn.Dropout(0.5)

    def forward(self, *, hidden: torch.Tensor | tuple[torch.Tensor]) -> torch.Tensor:
        x = hidden[0] if isinstance(hidden, tuple) else hidden
        return torch.tanh(self.dropout(self.linear(x)))


@pytest.mark.parametrize("nested", [False, True])
def test_a_checkpointed_blocks_dropout_recomputes_with_its_mask_when_its_tensor_comes_by_keyword(nested):
    """torch's checkpoint restores the random state of the devices of the tensors in its positional
    arguments only: bound into the function, a keyword tensor's GPU drew another mask in the
    recompute (a tensor in a tuple did until the twenty-seventh session)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torchhal.distributed.prepare import CheckpointedForward

    torch.manual_seed(0)
    plain = KeywordDropout().cuda()
    block = copy.deepcopy(plain)
    block.forward = CheckpointedForward(block)
    x = torch.randn(64, 512, device="cuda")
    grad = torch.randn(64, 512, device="cuda")
    for model in (plain, block):
        torch.cuda.manual_seed(7)
        model(hidden=(x,) if nested else x).backward(grad)
    for (name, p), q in zip(plain.named_parameters(), block.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m, name=name: f"{name}: {m}")
