"""prepare() and train() in this process, as a world of one rank over gloo: spans, logs, policies, errors."""

from __future__ import annotations

import copy
import io
import itertools
import math
import random
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchhal import HardwareAbstractionLayer
from torchhal import distributed as thd
from torchhal.distributed.health import HealthMonitor
from torchhal.hal_core import InvalidArgumentError, UnsupportedError, telemetry
from torchhal.hal_core.settings import Settings

NO_AUTOLOAD = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})


class Net(nn.Module):
    def __init__(self, dim: int = 10, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(self.head(x).squeeze(-1).float(), y)


def batches(n: int, rows: int = 6, dim: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(rows, dim), torch.randn(rows)) for _ in range(n)]


def train_prepared(prepared: thd.Prepared, data, steps: int, ctx, **options) -> list[thd.StepStats]:
    """thd.train of a prepared model and optimizer under its own precision policy."""
    return thd.train(
        prepared.model, prepared.optimizer, data, steps=steps, ctx=ctx, policy=prepared.policy, **options
    )


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def test_context_reports_this_rank(ctx):
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.device.id, ctx.backend) == (0, 1, 0, "cpu", "gloo")
    report = ctx.report()
    assert report["device"] == "cpu" and report["simulated"] is False and report["prefix"] is None
    assert ctx.is_main


def test_train_emits_a_span_per_step_and_a_log_line_every_few_steps(ctx):
    stream = io.StringIO()
    telemetry.configure(exporter="memory", log_level="info", log_stream=stream)
    prepared = thd.prepare(Net(), adamw, ctx=ctx, strategy="ddp")
    data = batches(3)
    stats = train_prepared(prepared, data, 3, ctx, clip_grad_norm=1.0, log_every=2, first_step=10)
    spans = [s for s in telemetry.memory_exporter().get_finished_spans() if s.name == "torchhal.train.step"]
    assert [s.attributes["step"] for s in spans] == [10, 11, 12]
    for span, stat in zip(spans, stats, strict=True):
        assert span.attributes["loss"] == stat.loss and span.attributes["grad_norm"] == stat.grad_norm
        assert span.attributes["step_time_s"] == stat.step_time_s > 0
        # a floating (rows, dim) batch counts its rows
        assert span.attributes["tokens_per_s"] == pytest.approx(len(data[0][0]) / stat.step_time_s)
    lines = [line for line in stream.getvalue().splitlines() if "train step" in line]
    assert len(lines) == 2 and "step=10" in lines[0] and "step=12" in lines[1]  # first, then every 2nd
    assert "trace_id=" in lines[0]
    assert all(stat.compute_s is None for stat in stats)  # no gradient sync: nothing to tell apart


def test_with_a_gradient_sync_each_step_reports_its_compute_time_before_the_sync(ctx):
    """compute_s is forward and backward only: a sync that sleeps adds to step_time_s, not to it."""
    pause = random.uniform(0.2, 0.3)
    prepared = thd.prepare(Net(), adamw, ctx=ctx, strategy="local")
    stats = train_prepared(prepared, batches(2), 2, ctx, grad_sync=lambda model: time.sleep(pause))
    for stat in stats:
        assert stat.compute_s is not None and 0 < stat.compute_s < pause < stat.step_time_s


def test_first_loss_and_gradient_norm_match_an_independent_computation(ctx):
    model = Net()
    twin = copy.deepcopy(model)
    data = batches(2)
    prepared = thd.prepare(model, adamw, ctx=ctx, strategy="ddp")
    stats = train_prepared(prepared, data, 2, ctx, clip_grad_norm=0.1)
    loss = twin(*data[0])
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in twin.parameters()]))
    assert stats[0].loss == pytest.approx(loss.item(), rel=1e-6)
    assert stats[0].grad_norm == pytest.approx(norm.item(), rel=1e-5)
    assert stats[0].tokens == len(data[0][0]) and stats[0].scale is None  # the floating batch's rows


def test_ddp_with_a_bf16_policy_computes_in_bf16_and_keeps_fp32_parameters(ctx):
    policy = thd.choose_precision(ctx.device, prefer="bf16")
    prepared = thd.prepare(Net(), adamw, ctx=ctx, strategy="ddp", policy=policy)
    seen = []
    prepared.model.module.layers[0][0].register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    stats = train_prepared(prepared, batches(2), 2, ctx)
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert all(p.dtype == torch.float32 for p in prepared.model.parameters())
    assert all(math.isfinite(s.loss) for s in stats)
    assert prepared.report()["precision"]["strategy"] == "ddp"
    assert prepared.report()["parameter_dtypes"] == ["float32"]


def test_the_report_gives_the_parameters_dtypes_as_the_model_holds_them(ctx):
    """A model made in bf16 keeps bf16 parameters (prepare casts nothing). Fails before: the
    report said float32 whatever the model held."""
    prepared = thd.prepare(Net().to(torch.bfloat16), adamw, ctx=ctx, strategy="local")
    assert prepared.report()["parameter_dtypes"] == ["bfloat16"]
    assert "param_dtype" not in prepared.report()["precision"]


def test_fp16_scales_the_loss_through_the_gradient_scaler(ctx):
    policy = thd.choose_precision(ctx.device, prefer="fp16")
    prepared = thd.prepare(Net(), adamw, ctx=ctx, strategy="ddp", policy=policy)
    assert prepared.scaler is not None
    scaled_norms = []  # gradient norms right after backward, before the scaler unscales them

    def capture(model: nn.Module) -> None:
        scaled_norms.append(
            torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        )

    stats = train_prepared(
        prepared,
        batches(3),
        3,
        ctx,
        scaler=prepared.scaler,
        clip_grad_norm=1e9,  # reports the unscaled norm, clips nothing
        grad_sync=capture,
    )
    scales = [65536.0] + [s.scale for s in stats]  # the scale each step ran with, then the last update
    for before, after in itertools.pairwise(scales):
        assert after in (before, before / 2), scales  # kept, or halved after an overflow
    assert any(math.isfinite(n) for n in scaled_norms), scaled_norms
    for step, (scaled, stat) in enumerate(zip(scaled_norms, stats, strict=True)):
        if math.isfinite(scaled):  # the loss was multiplied by the scale before backward
            assert scaled.item() / stat.grad_norm == pytest.approx(scales[step], rel=1e-3)
    with pytest.raises(InvalidArgumentError, match="policy 'fp16' needs a gradient scaler"):
        train_prepared(prepared, batches(1), 1, ctx)


def test_an_fp16_overflow_step_the_scaler_skips_passes_the_health_monitor(ctx, tmp_path):
    """A scaler skip is GradScaler's normal behaviour: recorded and counted, not a NonFiniteError."""
    policy = thd.choose_precision(ctx.device, prefer="fp16")
    prepared = thd.prepare(Net(), adamw, ctx=ctx, strategy="ddp", policy=policy)
    init_scale = 2.0 ** random.randint(8, 12)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    blow_up = random.uniform(1e8, 1e9)  # fp16 gradients of loss x scale overflow on the first step only
    calls = itertools.count()

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        loss = model(*batch)
        return loss * blow_up if next(calls) == 0 else loss

    monitor = HealthMonitor(dist.FileStore(str(tmp_path / "health"), 1), rank=0, world_size=1)
    before = telemetry.counts().get("torchhal.health.scaler_skipped", 0)
    weights = [p.detach().clone() for p in prepared.model.parameters()]
    after_step: list[list[torch.Tensor]] = []

    def observe(stats: thd.StepStats) -> None:
        after_step.append([p.detach().clone() for p in prepared.model.parameters()])
        monitor.observe(stats)

    stats = train_prepared(
        prepared, batches(2), 2, ctx, scaler=scaler, clip_grad_norm=1e9, loss_fn=loss_fn, on_step=observe
    )
    first, second = stats
    assert first.scaler_skipped and not math.isfinite(first.grad_norm) and math.isfinite(first.loss)
    assert first.scale == init_scale / 2  # the scaler backed off
    assert not second.scaler_skipped and math.isfinite(second.grad_norm) and second.scale == init_scale / 2
    assert telemetry.counts()["torchhal.health.scaler_skipped"] == before + 1
    assert all(torch.equal(w, p) for w, p in zip(weights, after_step[0], strict=True))  # skipped: untouched
    assert all(
        p.isfinite().all() and not torch.equal(w, p) for w, p in zip(weights, after_step[1], strict=True)
    )


def test_fsdp_on_one_rank_shards_each_block_and_trains(ctx):
    prepared = thd.prepare(Net(depth=3), adamw, ctx=ctx, strategy="fsdp")
    assert prepared.sharded_blocks == 3 and prepared.policy.strategy == "fsdp"
    stats = train_prepared(prepared, batches(2), 2, ctx, clip_grad_norm=1.0)
    assert all(math.isfinite(s.loss) and s.grad_norm > 0 for s in stats)


def test_fsdp_without_blocks_shards_the_root_and_says_so(ctx):
    key = "torchhal.distributed.fsdp_root_only"
    before = telemetry.counts().get(key, 0)
    model = nn.Sequential(nn.Linear(4, 4))
    prepared = thd.prepare(model, adamw, ctx=ctx, strategy="fsdp")
    assert prepared.sharded_blocks == 0 and telemetry.counts()[key] == before + 1


def test_fsdp_refuses_an_optimizer_that_has_already_stepped(ctx):
    model = Net()
    optimizer = adamw(model.parameters())
    model(*batches(1)[0]).backward()
    optimizer.step()
    with pytest.raises(InvalidArgumentError, match=r"the optimizer has state \(it has stepped"):
        thd.prepare(model, optimizer, ctx=ctx, strategy="fsdp")


def test_an_optimizer_over_other_parameters_is_refused(ctx):
    other = nn.Linear(2, 2)
    with pytest.raises(InvalidArgumentError, match=r"holds 2 parameter\(s\) that are not the model's"):
        thd.prepare(Net(), adamw(other.parameters()), ctx=ctx)


def test_an_unknown_strategy_is_refused(ctx):
    with pytest.raises(UnsupportedError, match=r"strategy must be one of .* got 'zero3'"):
        thd.prepare(Net(), adamw, ctx=ctx, strategy="zero3")


def test_bad_batches_and_arguments_are_refused_with_the_value_seen(ctx):
    prepared = thd.prepare(Net(), adamw, ctx=ctx, strategy="local")
    run = lambda data, steps=1, **kw: train_prepared(prepared, data, steps, ctx, **kw)  # noqa: E731
    x, y = batches(1)[0]
    with pytest.raises(InvalidArgumentError, match=r"a batch tensor is on meta, but rank 0 trains on cpu"):
        run([(x.to("meta"), y)])
    with pytest.raises(InvalidArgumentError, match="batches ran out after 1 of 2 steps"):
        run([(x, y)], steps=2)
    with pytest.raises(
        InvalidArgumentError, match=r"the loss must be a scalar tensor, got a tensor of shape \(6,\)"
    ):
        run([(x, y)], loss_fn=lambda model, batch: batch[1])
    with pytest.raises(InvalidArgumentError, match="steps must be >= 0, got -1"):
        run([], steps=-1)
    with pytest.raises(InvalidArgumentError, match="clip_grad_norm must be > 0 or None, got 0"):
        run([], clip_grad_norm=0)


def test_an_optimizer_whose_step_needs_a_closure_is_refused_before_any_batch(ctx):
    """LBFGS's step evaluates the loss itself; train has no closure to give it. Fails before: the
    first forward and backward ran, then step() raised a TypeError logged as a partial update."""
    model = Net()
    before = copy.deepcopy(model.state_dict())
    prepared = thd.prepare(model, lambda params: torch.optim.LBFGS(params), ctx=ctx, strategy="local")
    taken = []
    data = (taken.append(batch) or batch for batch in batches(2))
    with pytest.raises(InvalidArgumentError, match=r"train: LBFGS\.step needs a closure"):
        train_prepared(prepared, data, 2, ctx)
    assert taken == []
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


def test_transformer_blocks_are_found_by_container_name_or_predicate():
    class GPT2Like(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(4, 4)
            self.h = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    model = GPT2Like()
    assert thd.transformer_blocks(model) == list(model.h)
    assert thd.transformer_blocks(model, lambda m: isinstance(m, nn.Embedding)) == [model.wte]
    assert thd.transformer_blocks(nn.Sequential(nn.Linear(2, 2))) == []


def test_a_prefixed_group_rendezvous_through_an_init_method(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    hal = HardwareAbstractionLayer(settings=NO_AUTOLOAD)
    url = f"file://{tmp_path / 'rendezvous'}"
    context = thd.init(hal, device="cpu", rank=0, world_size=1, init_method=url, prefix="gen3")
    try:
        assert context.prefix == "gen3" and dist.is_initialized()
        t = torch.tensor([2.0])
        context.communicator.all_reduce(t)
        assert t.item() == 2.0
    finally:
        context.shutdown()
    assert not dist.is_initialized()


class WithNorm(Net):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(x), y)


def test_training_keeps_a_submodule_frozen_with_eval_and_trains_a_model_left_in_eval(ctx):
    """A BatchNorm frozen for fine-tuning keeps its statistics (train() made every submodule train);
    a whole model left in evaluation mode (after validation) trains in training mode."""
    model = WithNorm()
    model.norm.running_mean.normal_()
    model.norm.eval()
    stats_before = model.norm.running_mean.clone()
    prepared = thd.prepare(model, adamw, ctx=ctx, strategy="local")
    train_prepared(prepared, batches(2), 2, ctx)
    assert not model.norm.training and model.training and torch.equal(model.norm.running_mean, stats_before)
    model.eval()
    train_prepared(prepared, batches(2), 2, ctx)
    assert all(m.training for m in model.modules())
    assert not torch.equal(model.norm.running_mean, stats_before)
