"""`prepare` with real-world architectures: a mixture of experts whose steps leave experts idle
(DDP options; FSDP2 across ranks that route apart), models already wrapped inside, and FSDP2 with
parameters of another dtype (complex filters, an fp64 piece).

Single-process checks run in a world of one over gloo; the two-rank checks run in one world of
processes (`_moe_worker.py`), each reported as its own test.
"""

from __future__ import annotations

import copy
import importlib.util
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from tests.distributed.launch import check_outcome, run_world
from torchhal import distributed as thd
from torchhal.hal_core import InvalidArgumentError

WORKER = Path(__file__).with_name("_moe_worker.py")
DIM = 8


def load_worker():
    """The worker script as a module (its scenario's check names, its MoE model)."""
    spec = importlib.util.spec_from_file_location("torchhal_moe_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = load_worker()


def fp32(ctx) -> thd.PrecisionPolicy:
    return thd.choose_precision(ctx.device, prefer="fp32")


def train_local_reference(ctx, model: nn.Module, data, optimizer) -> nn.Module:
    """The same steps in plain fp32 with no wrapper: what every prepared run must match."""
    reference = thd.prepare(model, optimizer, ctx=ctx, strategy="local", policy=fp32(ctx))
    thd.train(reference.model, reference.optimizer, data, steps=len(data), ctx=ctx, policy=reference.policy)
    return reference.model


def assert_same_parameters(got: nn.Module, want: nn.Module, rtol: float, atol: float) -> None:
    for (name, p), (_, q) in zip(got.named_parameters(), want.named_parameters(), strict=True):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(full, q, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


# -- DDP options: a mixture of experts whose steps leave experts idle --------------------------


def routed_batches(steps: int, rows: int) -> list[tuple[torch.Tensor, ...]]:
    """Step s sends every row to one expert (s mod EXPERTS): the others get no tokens."""
    return [
        (torch.randn(rows, DIM), torch.randn(rows), torch.full((rows,), s % worker.EXPERTS))
        for s in range(steps)
    ]


def test_ddp_options_let_a_mixture_of_experts_with_idle_experts_train(ctx):
    """DDP's default raises in the step after one with idle experts, and prepare wrapped DDP with
    no way to pass find_unused_parameters (a model already wrapped in DDP is refused). Fails
    before: prepare took no ddp_options. With it the run matches one with no wrapper."""
    torch.manual_seed(random.randrange(2**31))
    model = worker.MoE(DIM)
    data = routed_batches(3, random.randint(3, 6))
    default = thd.prepare(copy.deepcopy(model), worker.sgd, ctx=ctx, strategy="ddp")
    with pytest.raises(RuntimeError, match="find_unused_parameters"):
        thd.train(default.model, default.optimizer, data, steps=3, ctx=ctx, policy=default.policy)
    reference = train_local_reference(ctx, copy.deepcopy(model), data, worker.sgd)
    prepared = thd.prepare(
        model, worker.sgd, ctx=ctx, strategy="ddp", ddp_options={"find_unused_parameters": True}
    )
    assert prepared.model.find_unused_parameters
    thd.train(prepared.model, prepared.optimizer, data, steps=3, ctx=ctx, policy=prepared.policy)
    assert_same_parameters(prepared.model.module, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("strategy", "options", "match"),
    [
        (
            "fsdp",
            {"find_unused_parameters": True},
            r"ddp_options apply to strategy 'ddp' only, got strategy 'fsdp'",
        ),
        ("ddp", {"process_group": None}, r"may not set 'process_group': prepare sets it from ctx"),
        ("ddp", {"device_ids": [0]}, r"may not set 'device_ids'"),
        (
            "ddp",
            {"find_unused_params": True},
            r"'find_unused_params', which DistributedDataParallel does not take",
        ),
    ],
)
def test_ddp_options_are_checked_before_anything_is_wrapped(ctx, strategy, options, match):
    model = worker.MoE(DIM)
    with pytest.raises(InvalidArgumentError, match=match):
        thd.prepare(model, worker.sgd, ctx=ctx, strategy=strategy, ddp_options=options)
    assert not isinstance(model, FSDPModule)
    assert not any(hasattr(p, "full_tensor") for p in model.parameters())


# -- models already wrapped inside --------------------------------------------------------------


def compiled_ddp(ctx, model: nn.Module) -> nn.Module:
    return torch.compile(
        DistributedDataParallel(model, process_group=ctx.communicator.group), backend="eager"
    )


def ddp_layer(ctx, model: nn.Module) -> nn.Module:
    model.layers[0] = DistributedDataParallel(model.layers[0], process_group=ctx.communicator.group)
    return model


def sharded(ctx, model: nn.Module) -> nn.Module:
    fully_shard(model.layers[1])
    return model


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize(
    ("wrap", "match"),
    [
        (
            compiled_ddp,
            r"already wrapped in DistributedDataParallel \(at model\._orig_mod\).*model\._orig_mod\.module",
        ),
        (
            ddp_layer,
            r"already wrapped in DistributedDataParallel \(at model\.layers\.0\).*model\.layers\.0\.module",
        ),
        (sharded, r"already sharded by FSDP \(at model\.layers\.1, a FSDPSequential\)"),
    ],
)
def test_a_model_wrapped_for_data_parallelism_inside_is_refused(ctx, strategy, wrap, match):
    """Fails before: only a DDP at the root was refused. torch.compile(DDP(m)) and a DDP layer were
    wrapped again (every gradient reduced twice, keys nested); a model fully_shard had sharded
    failed at the first forward deep inside torch ("Invariant encountered", "would remove or
    reshape sharded dimension 0")."""
    model = wrap(ctx, worker.MoE(DIM))
    with pytest.raises(InvalidArgumentError, match=match):
        thd.prepare(model, worker.sgd, ctx=ctx, strategy=strategy)


# -- FSDP2 with parameters of another dtype -------------------------------------------------------


class Spectral(nn.Module):
    """A learned complex filter over the last dimension's spectrum (Fourier-layer style)."""

    def __init__(self) -> None:
        super().__init__()
        self.filter = nn.Parameter(torch.randn(DIM // 2 + 1, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.irfft(torch.fft.rfft(x.float()) * self.filter, n=DIM).to(x.dtype)


class Float64(nn.Module):
    """A piece the user keeps in fp64 on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.double()).to(x.dtype)


class WithPiece(nn.Module):
    def __init__(self, piece: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2))
        self.piece = piece
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(self.head(self.piece(x)).squeeze(-1).float(), y.float())


def sgd(params):
    """Plain SGD: its update is proportional to the gradient, so bf16's error stays bf16-sized
    (Adam's normalised update turns a near-zero gradient's rounding into a whole step)."""
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("prefer", ["fp32", "bf16"])
@pytest.mark.parametrize("piece", [Spectral, Float64])
def test_fsdp_trains_complex_and_fp64_pieces_in_their_own_dtype(ctx, piece, prefer):
    """Fails before: FSDP2 put the piece's parameters in the root's unit with fp32 ones and raised
    "FSDP expects uniform original parameter dtype" at the first forward. Now the piece is its
    own unit, uncast: the fp64 piece computes in fp64 under the bf16 policy too, the complex
    filter's imaginary part trains, and the run matches one with no wrapper."""
    torch.manual_seed(random.randrange(2**31))
    model = WithPiece(piece())
    start = {name: p.detach().clone() for name, p in model.piece.named_parameters()}
    data = [(torch.randn(6, DIM), torch.randn(6)) for _ in range(3)]
    reference = train_local_reference(ctx, copy.deepcopy(model), data, sgd)
    policy = thd.choose_precision(ctx.device, prefer=prefer)
    prepared = thd.prepare(model, sgd, ctx=ctx, strategy="fsdp", policy=policy)
    seen = []
    model.piece.register_forward_pre_hook(lambda m, args: seen.append(next(m.parameters()).dtype))
    thd.train(prepared.model, prepared.optimizer, data, steps=3, ctx=ctx, policy=prepared.policy)
    assert seen == [next(iter(start.values())).dtype] * 3
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if prefer == "fp32" else {"rtol": 0.02, "atol": 0.01}
    assert_same_parameters(prepared.model, reference, **tolerance)
    for name, p in prepared.model.piece.named_parameters():
        moved = p.full_tensor() - start[name]
        assert p.dtype == start[name].dtype, name
        if p.is_complex():  # a real signal's first and last bins have no imaginary part to learn
            assert torch.view_as_real(moved)[1:-1].abs().min() > 0, name
        else:
            assert moved.abs().min() > 0, name


class MixedFilter(nn.Module):
    """One module holding an fp32 gain and a complex filter itself: no unit can separate them."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(DIM))
        self.filter = nn.Parameter(torch.randn(DIM // 2 + 1, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.irfft(torch.fft.rfft(x * self.gain) * self.filter, n=DIM)


def test_fsdp_refuses_a_module_with_trainable_parameters_of_two_dtypes_at_prepare(ctx):
    """Fails before: prepare sharded it and train raised torch's bare AssertionError ("FSDP
    expects uniform original parameter dtype") at the first forward, naming no parameter."""
    model = WithPiece(MixedFilter())
    with pytest.raises(
        InvalidArgumentError,
        match=r"module '<root>' as one unit, .* of 2: torch\.float32: 3 \(piece\.gain, head\.weight, "
        r"head\.bias\); torch\.complex64: 1 \(piece\.filter\)",
    ):
        thd.prepare(model, sgd, ctx=ctx, strategy="fsdp")
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    model.piece.filter.requires_grad_(False)  # a frozen odd one is not reduced: it shards
    prepared = thd.prepare(model, sgd, ctx=ctx, strategy="fsdp")
    thd.train(
        prepared.model,
        prepared.optimizer,
        [(torch.randn(4, DIM), torch.randn(4))],
        steps=1,
        ctx=ctx,
        policy=prepared.policy,
    )


# -- two ranks routing to different experts -------------------------------------------------------


@pytest.fixture(scope="module")
def moe_world(tmp_path_factory):
    return run_world(WORKER, "moe", 2, tmp_path_factory.mktemp("moe"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", worker.check_names("moe"))
def test_moe_world(moe_world, name):
    results, seed = moe_world
    check_outcome(results, seed, name)


# -- an optimizer instance under fsdp: the same object, its scheduler still steering it ---------


def test_an_lr_scheduler_made_before_fsdp_prepare_still_steers_the_optimizer(ctx):
    """Fails before: prepare returned a new optimizer built over the shards, and the scheduler made
    on the user's instance stepped that discarded one (lr 0.0125 there, 0.1 in training)."""
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    prepared = thd.prepare(model, optimizer, ctx=ctx, strategy="fsdp", policy=fp32(ctx))
    assert prepared.optimizer is optimizer
    held = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert held == [id(p) for p in prepared.model.parameters()]
    lrs = []
    data = [(torch.randn(4, DIM), torch.randn(4)) for _ in range(3)]

    def on_step(_stats: thd.StepStats) -> None:
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step()

    thd.train(
        prepared.model,
        prepared.optimizer,
        data,
        steps=3,
        ctx=ctx,
        policy=prepared.policy,
        loss_fn=lambda m, b: F.mse_loss(m(b[0]).squeeze(-1), b[1]),
        on_step=on_step,
    )
    assert lrs == [0.1, 0.05, 0.025]


def test_ddp_static_graph_with_gradient_accumulation_is_refused_before_a_step(ctx):
    """torch's no_sync fails an internal assertion under a static graph (pytorch issue 143580); its
    open fix would stop the all-reduce silently from the second step on. Refused, nothing run."""
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1))
    prepared = thd.prepare(model, worker.sgd, ctx=ctx, strategy="ddp", ddp_options={"static_graph": True})
    before = [p.detach().clone() for p in prepared.model.parameters()]
    with pytest.raises(InvalidArgumentError, match=r"static_graph=True does not support .*issue 143580"):
        thd.train(
            prepared.model,
            prepared.optimizer,
            [(torch.randn(4, DIM), torch.randn(4)) for _ in range(4)],
            steps=2,
            ctx=ctx,
            policy=prepared.policy,
            loss_fn=lambda m, b: F.mse_loss(m(b[0]).squeeze(-1), b[1]),
            gradient_accumulation_steps=2,
        )
    assert all(torch.equal(p, q) for p, q in zip(prepared.model.parameters(), before, strict=True))


def test_an_optimizer_that_holds_its_parameter_list_sees_the_shards(ctx):
    """LBFGS keeps its group's parameter list as `_params`. Fails before (in-place swap of the
    group's list for a new one): it kept the discarded parameters and its steps changed nothing."""
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1))
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1)
    prepared = thd.prepare(model, optimizer, ctx=ctx, strategy="fsdp", policy=fp32(ctx))
    assert [id(p) for p in optimizer._params] == [id(p) for p in prepared.model.parameters()]


def test_an_optimizer_with_state_from_its_making_is_refused_saying_so(ctx):
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1))
    with pytest.raises(
        InvalidArgumentError, match=r"has state \(it has stepped, or made state .* as Adagrad does\)"
    ):
        thd.prepare(
            model, torch.optim.Adagrad(model.parameters()), ctx=ctx, strategy="fsdp", policy=fp32(ctx)
        )


class ScaledBody(nn.Module):
    """Blocks inside a module whose own parameter is fp64: the module is a unit of its own, uncast,
    that contains the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2))
        self.scale = nn.Parameter(torch.ones(DIM, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return (x.double() * self.scale).to(x.dtype)


def test_fsdp_shards_blocks_before_the_uncast_unit_that_contains_them(ctx):
    """Fails before: the fp64 unit was sharded (and checked) before its blocks, so it held their
    fp32 parameters too and prepare refused a model that shards fine blocks first."""
    torch.manual_seed(random.randrange(2**31))
    model = nn.Sequential(ScaledBody(), nn.Linear(DIM, 1))
    data = [(torch.randn(6, DIM), torch.randn(6)) for _ in range(3)]
    loss = lambda m, b: F.mse_loss(m(b[0]).squeeze(-1), b[1])  # noqa: E731
    reference = thd.prepare(copy.deepcopy(model), sgd, ctx=ctx, strategy="local", policy=fp32(ctx))
    thd.train(reference.model, reference.optimizer, data, steps=3, ctx=ctx, policy=fp32(ctx), loss_fn=loss)
    prepared = thd.prepare(model, sgd, ctx=ctx, strategy="fsdp", policy=fp32(ctx))
    assert prepared.sharded_blocks == 2
    thd.train(
        prepared.model, prepared.optimizer, data, steps=3, ctx=ctx, policy=prepared.policy, loss_fn=loss
    )
    assert_same_parameters(prepared.model, reference.model, rtol=1e-5, atol=1e-6)
