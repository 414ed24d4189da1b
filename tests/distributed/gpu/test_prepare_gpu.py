"""On one GPU: a `prepare` that fails leaves a model made on the host where it was, its parameters'
values and objects intact: a move that runs out of the GPU's memory halfway (the device's memory
capped below the model's size), and a DDP wrap whose optimizer factory raises after the move."""

from __future__ import annotations

import gc
from datetime import timedelta

import pytest
import torch
from torch import nn

from tests.distributed.conftest import world_of_one
from torchhal import HardwareAbstractionLayer
from torchhal import distributed as thd
from torchhal.hal_core.settings import Settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def gpu_ctx(tmp_path, monkeypatch):
    """A world of one rank on cuda:0, shut down after."""
    hal = HardwareAbstractionLayer(settings=Settings.from_env({}))
    yield from world_of_one(hal, "cuda:0", tmp_path, monkeypatch, timedelta(seconds=60))


def host_model(layers: int, width: int) -> nn.Module:
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    model.register_buffer("scale", torch.randn(width))
    return model


def snapshot(model: nn.Module) -> tuple[list[nn.Parameter], dict[str, torch.Tensor]]:
    return list(model.parameters()), {n: t.detach().clone() for n, t in model.state_dict().items()}


def assert_on_host_as_before(
    model: nn.Module, params: list[nn.Parameter], before: dict[str, torch.Tensor]
) -> None:
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert after[name].device.type == "cpu", name
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=0, msg=name)


def test_a_move_that_runs_out_of_gpu_memory_halfway_is_put_back(gpu_ctx):
    gc.collect()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    # the cap applies to new segments only: free blocks inside segments that earlier tests left
    # partly in use (empty_cache cannot return those) take weights first, so the model is made
    # larger than them by 1.5 GiB, and 1 GiB of new segments is allowed
    cached_free = torch.cuda.memory_reserved() - start
    layer = 4096 * 4096 * 4  # 64 MiB of fp32 weights
    model = host_model(24 + -(-cached_free // layer), 4096)
    params, before = snapshot(model)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 2**30) / total, 0)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            thd.prepare(model, lambda p: torch.optim.SGD(p, lr=0.1), ctx=gpu_ctx, strategy="ddp")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    assert_on_host_as_before(model, params, before)
    gc.collect()  # the error's frames, which may hold the last moved weight
    assert torch.cuda.memory_allocated() <= start  # nothing of the model stays on the GPU


def test_a_ddp_wrap_whose_optimizer_factory_raises_puts_the_model_back_on_the_host(gpu_ctx):
    model = host_model(3, 256)
    params, before = snapshot(model)

    def factory(parameters):
        raise ValueError("the optimizer factory failed (on purpose, in this test)")

    with pytest.raises(ValueError, match="on purpose"):
        thd.prepare(model, factory, ctx=gpu_ctx, strategy="ddp")
    assert_on_host_as_before(model, params, before)
    prepared = thd.prepare(model, lambda p: torch.optim.SGD(p, lr=0.1), ctx=gpu_ctx, strategy="ddp")
    assert all(p.is_cuda for p in prepared.model.parameters())
    x = torch.randn(8, 256, device="cuda")
    reference = host_model(3, 256).cuda()
    reference.load_state_dict(before)
    reference(x).square().sum().backward()
    prepared.model(x).square().sum().backward()  # the failed wrap's DDP left no hook that fires
    for (name, p), q in zip(prepared.model.module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
