"""train(gradient_accumulation_steps=k) in one process (a world of one over gloo): k micro-batches per
optimizer step give what one batch of them all gives under a mean loss. The multi-process checks
(DDP and FSDP2 reducing once per step) are in test_accumulation_multiprocess.py."""

from __future__ import annotations

import copy
import io
import random
import time
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module

from torchhal import distributed as thd
from torchhal.hal_core import InvalidArgumentError, telemetry

DIM = 9


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(self.head(x).squeeze(-1), y)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def micro_batches(steps: int, k: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(rows, DIM), torch.randn(rows)) for _ in range(steps * k)]


def concatenated(micro: list[tuple[torch.Tensor, ...]], k: int) -> list[tuple[torch.Tensor, ...]]:
    """Each step's k micro-batches as one batch of them all."""
    return [
        tuple(torch.cat(parts) for parts in zip(*micro[i : i + k], strict=True))
        for i in range(0, len(micro), k)
    ]


def run(ctx, model: nn.Module, data, steps: int, strategy: str, **options) -> tuple[nn.Module, list]:
    prepared = thd.prepare(model, sgd, ctx=ctx, strategy=strategy)
    stats = train_prepared(ctx, prepared, data, steps, **options)
    inner = prepared.model.module if strategy == "ddp" else prepared.model
    return inner, stats


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def train_until_batches_run_out(ctx, prepared: thd.Prepared, data, steps: int, k: int, match: str) -> None:
    """Train `steps` steps of `k` micro-batches over `data`, too few for them: it must stop
    with the error `match` describes."""
    train_raising(ctx, prepared, data, steps, InvalidArgumentError, match, gradient_accumulation_steps=k)


def train_raising(
    ctx, prepared: thd.Prepared, data, steps: int, error: type[BaseException], match: str, **options
) -> None:
    """Train `steps` steps over `data`: it must stop with `error`, its message matching `match`."""
    with pytest.raises(error, match=match):
        train_prepared(ctx, prepared, data, steps, **options)


def train_prepared(ctx, prepared: thd.Prepared, data, steps: int, **options) -> list[thd.StepStats]:
    """`thd.train` of a prepared model, optimizer and policy."""
    return thd.train(
        prepared.model, prepared.optimizer, data, steps=steps, ctx=ctx, policy=prepared.policy, **options
    )


def on_second_call(
    then: Callable[[nn.Module, torch.Tensor], torch.Tensor],
) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]:
    """A loss_fn that runs the model and, on its second call, returns `then(model, loss)`."""
    calls = []

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        calls.append(1)
        loss = model(*batch)
        return then(model, loss) if len(calls) == 2 else loss

    return loss_fn


@pytest.mark.parametrize("strategy", ["local", "ddp"])
def test_accumulated_micro_batches_equal_one_batch_of_them_all(ctx, strategy):
    steps, k, rows = 3, random.randint(2, 4), random.randint(2, 4)
    model = Net()
    micro = micro_batches(steps, k, rows)
    options = {"clip_grad_norm": 50.0}  # recorded before clipping: a loss not divided by k shows in it
    accumulated, stats = run(
        ctx, copy.deepcopy(model), micro, steps, strategy, gradient_accumulation_steps=k, **options
    )
    whole, reference = run(ctx, copy.deepcopy(model), concatenated(micro, k), steps, strategy, **options)
    assert_same_parameters(accumulated, whole)
    torch.testing.assert_close(
        [s.grad_norm for s in stats], [s.grad_norm for s in reference], rtol=1e-5, atol=1e-7
    )
    torch.testing.assert_close([s.loss for s in stats], [s.loss for s in reference], rtol=1e-6, atol=1e-7)
    # a floating (rows, DIM) batch counts its rows: one token a row, not each of its DIM features
    assert [s.tokens for s in stats] == [s.tokens for s in reference] == [k * rows] * steps
    assert [s.step for s in stats] == list(range(steps))


def test_grad_sync_runs_once_per_step_on_the_accumulated_gradient(ctx):
    """The explicit sync (heterogeneous runs) sees the mean gradient of the step's micro-batches."""
    steps, k = 2, 3
    model = Net()
    micro = micro_batches(steps, k, 2)
    seen: list[list[torch.Tensor]] = []

    def record(module: nn.Module) -> None:
        seen.append([p.grad.clone() for p in module.parameters()])

    run(ctx, copy.deepcopy(model), micro, steps, "local", grad_sync=record, gradient_accumulation_steps=k)
    expected: list[list[torch.Tensor]] = []
    run(
        ctx,
        copy.deepcopy(model),
        concatenated(micro, k),
        steps,
        "local",
        grad_sync=lambda m: expected.append([p.grad.clone() for p in m.parameters()]),
    )
    assert len(seen) == steps
    for got, want in zip(seen, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_the_gradient_scaler_scales_each_micro_batch_and_unscales_once(ctx):
    """A scaler with clipping: unscale_ twice in a step raises in torch, one micro-loss left
    unscaled gives a gradient off by the scale."""
    steps, k = 3, 2
    model = Net()
    micro = micro_batches(steps, k, 3)
    accumulated, stats = run(
        ctx,
        copy.deepcopy(model),
        micro,
        steps,
        "local",
        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10),
        clip_grad_norm=50.0,
        gradient_accumulation_steps=k,
    )
    whole, reference = run(
        ctx,
        copy.deepcopy(model),
        concatenated(micro, k),
        steps,
        "local",
        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10),
        clip_grad_norm=50.0,
    )
    assert_same_parameters(accumulated, whole)
    torch.testing.assert_close(
        [s.grad_norm for s in stats], [s.grad_norm for s in reference], rtol=1e-5, atol=1e-7
    )
    assert not any(s.scaler_skipped for s in stats)


def test_forward_time_covers_every_micro_batch(ctx):
    """forward_s (what the straggler check reads) sums the step's forwards."""
    k, pause = 3, 0.02

    def slow(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        time.sleep(pause)
        return model(*batch)

    _, stats = run(
        ctx, Net(), micro_batches(1, k, 2), 1, "local", loss_fn=slow, gradient_accumulation_steps=k
    )
    assert k * pause <= stats[0].forward_s < stats[0].step_time_s


def test_batches_running_out_mid_step_apply_nothing_of_that_step(ctx):
    steps, k = 3, 2
    model = Net()
    micro = micro_batches(steps, k, 2)[:-1]  # the last step is one micro-batch short
    prepared = thd.prepare(copy.deepcopy(model), sgd, ctx=ctx, strategy="local")
    train_until_batches_run_out(
        ctx,
        prepared,
        micro,
        steps,
        k,
        r"batches ran out after 2 of 3 steps \(gradient_accumulation_steps 2: this rank had 1 of them",
    )
    two_steps, _ = run(ctx, copy.deepcopy(model), micro[: 2 * k], 2, "local", gradient_accumulation_steps=k)
    assert_same_parameters(prepared.model, two_steps)
    assert all(p.grad is None for p in prepared.model.parameters())


def test_a_failing_micro_batch_leaves_no_gradient_behind(ctx):
    """The second micro-batch's loss is not a scalar: the first one's gradients must not stay in
    .grad, where the next train call would add them to its first step."""
    k = 3
    prepared = thd.prepare(Net(), sgd, ctx=ctx, strategy="ddp")
    before = [p.detach().clone() for p in prepared.model.parameters()]
    calls = []

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        calls.append(1)
        loss = model(*batch)
        return loss if len(calls) == 1 else loss.expand(2)

    with pytest.raises(
        InvalidArgumentError, match=r"the loss must be a scalar tensor, got a tensor of shape \(2,\)"
    ):
        thd.train(
            prepared.model,
            prepared.optimizer,
            micro_batches(1, k, 2),
            steps=1,
            ctx=ctx,
            policy=prepared.policy,
            loss_fn=loss_fn,
            gradient_accumulation_steps=k,
        )
    assert len(calls) == 2
    assert all(p.grad is None for p in prepared.model.parameters())
    for p, q in zip(prepared.model.parameters(), before, strict=True):
        assert torch.equal(p, q)


class Normed(Net):
    """Net after a BatchNorm, whose training forwards update its running statistics in place."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(DIM)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(x), y)


class LazyNormed(Net):
    """Net after a lazy BatchNorm, whose buffers exist from its first forward on."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LazyBatchNorm1d(affine=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(x), y)


class LazyNormedWithUnusedHead(LazyNormed):
    """LazyNormed with a second lazy BatchNorm that training never runs (an evaluation head):
    its buffers stay lazy for the whole call, the first one's do not."""

    def __init__(self) -> None:
        super().__init__()
        self.eval_head = nn.LazyBatchNorm1d(affine=False)


class Averaged(Net):
    """Net that keeps a moving average of its inputs in a buffer, assigned anew by each training
    forward (not updated in place, as BatchNorm's statistics are)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(DIM))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
        return super().forward(x - self.mean, y)


class SharedAverage(Net):
    """A moving average kept in a buffer that two modules share; the forward reassigns the
    submodule's slot only, which must be restored though the root's holds the same tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(DIM))
        self.sub = nn.Module()
        self.sub.register_buffer("mean", self.mean)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.sub.mean = 0.9 * self.sub.mean + 0.1 * x.mean(0)
        return super().forward(x - self.sub.mean, y)


class ScriptableNormed(nn.Module):
    """A BatchNorm model TorchScript compiles (its `_buffers` are a wrapper, not a dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.norm(x)).squeeze(-1), y)


def scripted() -> nn.Module:
    return torch.jit.script(ScriptableNormed())


def seeded(make: Callable[[], nn.Module], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return make()


def assert_same_buffers(a: nn.Module, b: nn.Module) -> None:
    """Bit for bit: a stopped step's buffers are restored from a copy, not recomputed."""

    def made(model: nn.Module) -> dict[str, torch.Tensor]:  # a lazy buffer has no value to compare
        return {name: b for name, b in model.named_buffers() if not nn.parameter.is_lazy(b)}

    torch.testing.assert_close(made(a), made(b), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("make", "strategy"),
    [
        (Normed, "local"),
        (Normed, "ddp"),
        (Averaged, "local"),
        (SharedAverage, "local"),
        (scripted, "local"),
        (LazyNormed, "local"),
        (LazyNormedWithUnusedHead, "local"),
    ],
)
def test_a_step_stopped_after_a_forward_leaves_the_buffers_as_they_were(ctx, make, strategy):
    """The last step's batches run out after its first micro-batch ran forward and backward: the
    model equals one trained on the completed steps only. Fails before: BatchNorm's running
    statistics (a moving average's buffer) kept that micro-batch: its gradients were dropped,
    its forward's updates not; a lazy BatchNorm's, made by the first step, were never copied."""
    steps, k = 3, 3
    seed = random.randrange(2**31)
    model, twin = seeded(make, seed), seeded(make, seed)  # twins: a ScriptModule's deepcopy breaks
    micro = micro_batches(steps, k, 4)[: (steps - 1) * k + 1]
    prepared = thd.prepare(twin, sgd, ctx=ctx, strategy=strategy)
    train_until_batches_run_out(ctx, prepared, micro, steps, k, r"batches ran out after 2 of 3 steps")
    completed, _ = run(
        ctx, model, micro[: (steps - 1) * k], steps - 1, strategy, gradient_accumulation_steps=k
    )
    stopped = prepared.model.module if strategy == "ddp" else prepared.model
    assert_same_buffers(stopped, completed)
    assert_same_parameters(stopped, completed)


class NormedWithPayload(Normed):
    """Normed with a packed integer payload in a persistent buffer, as GPTQ/AWQ layers keep their
    quantized weights: no forward updates it, so a copy each step would only double it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("packed", torch.randint(-(2**31), 2**31 - 1, (DIM, DIM), dtype=torch.int32))


def test_a_stopped_step_restores_the_statistics_and_leaves_integer_payloads_alone(ctx):
    """BatchNorm's three buffers are restored (the warning counts them); the int32 payload is not
    copied, so not counted."""
    stream = io.StringIO()
    telemetry.configure(log_level="warning", log_stream=stream)
    model = NormedWithPayload()
    packed = model.packed.clone()
    prepared = thd.prepare(model, sgd, ctx=ctx, strategy="local")
    train_until_batches_run_out(
        ctx, prepared, micro_batches(2, 2, 4)[:3], 2, 2, r"batches ran out after 1 of 2 steps"
    )
    assert "its buffers restored" in stream.getvalue() and "restored_buffers=3" in stream.getvalue()
    assert torch.equal(prepared.model.packed, packed)


def test_a_failing_forward_leaves_the_running_statistics_as_they_were(ctx):
    """One batch a step (no accumulation), its loss not a scalar: the error leaves the model as
    the completed step left it. Fails before: the failed forward had updated the statistics."""
    model = Normed()
    data = micro_batches(2, 1, 4)
    prepared = thd.prepare(copy.deepcopy(model), sgd, ctx=ctx, strategy="local")
    not_a_scalar = on_second_call(lambda model, loss: loss.expand(2))
    train_raising(
        ctx,
        prepared,
        data,
        2,
        InvalidArgumentError,
        r"the loss must be a scalar tensor",
        loss_fn=not_a_scalar,
    )
    completed, _ = run(ctx, model, data[:1], 1, "local")
    assert_same_buffers(prepared.model, completed)
    assert_same_parameters(prepared.model, completed)


def test_a_buffer_copy_that_fails_takes_no_batch(ctx, monkeypatch):
    """The copy of a buffer a forward assigned anew runs out of memory before the second step:
    train raises that error before taking the step's batch, so the caller's loader still holds
    it. Fails before: the batch was fetched first and lost."""
    prepared = thd.prepare(Averaged(), sgd, ctx=ctx, strategy="local")
    first = prepared.model.mean
    empty_like = torch.empty_like

    def out_of_memory_for_a_new_buffer(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if tensor is prepared.model.mean and tensor is not first:
            raise torch.OutOfMemoryError("no memory for the copy")
        return empty_like(tensor, *args, **kwargs)

    monkeypatch.setattr(torch, "empty_like", out_of_memory_for_a_new_buffer)
    data = micro_batches(3, 1, 4)
    source = iter(data)
    with pytest.raises(torch.OutOfMemoryError, match="no memory for the copy"):
        thd.train(prepared.model, prepared.optimizer, source, steps=3, ctx=ctx, policy=prepared.policy)
    assert next(source) is data[1]


class QuantizationAware(nn.Module):
    """Net's shape for eager-mode quantization-aware training: fake-quantized activations and
    per-channel weights, whose observers' ranges start with no element (scales with one) and
    are resized in place by their first forward."""

    def __init__(self) -> None:
        from torch.ao.quantization import DeQuantStub, QuantStub

        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.hidden, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.dequant(self.head(torch.relu(self.hidden(self.quant(x)))))
        return F.mse_loss(out.squeeze(-1), y)


@pytest.mark.parametrize("completed", [0, 2])
def test_quantization_aware_training_runs_and_a_stopped_step_restores_the_observers(ctx, completed):
    """`prepare_qat` with fbgemm's QAT qconfig: the steps after the first run (fails before: the
    observers' resized buffers no longer fit their copies at step 2), and a step stopped after
    its first micro-batch leaves the observers as the completed steps left them, as they were
    built when it is the first (fails before: restoring into a resized buffer raised)."""
    tq = pytest.importorskip("torch.ao.quantization", reason="eager-mode QAT needs torch.ao.quantization")
    model = QuantizationAware()
    model.train()
    model.qconfig = tq.get_default_qat_qconfig("fbgemm")
    with warnings.catch_warnings():  # torch.ao.quantization's deprecation and reduce_range notes
        warnings.simplefilter("ignore")
        tq.prepare_qat(model, inplace=True)
    steps, k = completed + 1, 2
    micro = micro_batches(steps, k, 4)[: completed * k + 1]
    prepared = thd.prepare(copy.deepcopy(model), sgd, ctx=ctx, strategy="local")
    train_until_batches_run_out(
        ctx, prepared, micro, steps, k, rf"ran out after {completed} of {steps} steps"
    )
    reference, stats = run(
        ctx, model, micro[: completed * k], completed, "local", gradient_accumulation_steps=k
    )
    assert len(stats) == completed
    assert_same_buffers(prepared.model, reference)
    assert_same_parameters(prepared.model, reference)


class Awkward(Normed):
    """Normed with a buffer made under `torch.inference_mode()` (written only in inference mode)
    and one that is an expanded view (`copy_` into it raises), both on a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Module()
        with torch.inference_mode():
            self.inner.register_buffer("table", torch.randn(DIM))
        self.inner.register_buffer("spread", torch.randn(1).expand(DIM))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.inner.table + self.inner.spread, y)


def test_a_buffer_that_cannot_be_restored_is_logged_and_the_users_error_raised(ctx):
    """The second step's loss_fn deletes BatchNorm's running mean and raises: that error is the
    one raised, the running statistics (the deleted one back on its module) and the
    inference-mode buffer are restored, the expanded buffer is logged by name and counted, and
    no gradient is left. Fails before: restoring raised its own error in place of the user's."""
    stream = io.StringIO()
    telemetry.configure(log_level="warning", log_stream=stream)
    key = "torchhal.train.buffers_not_restored"
    before = telemetry.counts().get(key, 0)
    model = Awkward()
    data = micro_batches(2, 1, 4)
    prepared = thd.prepare(copy.deepcopy(model), sgd, ctx=ctx, strategy="local")

    def delete_and_raise(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
        del model.norm.running_mean
        raise KeyError("the user's own error")

    train_raising(
        ctx, prepared, data, 2, KeyError, "the user's own error", loss_fn=on_second_call(delete_and_raise)
    )
    assert telemetry.counts().get(key, 0) == before + 1
    assert "a buffer was not restored" in stream.getvalue() and "buffer=inner.spread" in stream.getvalue()
    assert "running_mean" in prepared.model.norm._buffers
    assert all(p.grad is None for p in prepared.model.parameters())
    completed, _ = run(ctx, model, data[:1], 1, "local")
    assert_same_buffers(prepared.model, completed)
    assert_same_parameters(prepared.model, completed)


class Replicated(Net):
    """Net replicated over a device mesh (`distribute_module`: its parameters and buffers are
    DTensors) with a moving average of its inputs updated in place (not BatchNorm, which DTensor
    has no rule for in torch 2.11), and a plain buffer registered after: a count of forwards."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(DIM))
        distribute_module(
            self,
            mesh,
            input_fn=lambda _, inputs, mesh: tuple(
                DTensor.from_local(t, mesh, [Replicate()]) for t in inputs
            ),
            output_fn=lambda _, out, mesh: out.to_local(),
        )
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen.add_(1)
        self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return super().forward(x - self.mean, y)


def test_a_stopped_step_restores_dtensor_buffers(ctx):
    """DTensor and plain buffers together, on a mesh of this one rank: the completed steps run
    and a stopped one is undone. Fails before: the first step's copy raised (`_foreach_copy_` has
    no DTensor rule, nor takes DTensors and tensors together)."""
    model = Replicated(init_device_mesh("cpu", (1,)))
    assert isinstance(model.mean, DTensor) and not isinstance(model.seen, DTensor)
    steps, k = 3, 2
    micro = micro_batches(steps, k, 4)[: (steps - 1) * k + 1]
    prepared = thd.prepare(copy.deepcopy(model), sgd, ctx=ctx, strategy="local")
    train_until_batches_run_out(ctx, prepared, micro, steps, k, r"batches ran out after 2 of 3 steps")
    completed, _ = run(
        ctx, model, micro[: (steps - 1) * k], steps - 1, "local", gradient_accumulation_steps=k
    )

    def full(module: nn.Module) -> dict[str, torch.Tensor]:
        return {name: b.full_tensor() if isinstance(b, DTensor) else b for name, b in module.named_buffers()}

    torch.testing.assert_close(full(prepared.model), full(completed), rtol=0, atol=0)
    assert float(completed.seen) == (steps - 1) * k


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "2", None])
def test_bad_gradient_accumulation_steps_are_refused(ctx, value):
    prepared = thd.prepare(Net(), sgd, ctx=ctx, strategy="local")
    with pytest.raises(
        InvalidArgumentError, match=rf"gradient_accumulation_steps must be an integer >= 1, got {value!r}"
    ):
        thd.train(
            prepared.model,
            prepared.optimizer,
            micro_batches(1, 1, 2),
            steps=1,
            ctx=ctx,
            policy=prepared.policy,
            gradient_accumulation_steps=value,
        )
