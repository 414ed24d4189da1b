"""A `prepare` that fails leaves the model as it found it: each parameter, gradient and buffer
where it was (a move that ran out of device memory halfway, a DDP wrap or an optimizer factory
that raised), no checkpointed forward left on a block; a model FSDP2 had already sharded, which
cannot be undone, is said to be so (logged, counted). A world of one over gloo; the move to a GPU
itself is in tests/distributed/gpu/test_prepare_gpu.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed.test_single_rank import Net, adamw, batches
from torchhal import distributed as thd
from torchhal.distributed.prepare import Placement
from torchhal.hal_core import telemetry


class FactoryError(RuntimeError):
    pass


def failing_factory(params):
    raise FactoryError("the optimizer factory failed (on purpose, in this test)")


def with_state(model: nn.Module) -> nn.Module:
    """Gradients on every parameter and a BatchNorm's running statistics, all of them random."""
    model.norm = nn.BatchNorm1d(10)
    model.norm.train()(torch.randn(8, 10) * 3 + 1)
    model(*batches(1)[0]).backward()
    return model


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    tensors = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    tensors |= {f"grad {n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return tensors | {f"buffer {n}": b.clone() for n, b in model.named_buffers()}


def assert_as_before(model: nn.Module, before: dict[str, torch.Tensor], params: list[nn.Parameter]) -> None:
    # the same Parameter objects: an optimizer made on them still holds them
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert after[name].device == tensor.device, name
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=0, msg=name)


def test_placement_puts_back_every_tensor_a_move_changed():
    model = with_state(Net())
    before, params = snapshot(model), list(model.parameters())
    placement = Placement.of(model)
    model.to("meta")  # a move that loses the data: only the kept tensors can put it back
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    assert placement.restore() == len(params) + len(list(model.buffers()))  # each moved tensor, counted
    assert_as_before(model, before, params)


@pytest.mark.parametrize("strategy", ["ddp", "local"])
def test_a_failing_optimizer_factory_leaves_the_model_as_it_was(ctx, strategy):
    model = with_state(Net())
    before, params = snapshot(model), list(model.parameters())
    with pytest.raises(FactoryError):
        thd.prepare(model, failing_factory, ctx=ctx, strategy=strategy, activation_checkpointing=True)
    assert_as_before(model, before, params)
    assert not any("forward" in vars(block) for block in model.layers)
    prepared = thd.prepare(model, adamw, ctx=ctx, strategy=strategy, activation_checkpointing=True)
    assert prepared.checkpointed_blocks == 2
    x, y = batches(1)[0]
    prepared.model(x, y).backward()  # the failed wrap's DDP left no hook that fires
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.layers.parameters())


class FailsHalfway(Net):
    """A model whose move runs out of memory after its first block moved, as a move to a GPU too
    small for it does (here the first block goes to the meta device, where its data is gone)."""

    def to(self, *args, **kwargs):
        self.layers[0].to("meta")
        raise torch.OutOfMemoryError("out of memory (raised on purpose, in this test)")


def test_a_move_that_fails_halfway_is_put_back(ctx):
    model = with_state(FailsHalfway())
    before, params = snapshot(model), list(model.parameters())
    with pytest.raises(torch.OutOfMemoryError, match="on purpose"):
        thd.prepare(model, adamw, ctx=ctx, strategy="ddp")
    assert_as_before(model, before, params)


def test_a_failure_after_fsdp_sharded_the_model_is_said_and_counted(ctx):
    key = "torchhal.distributed.prepare_failed_sharded"
    before = telemetry.counts().get(key, 0)
    with pytest.raises(FactoryError):
        thd.prepare(Net(depth=3), failing_factory, ctx=ctx, strategy="fsdp")
    assert telemetry.counts().get(key, 0) == before + 1
