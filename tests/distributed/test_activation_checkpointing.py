"""prepare(activation_checkpointing=True) in one process (a world of one over gloo): each block
keeps only its inputs in forward and runs again in backward, under every strategy, training to
the same parameters as without it; the recompute runs through the HAL the forward ran on."""

from __future__ import annotations

import copy
import pickle
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed.test_grad_accumulation import DIM, assert_same_parameters, micro_batches, sgd
from tests.kernels.test_backward_follows_forward import _in_another_thread
from torchhal import distributed as thd
from torchhal.distributed.prepare import CheckpointedForward
from torchhal.hal_core import InvalidArgumentError, telemetry
from torchhal.hal_core.hal import active_use

WIDTH = 4 * DIM


class Block(nn.Module):
    """An MLP block that counts its forwards and records the `hal.use` block each ran under."""

    def __init__(self, record: bool = True) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, WIDTH), nn.Linear(WIDTH, DIM)
        self.uses: list[object] | None = [] if record else None  # a context variable: no torch.compile

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        if self.uses is not None:
            self.uses.append(active_use())
        return x + scale * self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self, record: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(record) for _ in range(3))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, scale=0.5)
        return F.mse_loss(self.head(x).squeeze(-1), y)


def _inner(prepared: thd.Prepared) -> nn.Module:
    return prepared.model.module if prepared.strategy == "ddp" else prepared.model


@pytest.mark.parametrize("strategy", ["local", "ddp", "fsdp"])
def test_checkpointed_blocks_train_to_the_same_parameters_and_run_twice(ctx, strategy):
    torch.manual_seed(random.randrange(2**31))
    model = Net()
    plain = copy.deepcopy(model)
    data = micro_batches(3, 1, 16)
    checkpointed = thd.prepare(model, sgd, ctx=ctx, strategy=strategy, activation_checkpointing=True)
    reference = thd.prepare(plain, sgd, ctx=ctx, strategy=strategy)
    assert checkpointed.checkpointed_blocks == 3 and checkpointed.report()["checkpointed_blocks"] == 3
    assert reference.checkpointed_blocks == 0
    for prepared in (checkpointed, reference):
        thd.train(prepared.model, prepared.optimizer, data, steps=3, ctx=ctx, policy=prepared.policy)
    assert_same_parameters(_inner(checkpointed), _inner(reference))
    assert [len(b.uses) for b in _inner(checkpointed).layers] == [6] * 3  # forward and recompute
    assert [len(b.uses) for b in _inner(reference).layers] == [3] * 3
    assert set(_inner(checkpointed).layers[0].uses) == {(ctx.hal, ctx.device)}


def test_checkpointing_keeps_only_the_blocks_inputs():
    """What autograd saves in forward: the checkpointed blocks save nothing of their own (their
    inputs are the previous block's outputs, which torch's checkpoint keeps)."""
    torch.manual_seed(0)
    model, x, y = Net(), torch.randn(32, DIM), torch.randn(32)
    plain_bytes = _saved_bytes(model, x, y)
    for block in model.layers:
        block.forward = CheckpointedForward(block)
    checkpointed_bytes = _saved_bytes(model, x, y)
    per_block_activation = 32 * WIDTH * 4  # the (rows, WIDTH) fp32 tanh input, output: at least one
    assert plain_bytes - checkpointed_bytes >= 3 * per_block_activation


def _saved_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)
    return sum(saved)


def test_the_recompute_runs_on_the_hal_of_the_forward_on_another_thread(ctx):
    """As autograd runs a GPU's backward on the device's own thread, where the forward's
    `hal.use` block is not active."""
    prepared = thd.prepare(Net(), sgd, ctx=ctx, strategy="local", activation_checkpointing=True)
    x, y = torch.randn(8, DIM), torch.randn(8)
    with ctx.hal.use(ctx.device):
        loss = prepared.model(x, y)
    _in_another_thread(loss.backward)
    assert [b.uses for b in prepared.model.layers] == [[(ctx.hal, ctx.device)] * 2] * 3


def test_a_checkpointed_model_still_pickles(ctx):
    prepared = thd.prepare(Net(), sgd, ctx=ctx, strategy="local", activation_checkpointing=True)
    loaded = pickle.loads(pickle.dumps(prepared.model))
    x, y = torch.randn(8, DIM), torch.randn(8)
    torch.testing.assert_close(loaded(x, y), prepared.model(x, y))
    assert loaded.layers[1].forward.block is loaded.layers[1]


class Forwarded(Net):
    def __init__(self) -> None:
        super().__init__()
        self.layers[1].forward = lambda x, scale=1.0: x  # as accelerate's hooks replace it


class HFCheckpointed(Net):
    def __init__(self) -> None:
        super().__init__()
        self.layers[2].gradient_checkpointing = True  # as transformers' gradient_checkpointing_enable


@pytest.mark.parametrize(
    ("make", "blocks", "match"),
    [
        (lambda: nn.Sequential(nn.Linear(DIM, DIM)), None, r"no blocks to checkpoint"),
        (Net, lambda m: False, r"no blocks to checkpoint"),
        (Forwarded, None, r"block 'layers.1' already has a forward of its own on the instance \(function\)"),
        (HFCheckpointed, None, r"block 'layers.2' is already checkpointed by transformers"),
    ],
)
def test_what_cannot_be_checkpointed_is_refused_before_anything_changes(ctx, make, blocks, match):
    model = make()
    forwards = [vars(m).get("forward") for m in model.modules()]
    with pytest.raises(InvalidArgumentError, match=match):
        thd.prepare(model, sgd, ctx=ctx, strategy="fsdp", blocks=blocks, activation_checkpointing=True)
    assert [vars(m).get("forward") for m in model.modules()] == forwards
    assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())


def test_a_failed_prepare_leaves_the_blocks_as_they_were(ctx):
    """An optimizer factory that raises comes after the blocks were wrapped: a corrected retry
    must find them unwrapped (it was refused as 'already has a forward of its own')."""
    model = Net()

    def bad_optimizer(params):
        return torch.optim.Adam(params, lr=-1.0)

    with pytest.raises(ValueError, match="learning rate"):
        thd.prepare(model, bad_optimizer, ctx=ctx, strategy="local", activation_checkpointing=True)
    assert not any("forward" in vars(block) for block in model.layers)
    prepared = thd.prepare(model, sgd, ctx=ctx, strategy="local", activation_checkpointing=True)
    assert prepared.checkpointed_blocks == 3


def test_without_grad_the_blocks_run_as_they_are(ctx, monkeypatch):
    """Evaluation and generation record nothing to recompute: torch's checkpoint is not called."""
    prepared = thd.prepare(Net(), sgd, ctx=ctx, strategy="local", activation_checkpointing=True)

    def refused(*args, **kwargs):
        raise AssertionError("checkpoint called without grad")

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", refused)
    with torch.no_grad():
        prepared.model(torch.randn(4, DIM), torch.randn(4))
    assert [len(b.uses) for b in prepared.model.layers] == [1] * 3


class CachedBlock(Block):
    """A block that appends its input to a KV-cache-like list it is given, as attention layers do."""

    def forward(self, x, *, past_key_values=None, use_cache=False, scale=1.0):  # type: ignore[override]
        if past_key_values is not None:
            past_key_values.append(x.detach())
        self.seen = (past_key_values, use_cache)
        return super().forward(x, scale=scale)


class CachedNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CachedBlock() for _ in range(2))

    def forward(self, x, y, cache=None):  # type: ignore[override]
        for layer in self.layers:
            x = layer(x, past_key_values=cache, use_cache=cache is not None)
        return F.mse_loss(self.head(x).squeeze(-1), y)


def test_a_kv_cache_given_to_a_checkpointed_block_is_dropped_and_said(ctx):
    """The recompute would append the keys again (a patched Hugging Face model then failed its
    backward with a CheckpointError, an unpatched one doubled its cache silently)."""
    prepared = thd.prepare(CachedNet(), sgd, ctx=ctx, strategy="local", activation_checkpointing=True)
    cache: list[torch.Tensor] = []
    counter = "torchhal.distributed.checkpointed_cache_dropped,block=CachedBlock"
    before = telemetry.counts().get(counter, 0)
    prepared.model(torch.randn(4, DIM), torch.randn(4), cache).backward()
    assert cache == []
    assert all(block.seen == (None, False) for block in prepared.model.layers)
    assert telemetry.counts()[counter] == before + 2  # one call per block: the recompute gets None
    with torch.no_grad():  # nothing recomputed: the cache is the caller's to fill
        prepared.model(torch.randn(4, DIM), torch.randn(4), cache)
    assert len(cache) == 2


def test_torch_compile_traces_a_checkpointed_model_in_one_graph(ctx):
    """keeping_use steps aside while Dynamo traces: its context variable was a graph break per block."""
    torch.manual_seed(3)
    model = Net(record=False)
    plain = copy.deepcopy(model)
    prepared = thd.prepare(model, sgd, ctx=ctx, strategy="local", activation_checkpointing=True)
    compiled = torch.compile(prepared.model, fullgraph=True, backend="aot_eager")
    x, y = torch.randn(8, DIM), torch.randn(8)
    compiled(x, y).backward()
    plain(x, y).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")
